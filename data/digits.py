"""scikit-learn's handwritten digits: 1,797 real 8×8 grey images of 10 classes, bundled with sklearn."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split

from data.base import ClassificationData, TensorData
from runner.checks import require


@dataclass
class DigitsConfig:
    _target_: str = "data.digits.Digits"
    shape: list[int] = field(default_factory=lambda: [1, 8, 8])
    num_classes: int = 10
    val_fraction: float = 0.2
    split_seed: int = 0

    def __post_init__(self) -> None:
        require(list(self.shape) == [1, 8, 8], "shape", self.shape, "the digits are [1, 8, 8] images")
        require(self.num_classes == 10, "num_classes", self.num_classes, "the digits have 10 classes")
        require(0 < self.val_fraction < 1, "val_fraction", self.val_fraction, "must be in (0, 1), e.g. 0.2")


SCHEMA = DigitsConfig


class Digits(ClassificationData):
    """A fixed stratified train/validation split, standardised with the training split's mean and std."""

    def __init__(
        self,
        shape: list[int] = (1, 8, 8),
        num_classes: int = 10,
        val_fraction: float = 0.2,
        split_seed: int = 0,
    ):
        x, y = load_digits(return_X_y=True)
        x_tr, x_va, y_tr, y_va = train_test_split(
            x, y, test_size=val_fraction, random_state=split_seed, stratify=y
        )
        mean, std = x_tr.mean(), x_tr.std()

        def tensors(xs, ys):
            xs = torch.tensor((xs - mean) / std, dtype=torch.float32).reshape(-1, 1, 8, 8)
            return TensorData(xs, torch.tensor(ys, dtype=torch.long))

        self.train, self.val = tensors(x_tr, y_tr), tensors(x_va, y_va)
        self.shape, self.num_classes = (1, 8, 8), 10
