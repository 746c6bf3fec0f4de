"""CIFAR-10 from its "python version" batch files (Krizhevsky 2009): ``data_batch_1..5``, ``test_batch``.

The files are read as data (:class:`BatchUnpickler`: numpy arrays, dicts, lists, strings and numbers only),
so a crafted batch file cannot run code when the data set loads. Training batches get the standard
augmentation (random 32×32 crop of the image zero-padded by 4, random horizontal flip); both splits are
standardised with the usual per-channel CIFAR-10 mean and std.
"""

from __future__ import annotations

import codecs
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import MISSING

from runner.data.base import BatchedData, ClassificationData, normalize, random_crop_flip
from runner.schema import DataConfig, require

TRAIN_FILES = [f"data_batch_{i}" for i in range(1, 6)]
TEST_FILE = "test_batch"
MEAN, STD = [0.4914, 0.4822, 0.4465], [0.2470, 0.2435, 0.2616]
SHAPE, CLASSES = [3, 32, 32], 10


def _numpy_globals() -> dict[tuple[str, str], Any]:
    """What a pickled numpy array names (under numpy 1's and numpy 2's module names), and nothing else."""
    try:
        from numpy._core import multiarray, numeric  # numpy 2
    except ImportError:  # numpy 1
        from numpy.core import multiarray, numeric

    found: dict[tuple[str, str], Any] = {("numpy", "ndarray"): np.ndarray, ("numpy", "dtype"): np.dtype}
    for core in ("numpy.core", "numpy._core"):
        found[(f"{core}.multiarray", "_reconstruct")] = multiarray._reconstruct
        found[(f"{core}.multiarray", "scalar")] = multiarray.scalar
        found[(f"{core}.numeric", "_frombuffer")] = numeric._frombuffer  # protocol 5
    return found


#: Plain types a batch file (pickled by Python 2 or 3, protocol 2 or later) may name besides numpy's.
PLAIN = {
    **{(m, t.__name__): t for m in ("builtins", "__builtin__") for t in (bytearray, set, frozenset, complex)},
    ("_codecs", "encode"): codecs.encode,  # bytes pickled by Python 3 with protocol 2
}


class BatchUnpickler(pickle.Unpickler):
    """Unpickles a CIFAR batch file as data: dicts, lists, strings, numbers and numpy arrays. Any other
    global the file names (a function to call: ``os.system``, ``subprocess.run``...) is refused, so a
    crafted file cannot run code when the data set loads."""

    def find_class(self, module: str, name: str) -> Any:
        allowed = {**_numpy_globals(), **PLAIN}
        if (module, name) not in allowed:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR batch file does not hold")
        return allowed[(module, name)]


def load_batch(path: Path) -> Any:
    """The object pickled in the batch file at ``path``, read with :class:`BatchUnpickler`."""
    with open(path, "rb") as f:
        return BatchUnpickler(f, encoding="bytes").load()


def read_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images (N, 3, 32, 32) uint8 and labels (N,) of one batch file; a clear error if it is not one (a file
    naming anything but data is refused, never run)."""
    try:
        batch = load_batch(path)
        if not isinstance(batch, dict):
            raise TypeError(f"it holds a {type(batch).__name__}, not a dict")
        x = np.asarray(batch[b"data"], dtype=np.uint8).reshape(-1, 3, 32, 32)
        y = np.asarray(batch.get(b"labels", batch.get(b"fine_labels")), dtype=np.int64)
    except Exception as err:  # any unpickling or shape problem means the same thing to the user
        raise ValueError(
            f"data.root: {path} is not a CIFAR-10 batch file ({type(err).__name__}: {err})"
        ) from None
    if len(x) != len(y) or (len(y) and (y.min() < 0 or y.max() > 9)):
        raise ValueError(f"data.root: {path} has {len(x)} images but {len(y)} labels in 0..9")
    return x, y


class _Images(BatchedData):
    def __init__(self, x: np.ndarray, y: np.ndarray, augment: bool):
        self.x, self.y, self.augment = torch.from_numpy(x), torch.from_numpy(y), augment

    def __len__(self) -> int:
        return len(self.y)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices)
        x = self.x[idx]
        if self.augment:
            x = random_crop_flip(x, 32, padding=4)
        return normalize(x, MEAN, STD), self.y[idx]


@dataclass
class CIFAR10Config(DataConfig):
    """CIFAR-10's python-version batch files; ``shape`` and ``num_classes`` are fixed."""

    PATHS = ("root",)

    root: str = MISSING  # the folder holding data_batch_1..5 and test_batch
    shape: list[int] = field(default_factory=lambda: list(SHAPE))
    num_classes: int = CLASSES
    augment: bool = True  # random crop (padding 4) and horizontal flip of training images
    workers: int | None = None  # background loader processes per rank; None: by the rank's cores

    def __post_init__(self) -> None:
        root = Path(self.root)
        require(
            root.is_dir(),
            "root",
            self.root,
            "no such folder; give the folder holding data_batch_1..5 and test_batch "
            "(CIFAR-10's python version, cifar-10-batches-py), e.g. data.root=/data/cifar-10-batches-py",
        )
        missing = [name for name in [*TRAIN_FILES, TEST_FILE] if not (root / name).is_file()]
        require(
            not missing,
            "root",
            self.root,
            f"missing {', '.join(missing)}: not a CIFAR-10 python-version folder",
        )
        self.require_outputs(SHAPE, CLASSES)
        self.require_workers(self.workers)

    def build(self) -> ClassificationData:
        root = Path(self.root)
        parts = [read_batch(root / name) for name in TRAIN_FILES]
        x_tr, y_tr = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
        x_va, y_va = read_batch(root / TEST_FILE)
        train, val = _Images(x_tr, y_tr, self.augment), _Images(x_va, y_va, False)
        return ClassificationData(train, val, SHAPE, CLASSES, self.workers)
