"""Characters of a text, for language models: nanoGPT's shakespeare_char (windows: token_windows.py).

The text is ``<root>/input.txt``, the tinyshakespeare corpus of char-rnn (:data:`URL`): downloaded there when
absent (``root`` defaults to :func:`cache_folder`), and its size and sha256 checked when the config is
checked, before any process starts (once per version of the file and process). ``file`` takes a UTF-8 text
of one's own instead, unchecked. As nanoGPT's ``prepare.py`` does, the first 90% of the characters train
and the rest validate; the vocabulary is the sorted distinct characters of the training split (token id =
index; the corpus has 65), and a validation character outside it is refused.

Turning token ids back into text (a sampler): the run's config (``runner.schema.config.load(RUN_DIR /
"config.yaml")``) has ``data.decode(ids)``, ``data.encode(text)`` and ``data.vocabulary()``, and the built
data set's ``classes`` is the vocabulary.
"""

from __future__ import annotations

import functools
import hashlib
import http.client
import os
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.data import from_files
from runner.data.tokens import check_outputs, require_block_size
from runner.schema import READING_RUN_FOLDER, DataConfig, require

if TYPE_CHECKING:
    from collections.abc import Iterable

    from runner.data.base import ClassificationData

URL = "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt"
SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SIZE = 1_115_394  # bytes
NAME = "input.txt"
VOCAB = 65  # the corpus's distinct characters: the stand-in while it is not there to read
TRAIN_FRACTION = 0.9
TIMEOUT_S = 30


def cache_folder() -> Path:
    """The default ``root``: ``$MPITRAIN_CACHE/shakespeare_char`` (the cache of data=digits too), else
    ``$XDG_CACHE_HOME/mpitrain/shakespeare_char``, else ``~/.cache/mpitrain/shakespeare_char``."""
    if os.environ.get("MPITRAIN_CACHE"):
        return Path(os.environ["MPITRAIN_CACHE"]) / "shakespeare_char"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mpitrain" / "shakespeare_char"


def read_text(path: Path) -> str:
    """The file's characters exactly (no newline translation); UnicodeDecodeError where it is not UTF-8."""
    with open(path, encoding="utf-8", newline="") as f:
        return f.read()


def cut(length: int) -> int:
    """Characters of the training split of a text of ``length`` characters (nanoGPT's ``int(n*0.9)``)."""
    return int(length * TRAIN_FRACTION)


@dataclass(frozen=True)
class Text:
    """What checking a config needs of a text file."""

    length: int  # characters
    vocabulary: tuple[str, ...]  # the training split's distinct characters, sorted
    unknown: tuple[str, ...]  # validation characters outside the vocabulary


