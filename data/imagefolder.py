"""An ImageNet-style folder of images: ``root/{train,val}/<class>/*.jpg|jpeg|png``, decoded with Pillow.

Training images: shorter side resized to ``resize``, a random ``image_size`` crop, a random horizontal flip;
validation images: the same resize and a centre crop. Both are standardised with ``mean`` and ``std``.
Classes are the sorted sub-folder names of ``train/``; ``val/`` must use the same names.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import MISSING
from omegaconf.errors import MissingMandatoryValue
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from runner.data import from_files
from runner.data.base import ClassificationData, center_crop
from runner.schema import DataConfig, require

EXTENSIONS = {".jpg", ".jpeg", ".png"}
IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]


def list_images(folder: Path, classes: list[str] | None = None) -> tuple[list[tuple[Path, int]], list[str]]:
    """(path, class index) of every image under ``folder/<class>/``, and the class names."""
    if classes is None:
        classes = sorted(d.name for d in folder.iterdir() if d.is_dir())
        if not classes:
            raise ValueError(f"data.root: {folder} has no class folders (expected {folder}/<class>/*.jpg)")
    else:
        extra = sorted({d.name for d in folder.iterdir() if d.is_dir()} - set(classes))
        if extra:
            raise ValueError(f"data.root: {folder} has classes not in train/: {', '.join(extra[:10])}")
    samples = [
        (p, i)
        for i, c in enumerate(classes)
        if (folder / c).is_dir()
        for p in sorted((folder / c).iterdir())
        if p.suffix.lower() in EXTENSIONS
    ]
    if not samples:
        raise ValueError(f"data.root: no .jpg/.jpeg/.png images under {folder}/<class>/")
    return samples, classes


def load_image(path: Path, short_side: int) -> Image.Image:
    """An RGB image with its shorter side resized to ``short_side``; names the file if it is not an image."""
    try:
        with Image.open(path) as img:
            img = img.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"data.root: cannot read image {path}: {err}") from None
    w, h = img.size
    scale = short_side / min(w, h)
    return img.resize((max(short_side, round(w * scale)), max(short_side, round(h * scale))), Image.BILINEAR)


class _Folder(Dataset):
    def __init__(self, samples, image_size, resize, mean, std, train):
        self.samples, self.size, self.resize, self.train = samples, image_size, resize, train
        self.mean, self.std = torch.tensor(mean).view(3, 1, 1), torch.tensor(std).view(3, 1, 1)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[i]
        x = torch.from_numpy(np.array(load_image(path, self.resize), dtype=np.uint8)).permute(2, 0, 1)
        if self.train:
            h, w = x.shape[-2:]
            top = int(torch.randint(0, h - self.size + 1, ()))
            left = int(torch.randint(0, w - self.size + 1, ()))
            x = x[:, top : top + self.size, left : left + self.size]
            if torch.rand(()) < 0.5:
                x = x.flip(-1)
        else:
            x = center_crop(x, self.size)
        return (x.float().div_(255) - self.mean) / self.std, label


def class_folders(root: str) -> list[str]:
    """The sorted class folder names of ``root/train`` (listed without reading any image); a ValueError
    naming ``root`` if there is no ``train/`` and ``val/`` or no class folder."""
    folder = Path(root)
    for split in ("train", "val"):
        require(
            (folder / split).is_dir(),
            "root",
            root,
            f"no folder {folder / split}: expected root/train/<class>/*.jpg and root/val/<class>/*.jpg",
        )
    with os.scandir(folder / "train") as entries:
        classes = sorted(e.name for e in entries if e.is_dir())
    require(
        bool(classes), "root", root, f"{folder / 'train'} has no class folders (expected train/<class>/*.jpg)"
    )
    return classes


@dataclass
class ImageFolderConfig(DataConfig):
    """Images under ``root/{train,val}/<class>/``. ``shape`` is [3, image_size, image_size] and
    ``num_classes`` the number of class folders of ``train/``, listed when the config is checked: leave them
    unset (a value given must match)."""

    PATHS = ("root",)

    root: str = MISSING  # holds train/<class>/*.jpg and val/<class>/*.jpg
    image_size: int = 224  # side of the square crops
    resize: int | None = None  # shorter side before cropping; None: image_size × 256/224
    shape: list[int] = from_files("shape")
    num_classes: int = from_files("num_classes")
    mean: list[float] = field(default_factory=lambda: list(IMAGENET_MEAN))
    std: list[float] = field(default_factory=lambda: list(IMAGENET_STD))
    workers: int | None = None  # background loader processes per rank (JPEG decoding); None: by its cores

    @classmethod
    def files_outputs(cls, settings: Any) -> dict[str, Any]:
        size = settings.image_size
        try:
            classes = len(class_folders(settings.root))
        except (ValueError, OSError, MissingMandatoryValue):
            classes = 1000
        return {"shape": [3, size, size], "num_classes": classes}

    def __post_init__(self) -> None:
        classes = class_folders(self.root)
        self.fill_outputs()
        require(self.image_size >= 1, "image_size", self.image_size, "the crop side, >= 1 (e.g. 224)")
        require(
            list(self.shape) == [3, self.image_size, self.image_size],
            "shape",
            self.shape,
            f"it is [3, image_size, image_size] = [3, {self.image_size}, {self.image_size}]; "
            "leave it unset and set data.image_size",
        )
        require(
            self.num_classes == len(classes),
            "num_classes",
            self.num_classes,
            f"{Path(self.root) / 'train'} has {len(classes)} class folders: use "
            f"data.num_classes={len(classes)}, or leave it unset",
        )
        require(
            self.resize is None or self.resize >= self.image_size,
            "resize",
            self.resize,
            "the shorter side before cropping must be >= image_size (null: image_size × 256/224)",
        )
        for key in ("mean", "std"):
            values = getattr(self, key)
            require(len(values) == 3, key, values, "one value per RGB channel, e.g. [0.485, 0.456, 0.406]")
        require(min(self.std) > 0, "std", self.std, "standard deviations must be > 0")
        self.require_workers(self.workers)

    def build(self) -> ClassificationData:
        root = Path(self.root)
        train, classes = list_images(root / "train")
        val, _ = list_images(root / "val", classes)
        resize = self.resize or round(self.image_size * 256 / 224)
        return ClassificationData(
            _Folder(train, self.image_size, resize, self.mean, self.std, train=True),
            _Folder(val, self.image_size, resize, self.mean, self.std, train=False),
            self.shape,
            self.num_classes,
            self.workers,
            classes,
        )
