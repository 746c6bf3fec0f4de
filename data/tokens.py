"""A pre-tokenized corpus in nanoGPT's layout for language models: windows of token ids (token_windows.py).

The folder ``root`` holds ``train.bin`` and ``val.bin``, flat arrays of token ids of type ``dtype`` (what
nanoGPT's ``prepare.py`` scripts write), read through memory maps, and ``meta.json`` (``{"vocab_size": N}``)
where the ids do not say their vocabulary's size; without it ``data.vocab_size`` says it. A ``meta.pkl`` is
never read (unpickling can run code). When the config is checked only the files' sizes and ``meta.json``
are read; token ids beyond the vocabulary are refused on the ranks, in every batch read, and for a split of
up to :data:`FULL_CHECK_BYTES` (read whole) when the data set is built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING, DictConfig
from omegaconf.errors import MissingMandatoryValue

from runner.data import from_files
from runner.schema import DataConfig, one_of, require

if TYPE_CHECKING:
    from runner.data.base import ClassificationData

DTYPES = {"uint16": 2, "uint32": 4}  # data.dtype -> bytes per token
SPLITS = ("train", "val")
#: A split file up to this size has its largest token id checked when the data set is built (a read of every
#: token, on every rank: about a second per GB); a larger one only batch by batch, as it is read.
FULL_CHECK_BYTES = 1 << 30
#: ``vocab_size`` where no file says it (no meta.json) and the user gave none: lets the other groups be
#: checked, then refused by ``__post_init__`` (a value nobody gives).
UNKNOWN_VOCAB = 2**31 - 1


def check_outputs(cfg: Any, vocab_size: int, source: str) -> None:
    """Fill in (where still ``${mpitrain_data:KEY}``) and check the outputs of a language-model data set:
    ``shape`` is ``[block_size]``, ``num_classes`` and ``vocab_size`` are ``vocab_size``, which ``source``
    (the files, in words) fixes."""
    outputs = {"shape": [cfg.block_size], "num_classes": vocab_size, "vocab_size": vocab_size}
    for key, value in outputs.items():
        if isinstance(getattr(cfg, key), str):
            setattr(cfg, key, value)
    require(
        list(cfg.shape) == [cfg.block_size],
        "shape",
        cfg.shape,
        f"a window is [block_size] = [{cfg.block_size}] tokens: leave it unset (set data.block_size)",
    )
    for key in ("vocab_size", "num_classes"):
        require(
            getattr(cfg, key) == vocab_size,
            key,
            getattr(cfg, key),
            f"{source} has a vocabulary of {vocab_size}: leave it unset, or use data.{key}={vocab_size}",
        )


def require_block_size(block_size: int) -> None:
    require(block_size >= 1, "block_size", block_size, "tokens per window (the context), >= 1, e.g. 64")


def meta_vocab_size(root: Path) -> int | None:
    """``root/meta.json``'s ``vocab_size``; None where there is no meta.json; a ValueError naming data.root
    for a malformed one."""
    path = root / "meta.json"
    if not path.is_file():
        return None
    try:
        size = json.loads(path.read_text())["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        size, why = None, f"{type(err).__name__}: {err}"
    else:
        why = f"vocab_size {size!r}"
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(
            f'root={str(root)!r} is invalid: {path} must be {{"vocab_size": N}} with N >= 1 ({why}); '
            "fix it, or remove it and set data.vocab_size"
        )
    return size


@dataclass
class TokensConfig(DataConfig):
    """Windows of ``block_size + 1`` token ids of ``train.bin`` / ``val.bin``. ``shape`` ([block_size]),
    ``num_classes`` and ``vocab_size`` are outputs, read from ``meta.json`` when the config is checked: leave
    them unset (a value given must match); without a meta.json, ``vocab_size`` is a setting."""

    PATHS = ("root",)

    root: str = MISSING  # a folder holding train.bin, val.bin and meta.json (nanoGPT's prepare.py layout)
    dtype: str = "uint16"  # of the token ids in the .bin files: uint16 | uint32
    block_size: int = 64  # tokens per window: inputs and targets are [block_size]
    vocab_size: int = from_files("vocab_size")  # from meta.json; give it where there is none
    shape: list[int] = from_files("shape")
    num_classes: int = from_files("num_classes")
    workers: int | None = 0  # background loader processes per rank (0: windows are cheap to cut)

    @classmethod
    def files_outputs(cls, settings: Any) -> dict[str, Any]:
        block_size = settings.block_size if isinstance(settings.block_size, int) else 64
        try:
            vocab = meta_vocab_size(Path(settings.root))
        except (ValueError, OSError, TypeError, MissingMandatoryValue):
            vocab = None
        if vocab is None:  # no file says it: the user's, or a stand-in
            node = settings._get_node("vocab_size") if isinstance(settings, DictConfig) else None
            raw = node._value() if node is not None else settings.vocab_size  # not resolved: it may be us
            given = settings.vocab_size if raw != from_files("vocab_size") else None
            vocab = given if isinstance(given, int) else UNKNOWN_VOCAB
        return {"shape": [block_size], "num_classes": vocab, "vocab_size": vocab}

    def __post_init__(self) -> None:
        one_of("dtype", self.dtype, tuple(DTYPES))
        require_block_size(self.block_size)
        self.require_workers(self.workers)
        root = Path(self.root)
        missing = [f"{split}.bin" for split in SPLITS if not (root / f"{split}.bin").is_file()]
        require(
            not missing,
            "root",
            self.root,
            f"missing {', '.join(missing)}: a folder of train.bin and val.bin, flat arrays of token ids as "
            "nanoGPT's prepare.py writes them",
        )
        if missing:
            return
        if self.dtype in DTYPES:
            for split in SPLITS:
                self._check_split(root / f"{split}.bin", split)
        vocab = meta_vocab_size(root)
        if vocab is not None:
            check_outputs(self, vocab, f"{root / 'meta.json'}")
            self._check_width(vocab)
            return
        given = self.vocab_size if not isinstance(self.vocab_size, str) else UNKNOWN_VOCAB
        pickled = (root / "meta.pkl").exists()
        pickled = " holds meta.pkl, which is not read (unpickling can run code), and" if pickled else ""
        require(
            given != UNKNOWN_VOCAB,
            "vocab_size",
            None,
            f"{root}{pickled} has no meta.json to say the vocabulary's size: write {root / 'meta.json'} as "
            '{"vocab_size": N}, or set data.vocab_size=N',
        )
        require(given >= 1, "vocab_size", given, "token ids are 0 .. vocab_size - 1: >= 1")
        if given != UNKNOWN_VOCAB:
            check_outputs(self, given, "data.vocab_size")
            self._check_width(given)

    def _check_width(self, vocab: int) -> None:
        """uint16 holds ids below 65,536: a larger vocabulary's files are uint32, and uint32 files read as
        uint16 would give ids that all look valid."""
        require(
            self.dtype != "uint16" or vocab <= 1 << 16,
            "dtype",
            self.dtype,
            f"a vocabulary of {vocab} tokens does not fit in uint16: its files hold uint32 ids "
            "(data.dtype=uint32)",
        )

    def _check_split(self, path: Path, split: str) -> None:
        size, itemsize = path.stat().st_size, DTYPES[self.dtype]
        require(
            size % itemsize == 0,
            "dtype",
            self.dtype,
            f"{path} has {size} bytes, not a whole number of {itemsize}-byte {self.dtype} token ids: set "
            f"data.dtype to the type the file was written in ({', '.join(DTYPES)})",
        )
        require(
            size // itemsize >= self.block_size + 1,
            "block_size",
            self.block_size,
            f"the {split} split {path} holds {size // itemsize} tokens, fewer than the block_size + 1 = "
            f"{self.block_size + 1} of one window: use a smaller data.block_size (or more tokens)",
        )

    def build(self) -> ClassificationData:
        from runner.data.base import ClassificationData
        from runner.data.token_windows import MappedWindows, out_of_range

        root = Path(self.root)
        splits = [
            MappedWindows(root / f"{s}.bin", self.dtype, self.block_size, self.vocab_size) for s in SPLITS
        ]
        for split in splits:  # every batch is checked; a small file all at once, before training
            if split.path.stat().st_size <= FULL_CHECK_BYTES and split.largest() >= self.vocab_size:
                raise ValueError(out_of_range(split.path, split.largest(), self.vocab_size, self.dtype))
        return ClassificationData(
            *splits, shape=[self.block_size], num_classes=self.vocab_size, workers=self.workers
        )
