"""scikit-learn's handwritten digits: 1,797 real 8×8 grey images of 10 classes, bundled with sklearn."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from runner.schema import DataConfig, require

if TYPE_CHECKING:
    from runner.data.base import ClassificationData

SHAPE, CLASSES = [1, 8, 8], 10


@dataclass
class DigitsConfig(DataConfig):
    """A fixed stratified train/validation split, standardised with the training split's mean and std."""

    shape: list[int] = field(default_factory=lambda: list(SHAPE))
    num_classes: int = CLASSES
    val_fraction: float = 0.2
    split_seed: int = 0

    def __post_init__(self) -> None:
        self.require_outputs(SHAPE, CLASSES)
        require(0 < self.val_fraction < 1, "val_fraction", self.val_fraction, "must be in (0, 1), e.g. 0.2")

    def build(self) -> ClassificationData:
        import torch
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        from runner.data.base import ClassificationData, TensorData

        x, y = load_digits(return_X_y=True)
        x_tr, x_va, y_tr, y_va = train_test_split(
            x, y, test_size=self.val_fraction, random_state=self.split_seed, stratify=y
        )
        mean, std = x_tr.mean(), x_tr.std()

        def tensors(xs, ys) -> TensorData:
            xs = torch.tensor((xs - mean) / std, dtype=torch.float32).reshape(-1, *SHAPE)
            return TensorData(xs, torch.tensor(ys, dtype=torch.long))

        return ClassificationData(tensors(x_tr, y_tr), tensors(x_va, y_va), SHAPE, CLASSES)
