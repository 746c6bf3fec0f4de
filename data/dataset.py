"""Any torch ``Dataset``, given by its class: ``data=dataset data.train._target_=my_project.data.Reviews``.

``train`` (and optionally ``val``) name a ``torch.utils.data.Dataset`` class, or any callable that returns a
data set or a ``(train, val)`` pair, with its keyword arguments as the node's other keys
(``+data.train.root=/data/reviews``); each rank calls it (:class:`runner.schema.target.Target`). Without a
validation set, ``val_fraction`` of the training set is held out, drawn with ``split_seed``: the same samples
on every rank and in every run. The rank then treats the data sets like the runner's own
(:class:`runner.data.base.ClassificationData`): sharded by ``ShardSampler``, loaded by ``workers`` background
processes.

A sample is an ``(input, target)`` pair of tensors, numbers or numpy arrays, which torch's default collate
batches; targets pass through as they are (class indices for classification, floats for regression: the
task checks them). The launcher checks that each ``_target_``'s module exists without importing it; the rank
checks the first sample of each split. ``shape`` and ``num_classes`` are optional here: models that read them
(``input_shape: ${data.shape}``) need them given.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from omegaconf import MISSING

from runner.schema import DataConfig, require
from runner.schema.target import TARGET, Target

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from runner.data.base import ClassificationData


def check_target(key: str, node: Mapping[str, Any]) -> None:
    """``node[_target_]`` is a dotted path to a class or function whose module can be found from here (without
    importing it): :meth:`runner.schema.target.Target.of`'s check, for ``key`` of ``data``."""
    Target.of(key, node, "data")


def describe(obj: Any) -> str:
    """What ``obj`` is, for an error message."""
    if hasattr(obj, "shape") and hasattr(obj, "dtype"):
        return f"a {type(obj).__name__} of shape {list(obj.shape)} ({obj.dtype})"
    if isinstance(obj, Mapping):
        return f"a {type(obj).__name__} with keys {list(obj)[:6]}"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of {len(obj)}: " + ", ".join(describe(x) for x in obj[:4])
    return f"a {type(obj).__module__}.{type(obj).__qualname__}"


def is_dataset(obj: Any) -> bool:
    """A map-style data set: indexable, with a length (a torch Dataset, a list of samples...)."""
    kind = type(obj)
    return hasattr(kind, "__getitem__") and hasattr(kind, "__len__") and not isinstance(obj, (Mapping, str))


def is_pair(obj: Any) -> bool:
    """A ``(train, val)`` pair of data sets (a tuple of two samples is a data set of two samples)."""
    return isinstance(obj, tuple) and len(obj) == 2 and all(is_dataset(d) and not is_pair(d) for d in obj)


def collatable(value: Any) -> bool:
    import numpy as np
    import torch

    return isinstance(value, (torch.Tensor, np.ndarray, np.generic, numbers.Number))


def first_sample(where: str, dataset: Dataset) -> tuple[Any, Any]:
    """``dataset[0]``, checked to be an (input, target) pair the default collate batches; ``where``
    names the key that made the data set, for messages."""
    if len(dataset) == 0:
        raise ValueError(f"{where}: the data set is empty")
    sample = dataset[0]
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2 and all(map(collatable, sample))):
        raise ValueError(
            f"{where}: a sample must be an (input, target) pair of tensors, numbers or numpy arrays, but "
            f"sample 0 is {describe(sample)}; return `x, y` from __getitem__"
        )
    return sample[0], sample[1]


def shape_of(value: Any) -> Any:
    """A tensor's or array's shape; ``()`` for a number."""
    return getattr(value, "shape", ())


