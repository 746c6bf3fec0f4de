"""Two small synthetic data sets, generated in memory from a seed (no download, no files).

``Blobs``: points in ``features`` dimensions around ``classes`` Gaussian centres; the target is the centre's
index (classification). ``Wave``: a smooth function of ``x`` plus Gaussian noise; the target is a float
(regression). Each split draws its own samples around the same centres (or function).
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset

SPLITS = {"train": 1, "val": 2}


class Blobs(Dataset):
    """``n`` points of ``features`` dimensions, ``classes`` Gaussian clusters ``spread`` apart (unit
    standard deviation); sample ``i`` is ``(x [features] float32, label int64)``."""

    def __init__(
        self,
        n: int = 512,
        classes: int = 4,
        features: int = 8,
        spread: float = 3.0,
        split: str = "train",
        seed: int = 0,
    ):
        centres = torch.randn(classes, features, generator=torch.Generator().manual_seed(seed)) * spread
        draw = torch.Generator().manual_seed(seed * 10 + SPLITS[split])
        self.y = torch.randint(classes, (n,), generator=draw)
        self.x = centres[self.y] + torch.randn(n, features, generator=draw)
        self.classes = [f"blob{c}" for c in range(classes)]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Wave(Dataset):
    """``n`` points ``x`` uniform in [-π, π] with targets ``sin(2x) + x/2`` plus noise of standard deviation
    ``noise``; sample ``i`` is ``(x [1], y [1])``, both float32, so a model with one output matches it."""

    def __init__(self, n: int = 512, noise: float = 0.1, split: str = "train", seed: int = 0):
        draw = torch.Generator().manual_seed(seed * 10 + SPLITS[split])
        self.x = (torch.rand(n, 1, generator=draw) * 2 - 1) * math.pi
        self.y = torch.sin(2 * self.x) + self.x / 2 + noise * torch.randn(n, 1, generator=draw)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]
