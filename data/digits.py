"""scikit-learn's handwritten digits: 1,797 real 8×8 grey images of 10 classes, bundled with sklearn."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any

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

        from runner.data.base import ClassificationData, TensorData

        x_tr, x_va, y_tr, y_va = split(self.val_fraction, self.split_seed)
        mean, std = x_tr.mean(), x_tr.std()

        def tensors(xs, ys) -> TensorData:
            xs = torch.tensor((xs - mean) / std, dtype=torch.float32).reshape(-1, *SHAPE)
            return TensorData(xs, torch.tensor(ys, dtype=torch.long))

        return ClassificationData(tensors(x_tr, y_tr), tensors(x_va, y_va), SHAPE, CLASSES)


def cache_dir() -> Path:
    """Where split data sets are kept: ``$MPITRAIN_CACHE``, else ``~/.cache/mpitrain``."""
    return Path(os.environ.get("MPITRAIN_CACHE") or Path.home() / ".cache" / "mpitrain")


def split(val_fraction: float, seed: int) -> tuple[Any, Any, Any, Any]:
    """scikit-learn's stratified split of the digits, ``(x_train, x_val, y_train, y_val)`` as numpy arrays.

    Importing scikit-learn costs every rank of every job over a second, so the split is kept in the cache
    folder under a name made of scikit-learn's version and the arguments (written atomically: ranks that
    split at once each write a whole file, one wins); a missing, unreadable or unwritable cache only means
    splitting again."""
    import numpy as np

    name = f"digits-{version('scikit-learn')}-{val_fraction!r}-{seed}.npz"
    path = cache_dir() / name
    try:
        with np.load(path) as kept:
            return kept["x_tr"], kept["x_va"], kept["y_tr"], kept["y_va"]
    except (OSError, ValueError, KeyError):
        pass
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x_tr, x_va, y_tr, y_va = train_test_split(x, y, test_size=val_fraction, random_state=seed, stratify=y)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, suffix=".npz", delete=False) as tmp:
            np.savez(tmp, x_tr=x_tr, x_va=x_va, y_tr=y_tr, y_va=y_va)
        os.replace(tmp.name, path)
    except OSError:
        if tmp is not None:
            Path(tmp.name).unlink(missing_ok=True)
    return x_tr, x_va, y_tr, y_va
