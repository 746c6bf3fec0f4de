"""Random inputs of any shape with learnable labels, for benchmarks and tests."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runner.schema import DataConfig, require

if TYPE_CHECKING:
    from runner.data.base import ClassificationData


@dataclass
class SyntheticConfig(DataConfig):
    """Gaussian inputs of ``shape`` labelled by a fixed random linear map (argmax over ``num_classes``), so
    a model can learn them; ``shape`` and ``num_classes`` are settings here, not properties of files."""

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
        require(self.train_size >= 1, "train_size", self.train_size, "must be >= 1")
        require(self.val_size >= 1, "val_size", self.val_size, "must be >= 1")

    def build(self) -> ClassificationData:
        import torch

        from runner.data.base import ClassificationData, TensorData

        g = torch.Generator().manual_seed(self.seed)
        x = torch.randn(self.train_size + self.val_size, *self.shape, generator=g)
        w = torch.randn(math.prod(self.shape), self.num_classes, generator=g)
        y = (x.reshape(len(x), -1) @ w).argmax(1)
        n = self.train_size
        return ClassificationData(
            TensorData(x[:n], y[:n]), TensorData(x[n:], y[n:]), self.shape, self.num_classes
        )
