"""Pre-processed images as uint8 ``.npy`` arrays read through memory maps: the fast path for big runs.

A shard folder (written by ``python -m runner.data.convert SRC DST``) holds ``train_x.npy`` / ``val_x.npy``
(N×H×W×C uint8), ``train_y.npy`` / ``val_y.npy`` (N int64 labels) and ``meta.json`` (classes, per-channel
mean and std of the training images). Batches are gathered from the memory maps (the pages a batch touches
are all that is read), randomly cropped to ``crop`` and flipped for training, centre-cropped for validation,
and standardised.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import MISSING
from omegaconf.errors import MissingMandatoryValue

from runner.data import from_files
from runner.data.base import BatchedData, ClassificationData, center_crop, normalize, random_crop_flip
from runner.schema import DataConfig, require

FILES = ["train_x.npy", "train_y.npy", "val_x.npy", "val_y.npy", "meta.json"]


class _Shard(BatchedData):
    """One split; the memory maps are opened lazily, so the data set pickles cheaply to loader processes."""

    def __init__(self, root: Path, split: str, crop: int | None, train: bool, mean, std):
        self.x_path, self.y_path = root / f"{split}_x.npy", root / f"{split}_y.npy"
        self.crop, self.train, self.mean, self.std = crop, train, mean, std
        self.y = torch.from_numpy(np.load(self.y_path).astype(np.int64))
        self._x = None
        if len(self.y) != len(self.images):
            raise ValueError(
                f"data.root: {self.x_path} has {len(self.images)} images, {self.y_path} {len(self.y)}"
            )

    @property
    def images(self) -> np.ndarray:
        if self._x is None:
            try:
                self._x = np.load(self.x_path, mmap_mode="r")
            except ValueError as err:
                raise ValueError(f"data.root: {self.x_path} is not a .npy array: {err}") from None
            if self._x.dtype != np.uint8 or self._x.ndim != 4:
                raise ValueError(
                    f"data.root: {self.x_path} must be N×H×W×C uint8, is {self._x.shape} {self._x.dtype}"
                )
        return self._x

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_x": None}

    def __len__(self) -> int:
        return len(self.y)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        order = np.argsort(indices)
        batch = np.empty((len(indices), *self.images.shape[1:]), dtype=np.uint8)
        batch[order] = self.images[np.asarray(indices)[order]]
        x = torch.from_numpy(batch).permute(0, 3, 1, 2)
        if self.crop and self.train:
            x = random_crop_flip(x, self.crop)
        elif self.crop:
            x = center_crop(x, self.crop)
        elif self.train:
            flip = torch.rand(len(x)) < 0.5
            x = x.clone()
            x[flip] = x[flip].flip(-1)
        return normalize(x, self.mean, self.std), self.y[torch.as_tensor(indices)]


def read_meta(root: str) -> dict[str, Any]:
    """The shard folder's ``meta.json``; a ValueError naming ``root`` if the folder is not one."""
    folder = Path(root)
    missing = [name for name in FILES if not (folder / name).is_file()]
    require(
        not missing,
        "root",
        root,
        f"missing {', '.join(missing)}: write shards with `python -m runner.data.convert SRC {root}`",
    )
    try:
        meta = json.loads((folder / "meta.json").read_text())
        height, width, channels = meta["image_shape"]
        meta["classes"] = list(meta["classes"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(
            f"root={root!r} is invalid: {folder / 'meta.json'} is not the meta.json "
            f"`python -m runner.data.convert` writes ({type(err).__name__}: {err})"
        ) from None
    for split in ("train", "val"):  # the arrays' headers (memory maps: nothing is read)
        path = folder / f"{split}_x.npy"
        try:
            shape = np.load(path, mmap_mode="r").shape
        except (OSError, ValueError) as err:
            raise ValueError(f"root={root!r} is invalid: {path} is not a .npy array ({err})") from None
        require(
            list(shape[1:]) == [height, width, channels],
            "root",
            root,
            f"{path} holds images of {'×'.join(map(str, shape[1:]))}, but {folder / 'meta.json'} says "
            f"{height}×{width}×{channels}: write the shards again with `python -m runner.data.convert`",
        )
    return meta


@dataclass
class ShardsConfig(DataConfig):
    """A shard folder. ``shape`` ([C, crop or H, crop or W]) and ``num_classes`` are what the shards hold,
    read from ``meta.json`` when the config is checked: leave them unset (a value given must match)."""

    PATHS = ("root",)

    root: str = MISSING  # a folder written by `python -m runner.data.convert SRC DST`
    crop: int | None = None  # random (training) or centre (validation) crop to this side; None: stored size
    shape: list[int] = from_files("shape")
    num_classes: int = from_files("num_classes")
    augment: bool = True  # random horizontal flip (and crop) of training images
    workers: int | None = None  # background loader processes per rank; None: by the rank's cores

    @classmethod
    def files_outputs(cls, settings: Any) -> dict[str, Any]:
        crop = settings.crop
        try:
            meta = read_meta(settings.root)
        except (ValueError, MissingMandatoryValue):
            side = crop if isinstance(crop, int) else 224
            return {"shape": [3, side, side], "num_classes": 1000}
        height, width, channels = meta["image_shape"]
        return {"shape": [channels, crop or height, crop or width], "num_classes": len(meta["classes"])}

    def __post_init__(self) -> None:
        meta = read_meta(self.root)
        self.fill_outputs()
        height, width, channels = meta["image_shape"]
        require(
            self.crop is None or 1 <= self.crop <= min(height, width),
            "crop",
            self.crop,
            f"the shards hold {height}×{width} images: crop to at most {min(height, width)}, or null",
        )
        size = (self.crop, self.crop) if self.crop else (height, width)
        require(
            list(self.shape) == [channels, *size],
            "shape",
            self.shape,
            f"the shards hold {height}×{width}×{channels} images; with crop={self.crop} use "
            f"data.shape=[{channels},{size[0]},{size[1]}], or leave it unset",
        )
        require(
            self.num_classes == len(meta["classes"]),
            "num_classes",
            self.num_classes,
            f"the shards have {len(meta['classes'])} classes: use data.num_classes={len(meta['classes'])}, "
            "or leave it unset",
        )
        self.require_workers(self.workers)

    def build(self) -> ClassificationData:
        root = Path(self.root)
        meta = read_meta(self.root)
        mean, std = meta["mean"], meta["std"]
        return ClassificationData(
            _Shard(root, "train", self.crop, self.augment, mean, std),
            _Shard(root, "val", self.crop, False, mean, std),
            self.shape,
            self.num_classes,
            self.workers,
            meta["classes"],
        )
