"""Random inputs of any shape with learnable labels, for benchmarks and tests."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from data.base import ClassificationData, TensorData
from runner.checks import require


@dataclass
class SyntheticConfig:
    _target_: str = "data.synthetic.Synthetic"
    shape: list[int] = field(default_factory=lambda: [3, 32, 32])
    num_classes: int = 10
    train_size: int = 2048
    val_size: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        require(
            len(self.shape) >= 1 and all(s >= 1 for s in self.shape),
            "shape",
            self.shape,
            "a list of positive sizes, e.g. [3, 32, 32]",
        )
        require(self.num_classes >= 2, "num_classes", self.num_classes, "need at least 2 classes")
        require(
            self.train_size >= 1 and self.val_size >= 1,
            "train_size",
            self.train_size,
            "train_size and val_size must be >= 1",
        )


SCHEMA = SyntheticConfig


class Synthetic(ClassificationData):
    """Gaussian inputs labelled by a fixed random linear map (argmax), so a model can learn them."""

    def __init__(
        self,
        shape: list[int] = (3, 32, 32),
        num_classes: int = 10,
        train_size: int = 2048,
        val_size: int = 512,
        seed: int = 0,
    ):
        g = torch.Generator().manual_seed(seed)
        shape = tuple(shape)
        x = torch.randn(train_size + val_size, *shape, generator=g)
        w = torch.randn(math.prod(shape), num_classes, generator=g)
        y = (x.reshape(len(x), -1) @ w).argmax(1)
        self.train = TensorData(x[:train_size], y[:train_size])
        self.val = TensorData(x[train_size:], y[train_size:])
        self.shape, self.num_classes = shape, num_classes
