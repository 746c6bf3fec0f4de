"""Labelled text for classification: one ``label<TAB>text`` per line, a vocabulary from the training split.

Tokens are lower-cased words (``\\w+``); the vocabulary keeps the ``vocab_size - 2`` most frequent training
tokens (id 0 is padding, 1 is unknown). Every text becomes ``shape[0]`` token ids, truncated or padded with
0, so batches are padded tensors. Labels are the sorted distinct labels of the training file.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import MISSING

from runner.schema import DataConfig, require

if TYPE_CHECKING:
    from runner.data.base import ClassificationData, TensorData

TOKEN = re.compile(r"\w+")
PAD, UNK = 0, 1


@dataclass
class TextConfig(DataConfig):
    """``shape`` is [tokens per text] and ``num_classes`` the number of distinct labels of the training
    file (checked when the data set is built); ``vocab_size`` counts padding and unknown too."""

    PATHS = ("train_file", "val_file")

    train_file: str = MISSING
    val_file: str | None = None  # None: hold out val_fraction of the training file
    val_fraction: float = 0.1
    split_seed: int = 0
    shape: list[int] = field(default_factory=lambda: [64])
    num_classes: int = 2
    vocab_size: int = 20000

    def __post_init__(self) -> None:
        for key in ("train_file", "val_file"):
            path = getattr(self, key)
            require(
                path is None or Path(path).is_file(),
                key,
                path,
                "no such file; give a text file with one `label<TAB>text` per line",
            )
        require(
            len(self.shape) == 1 and self.shape[0] >= 1, "shape", self.shape, "[sequence length], e.g. [64]"
        )
        require(self.num_classes >= 2, "num_classes", self.num_classes, "the number of distinct labels, >= 2")
        require(
            self.vocab_size >= 3, "vocab_size", self.vocab_size, "must be >= 3 (padding, unknown, a word)"
        )
        require(0 < self.val_fraction < 1, "val_fraction", self.val_fraction, "must be in (0, 1)")

    def build(self) -> ClassificationData:
        import torch

        from runner.data.base import ClassificationData

        train = read_corpus(Path(self.train_file))
        if self.val_file is None:
            g = torch.Generator().manual_seed(self.split_seed)
            order = torch.randperm(len(train), generator=g).tolist()
            cut = max(1, round(len(train) * self.val_fraction))
            val, train = [train[i] for i in order[:cut]], [train[i] for i in order[cut:]]
        else:
            val = read_corpus(Path(self.val_file))
        labels = sorted({label for label, _ in train})
        if len(labels) != self.num_classes:
            raise ValueError(
                f"data.num_classes={self.num_classes} but {self.train_file} has {len(labels)} labels "
                f"({', '.join(labels[:10])}); set data.num_classes={len(labels)}"
            )
        unknown = sorted({label for label, _ in val} - set(labels))
        if unknown:
            raise ValueError(f"validation labels not in the training file: {', '.join(unknown[:10])}")
        vocab = vocabulary([text for _, text in train], self.vocab_size)
        length = self.shape[0]
        return ClassificationData(
            encode(train, vocab, labels, length),
            encode(val, vocab, labels, length),
            self.shape,
            self.num_classes,
            classes=labels,
        )


def read_corpus(path: Path) -> list[tuple[str, str]]:
    """(label, text) pairs; a clear error naming the file and line for a line without a tab."""
    pairs = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        label, tab, text = line.partition("\t")
        if not tab or not label:
            raise ValueError(f"{path}:{number}: expected `label<TAB>text`, got {line[:60]!r}")
        pairs.append((label, text))
    if not pairs:
        raise ValueError(f"{path}: no `label<TAB>text` lines")
    return pairs


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text.lower())


def vocabulary(texts: list[str], size: int) -> dict[str, int]:
    """Token → id for the ``size - 2`` most frequent tokens of ``texts``, ids 2.. by falling frequency."""
    counts = Counter(tok for text in texts for tok in tokens(text))
    return {tok: i + 2 for i, (tok, _) in enumerate(counts.most_common(size - 2))}


def encode(pairs: list[tuple[str, str]], vocab: dict[str, int], labels: list[str], length: int) -> TensorData:
    """Token ids (N × length, right-padded with 0) and label indices of (label, text) pairs."""
    import torch

    from runner.data.base import TensorData

    x = torch.full((len(pairs), length), PAD, dtype=torch.long)
    for row, (_, text) in enumerate(pairs):
        ids = [vocab.get(tok, UNK) for tok in tokens(text)][:length]
        x[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
    index = {label: i for i, label in enumerate(labels)}
    y = torch.tensor([index[label] for label, _ in pairs], dtype=torch.long)
    return TensorData(x, y)