def check_batch(where: str, indices: list[int], samples: list[Any]) -> None:
    """Refuse a batch whose inputs (or targets) differ in shape, naming two samples by their index.

    torch's collate names neither them nor the data set (``stack expects each tensor to be equal size``; in
    a loader process ``Trying to resize storage that is not resizable``). ``where`` names the key that made
    the data set; a ``__getitems__`` of the user's that returns no list of samples is left to collate."""
    if not isinstance(samples, list) or len(samples) != len(indices) or not samples:
        return
    first = samples[0]
    for i, sample in zip(indices, samples, strict=True):
        if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
            raise ValueError(
                f"{where}: a sample must be an (input, target) pair, but sample {i} is {describe(sample)}; "
                "return `x, y` from __getitem__ for every index"
            )
        for part, name in ((0, "inputs"), (1, "targets")):
            if shape_of(sample[part]) != shape_of(first[part]):
                raise ValueError(
                    f"{where}: sample {i} has {name} of shape {list(shape_of(sample[part]))} but sample "
                    f"{indices[0]} has {list(shape_of(first[part]))}, and a batch stacks samples of one "
                    f"shape: make __getitem__ return {name} of one shape (pad, crop or resize them)"
                )


def stacked(dataset: Dataset, where: str) -> Dataset:
    """All of ``dataset``, each batch's samples checked by :func:`check_batch` before collate stacks them.

    The check runs where the batch is read, in a loader process too."""
    return _stacked_class()(dataset, where)


@functools.cache
def _stacked_class() -> type[Dataset]:
    from torch.utils.data import Subset

    class Stacked(Subset):
        """A ``Subset`` of all of ``dataset``, so that :func:`runner.data.base.root_dataset` finds the data
        set under it."""

        def __init__(self, dataset: Dataset, where: str):
            super().__init__(dataset, range(len(dataset)))
            self.where = where

        def __getitems__(self, indices: list[int]) -> list[Any]:
            samples = super().__getitems__(indices)
            check_batch(self.where, indices, samples)
            return samples

    Stacked.__qualname__ = "Stacked"  # pickled by name into loader processes (:func:`__getattr__`)
    return Stacked


def __getattr__(name: str) -> Any:
    if name == "Stacked":
        return _stacked_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def declared_classes(dataset: Dataset) -> tuple[int | None, list[str] | None]:
    """The class count (and names) a data set declares by a ``classes`` or ``num_classes`` attribute."""
    from runner.data.base import root_dataset

    dataset = root_dataset(dataset)
    classes = getattr(dataset, "classes", None)
    if classes is not None and hasattr(classes, "__len__"):
        names = [str(c) for c in classes] if all(isinstance(c, str) for c in classes) else None
        return len(classes), names
    count = getattr(dataset, "num_classes", None)
    return (count, None) if isinstance(count, int) else (None, None)


