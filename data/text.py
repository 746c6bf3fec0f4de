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

import torch
from omegaconf import MISSING

from data.base import ClassificationData, TensorData
from runner.checks import require

TOKEN = re.compile(r"\w+")
PAD, UNK = 0, 1


@dataclass
class TextConfig:
    _target_: str = "data.text.Text"
    train_file: str = MISSING
    val_file: str | None = None
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


SCHEMA = TextConfig


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


class Text(ClassificationData):
    def __init__(
        self,
        train_file: str,
        val_file: str | None = None,
        val_fraction: float = 0.1,
        split_seed: int = 0,
        shape: list[int] = (64,),
        num_classes: int = 2,
        vocab_size: int = 20000,
    ):
        train = read_corpus(Path(train_file))
        if val_file is None:
            order = torch.randperm(len(train), generator=torch.Generator().manual_seed(split_seed)).tolist()
            cut = max(1, round(len(train) * val_fraction))
            val, train = [train[i] for i in order[:cut]], [train[i] for i in order[cut:]]
        else:
            val = read_corpus(Path(val_file))
        labels = sorted({label for label, _ in train})
        if len(labels) != num_classes:
            raise ValueError(
                f"data.num_classes={num_classes} but {train_file} has {len(labels)} labels "
                f"({', '.join(labels[:10])}); set data.num_classes={len(labels)}"
            )
        unknown = sorted({label for label, _ in val} - set(labels))
        if unknown:
            raise ValueError(f"validation labels not in the training file: {', '.join(unknown[:10])}")
        counts = Counter(tok for _, text in train for tok in TOKEN.findall(text.lower()))
        self.vocab = {tok: i + 2 for i, (tok, _) in enumerate(counts.most_common(vocab_size - 2))}
        self.labels = {label: i for i, label in enumerate(labels)}
        self.length = shape[0]
        self.train, self.val = self.encode(train), self.encode(val)
        self.shape, self.num_classes, self.vocab_size = (self.length,), num_classes, vocab_size

    def encode(self, pairs: list[tuple[str, str]]) -> TensorData:
        x = torch.full((len(pairs), self.length), PAD, dtype=torch.long)
        for row, (_, text) in enumerate(pairs):
            ids = [self.vocab.get(tok, UNK) for tok in TOKEN.findall(text.lower())][: self.length]
            x[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        y = torch.tensor([self.labels[label] for label, _ in pairs], dtype=torch.long)
        return TensorData(x, y)