def describe(path: Path) -> Text:
    """The file's :class:`Text`, read once per version (path, modification time, size)."""
    stat = path.stat()
    return _describe(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _describe(path: str, mtime_ns: int, size: int) -> Text:
    text = read_text(Path(path))
    train = set(text[: cut(len(text))])
    return Text(len(text), tuple(sorted(train)), tuple(sorted(set(text[cut(len(text)) :]) - train)))


@functools.lru_cache(maxsize=8)
def _sha256(path: str, mtime_ns: int, size: int) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def corpus_problem(path: Path) -> str | None:
    """Why ``path`` is not the tinyshakespeare corpus (None: it is), cheaply: its size, then its sha256."""
    stat = path.stat()
    if stat.st_size == SIZE and _sha256(str(path), stat.st_mtime_ns, stat.st_size) == SHA256:
        return None
    return (
        f"{path} is not the tinyshakespeare corpus ({stat.st_size} bytes; expected {SIZE} bytes of sha256 "
        f"{SHA256}): remove it to have it downloaded again, or download {URL} to {path}; or give your "
        "own text as data.file"
    )


def download(path: Path) -> str | None:
    """Fetch the corpus into ``path``: checked, then written atomically (a temporary file renamed), and the
    path printed. Returns why it failed, or None."""
    advice = f"download {URL} to {path} (or set data.root to a folder that holds {NAME})"
    try:
        with urllib.request.urlopen(URL, timeout=TIMEOUT_S) as response:
            body = response.read(SIZE + 1)
    except (OSError, ValueError, http.client.HTTPException) as err:
        return f"{path} is absent and fetching it failed ({' '.join(str(err).split())}): {advice}"
    if len(body) != SIZE or hashlib.sha256(body).hexdigest() != SHA256:
        return f"{path} is absent and {URL} gave {len(body)} bytes that are not the corpus: {advice}"
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{NAME}.", delete=False) as tmp:
            tmp.write(body)
        os.chmod(tmp.name, 0o644)  # (a shared cache: readable by others, as a file the user wrote would be)
        os.replace(tmp.name, path)
        tmp = None
    except OSError as err:
        return f"{path} is absent and cannot be written ({' '.join(str(err).split())}): {advice}"
    finally:
        if tmp is not None:  # not renamed (a failure, or an interrupt): no partial file is left
            Path(tmp.name).unlink(missing_ok=True)
    print(f"data=shakespeare_char: saved {URL} to {path}", flush=True)
    return None


@dataclass
class ShakespeareCharConfig(DataConfig):
    """Windows of ``block_size + 1`` characters. ``shape`` ([block_size]), ``num_classes`` and ``vocab_size``
    (the vocabulary's size) are outputs, read from the text when the config is checked: leave them unset (a
    value given must match)."""

    PATHS = ("root", "file")

    root: str | None = None  # folder of input.txt (tinyshakespeare, fetched if absent); None: cache_folder()
    file: str | None = None  # a UTF-8 text of your own instead of tinyshakespeare (then leave root unset)
    block_size: int = 64  # characters per window: inputs and targets are [block_size]
    vocab_size: int = from_files("vocab_size")
    shape: list[int] = from_files("shape")
    num_classes: int = from_files("num_classes")
    workers: int | None = 0  # background loader processes per rank (0: windows are cheap to cut)

    @classmethod
    def files_outputs(cls, settings: Any) -> dict[str, Any]:
        block_size = settings.block_size if isinstance(settings.block_size, int) else 64
        try:
            vocab = len(describe(text_path(settings)).vocabulary)
        except (OSError, ValueError, TypeError):  # absent (not yet downloaded), unreadable, not UTF-8
            vocab = VOCAB
        return {"shape": [block_size], "num_classes": vocab, "vocab_size": vocab}

    def __post_init__(self) -> None:
        require_block_size(self.block_size)
        self.require_workers(self.workers)
        path = self._checked_path()
        if path is None:
            return
        key, value = ("file", self.file) if self.file is not None else ("root", self.root)
        try:
            text = describe(path)
        except (OSError, ValueError) as err:  # UnicodeDecodeError is a ValueError
            require(False, key, value, f"{path} is not UTF-8 text ({' '.join(str(err).split())})")
            return
        train = cut(text.length)
        for split, length, part in (
            ("training", train, "first 90%"),
            ("validation", text.length - train, "last 10%"),
        ):
            require(
                length >= self.block_size + 1,
                "block_size",
                self.block_size,
                f"the {split} split of {path} (its {part}) has {length} characters, fewer than the "
                f"block_size + 1 = {self.block_size + 1} of one window: use a smaller data.block_size",
            )
        require(
            not text.unknown,
            key,
            value,
            f"the validation split of {path} (its last 10%) holds characters its training split lacks "
            f"({''.join(text.unknown[:20])!r}), outside the vocabulary: give a text whose last 10% uses "
            "only characters of its first 90%",
        )
        check_outputs(self, len(text.vocabulary), str(path))

    def _checked_path(self) -> Path | None:
        """The text file, fetched if it is tinyshakespeare's and absent, and checked; None where it fails
        (told through ``require``)."""
        if self.file is not None:
            require(self.root is None, "root", self.root, "data.file gives the text: leave data.root unset")
            found = Path(self.file).is_file()
            require(found, "file", self.file, "no such file: give a UTF-8 text, or null for tinyshakespeare")
            return Path(self.file) if found else None
        path = text_path(self)
        if not path.is_file() and READING_RUN_FOLDER.get():  # a run folder's config: fetch, write nothing
            problem = f"{path} is absent: download {URL} to {path}, or give data.root a folder holding it"
        else:
            problem = None if path.is_file() else download(path)
        problem = problem or corpus_problem(path)
        require(problem is None, "root", self.root, problem or "")
        return None if problem else path

    def vocabulary(self) -> list[str]:
        """The characters, indexed by token id."""
        return list(describe(text_path(self)).vocabulary)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; a ValueError names a character outside the vocabulary."""
        index = {c: i for i, c in enumerate(self.vocabulary())}
        unknown = sorted(set(text) - set(index))
        if unknown:
            raise ValueError(f"characters outside the vocabulary of {text_path(self)}: {''.join(unknown)!r}")
        return [index[c] for c in text]

    def decode(self, ids: Iterable[int]) -> str:
        """The text of token ids (a tensor or list of ints)."""
        vocabulary = self.vocabulary()
        return "".join(vocabulary[int(i)] for i in ids)

    def build(self) -> ClassificationData:
        import numpy as np
        import torch

        from runner.data.base import ClassificationData
        from runner.data.token_windows import TokenWindows

        path, key = text_path(self), "root" if self.file is None else "file"
        text, vocabulary = read_text(path), self.vocabulary()
        codes = np.frombuffer(text.encode("utf-32-le"), dtype="<u4")
        known = np.array([ord(c) for c in vocabulary], dtype="<u4")  # sorted, as the characters are
        ids = np.searchsorted(known, codes).clip(max=len(known) - 1)
        if not np.array_equal(known[ids], codes):  # the file changed since the config was checked
            raise ValueError(f"data.{key}: {path} changed while in use: characters outside its vocabulary")
        tokens = torch.from_numpy(ids.astype(np.int32))
        train = cut(len(tokens))
        return ClassificationData(
            TokenWindows(tokens[:train], self.block_size),
            TokenWindows(tokens[train:], self.block_size),
            shape=[self.block_size],
            num_classes=len(vocabulary),
            workers=self.workers,
            classes=vocabulary,
        )


def text_path(settings: Any) -> Path:
    """``settings.file``, else ``<settings.root or cache_folder()>/input.txt`` (a schema or its node)."""
    if settings.file is not None:
        return Path(settings.file)
    return Path(settings.root if settings.root is not None else cache_folder()) / NAME