@dataclass
class DatasetConfig(DataConfig):
    """A user's data sets, given by their classes: ``train`` and optionally ``val`` are ``{_target_: ...,
    **arguments}``. ``shape`` and ``num_classes`` are inputs here, None unless given: a model that reads them
    (``model=cnn``, ``model=mlp``) needs ``data.shape`` (one input's shape) and ``data.num_classes``; the rank
    checks them against the first sample and the data set's own ``classes``/``num_classes``."""

    train: dict[str, Any] = field(default_factory=lambda: {TARGET: MISSING})
    val: dict[str, Any] = field(default_factory=lambda: {TARGET: None})  # _target_ null: hold out of train
    val_fraction: float = 0.1  # held out of train when there is no validation set
    split_seed: int = 0
    shape: list[int] | None = None
    num_classes: int | None = None
    workers: int | None = None  # loader processes per rank; None: by its cores (0 for tensors in memory)

    def __post_init__(self) -> None:
        check_target("train", self.train)
        if self.val.get(TARGET) is not None or len(self.val) > 1:
            check_target("val", self.val)
        require(0 < self.val_fraction < 1, "val_fraction", self.val_fraction, "must be in (0, 1), e.g. 0.1")
        require(
            self.shape is None or (len(self.shape) >= 1 and all(s >= 1 for s in self.shape)),
            "shape",
            self.shape,
            "one input's shape, a list of positive sizes (e.g. [3, 32, 32]), or null",
        )
        classes = self.num_classes
        require(classes is None or classes >= 1, "num_classes", classes, "the class count, >= 1, or null")
        self.require_workers(self.workers)

    def name(self) -> str:
        return str(self.train[TARGET])

    def named(self, key: str) -> str:
        """``data.<key>._target_=<path>``, for messages."""
        return f"data.{key}.{TARGET}={getattr(self, key)[TARGET]}"

    def call(self, key: str) -> Any:
        """What ``data.<key>._target_`` returns, called with the node's other keys.

        Nested ``_target_`` nodes are built first; what the class raises is named with its key
        (:meth:`runner.schema.target.Target.build_named`). That error is raised alone, with the user's
        frames as its traceback: a failed rank names the innermost error of a chain
        (``runner.rank.records.output.root_cause``), which would drop the key."""
        try:
            return Target.of(f"data.{key}", getattr(self, key)).build_named()
        except ValueError as err:
            if err.__cause__ is None:
                raise
            raise ValueError(str(err)).with_traceback(err.__cause__.__traceback__) from None

    def datasets(self) -> tuple[Dataset, Dataset, str]:
        """The training and validation sets, and the key that made the training set (for messages)."""
        import torch
        from torch.utils.data import Subset

        train = self.call("train")
        has_val = self.val.get(TARGET) is not None
        if is_pair(train):
            if has_val:
                raise ValueError(
                    f"{self.named('val')}: {self.named('train')} returns a (train, val) pair already; "
                    "drop data.val"
                )
            where = self.named("train")
            return stacked(train[0], where), stacked(train[1], where), "train"
        if not is_dataset(train):
            raise ValueError(
                f"{self.named('train')} returned {describe(train)}: give a map-style Dataset (with "
                "__len__ and __getitem__), or a function returning one or a (train, val) pair"
            )
        if len(train) == 0:
            raise ValueError(f"{self.named('train')} returned an empty data set (0 samples): check its files")
        if has_val:
            val = self.call("val")
            if not is_dataset(val) or is_pair(val):
                raise ValueError(f"{self.named('val')} returned {describe(val)}: give a map-style Dataset")
            if len(val) == 0:
                raise ValueError(
                    f"{self.named('val')} returned an empty data set (0 samples): check its files"
                )
            return stacked(train, self.named("train")), stacked(val, self.named("val")), "val"
        order = torch.randperm(len(train), generator=torch.Generator().manual_seed(self.split_seed)).tolist()
        cut = round(len(train) * self.val_fraction)
        if not 0 < cut < len(train):
            raise ValueError(
                f"data.val_fraction={self.val_fraction} holds out {cut} of the {len(train)} training "
                "samples: give a fraction that leaves samples in both splits, or a validation set "
                "(data.val._target_)"
            )
        train = stacked(train, self.named("train"))
        return Subset(train, sorted(order[cut:])), Subset(train, sorted(order[:cut])), "train"

    def build(self) -> ClassificationData:
        import torch

        from runner.data.base import ClassificationData

        train, val, val_key = self.datasets()
        x, _ = first_sample(self.named("train"), train)
        first_sample(self.named(val_key), val)
        shape = list(torch.as_tensor(x).shape)
        if self.shape is not None and list(self.shape) != shape:
            raise ValueError(
                f"data.shape={list(self.shape)} but {self.named('train')} yields inputs of shape {shape}: "
                f"set data.shape=[{','.join(map(str, shape))}], or leave it unset"
            )
        count, names = declared_classes(train)
        if self.num_classes is not None and count is not None and count != self.num_classes:
            raise ValueError(
                f"data.num_classes={self.num_classes} but {self.named('train')} has {count} classes: set "
                f"data.num_classes={count}, or leave it unset"
            )
        num_classes = self.num_classes if self.num_classes is not None else count
        workers = 0 if self.workers is None and in_memory(train) else self.workers
        return ClassificationData(train, val, shape, num_classes, workers, names)


def in_memory(dataset: Dataset) -> bool:
    """A data set of tensors already in memory (``TensorDataset``, the runner's ``TensorData``, or a subset
    of one): indexing it is cheaper than starting loader processes (``workers=None`` picks 0 for it)."""
    from torch.utils.data import TensorDataset

    from runner.data.base import TensorData, root_dataset

    return isinstance(root_dataset(dataset), (TensorDataset, TensorData))
