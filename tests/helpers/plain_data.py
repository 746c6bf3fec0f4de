"""Plain torch data sets as a user's project writes them (no base class of the runner, no schema), for
``data=dataset`` in tests/schema/test_dataset_option.py."""

from __future__ import annotations

import torch
from torch.utils.data import Dataset

CENTRES_SEED = 1234  # the same class centres in every split


class Blobs(Dataset):
    """``size`` points in ``dim`` dimensions, each near one of ``len(classes)`` fixed centres: the sample is
    ``(point, class index)``; which points (not the centres) depend on ``seed``."""

    def __init__(
        self, size: int = 256, dim: int = 4, num_classes: int = 3, seed: int = 0, spread: float = 0.3
    ):
        centres = 2 * torch.randn(num_classes, dim, generator=torch.Generator().manual_seed(CENTRES_SEED))
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, num_classes, (size,), generator=g)
        self.points = centres[self.labels] + spread * torch.randn(size, dim, generator=g)
        self.classes = [f"blob{i}" for i in range(num_classes)]

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.points[i], int(self.labels[i])


def blobs_pair(size: int = 256, val_size: int = 64, **kwargs) -> tuple[Blobs, Blobs]:
    """A (train, val) pair drawn with different seeds."""
    return Blobs(size, seed=0, **kwargs), Blobs(val_size, seed=1, **kwargs)


class Distances(Blobs):
    """Regression: the target is the point's distance to the origin, a float32 tensor."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.points[i], self.points[i].norm()


class Records(Blobs):
    """Samples as dictionaries, which the runner does not take."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.points[i], "y": self.labels[i]}


class Points(Blobs):
    """Samples without targets: one tensor each."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.points[i]


def nothing() -> int:
    """Returns no data set at all."""
    return 42


class BadRecord(Blobs):
    """:class:`Blobs` whose record ``bad`` cannot be read: indexing it raises, as a damaged file would."""

    def __init__(self, bad: int = 37, **kwargs):
        super().__init__(**kwargs)
        self.bad = bad

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == self.bad:
            raise ValueError(f"record {i} is damaged (bad checksum in blobs.bin)")
        return super().__getitem__(i)


class NaNRecord(Blobs):
    """:class:`Blobs` whose record ``bad`` has NaN features, as a damaged or badly converted file would."""

    def __init__(self, bad: int = 5, **kwargs):
        super().__init__(**kwargs)
        self.bad = bad

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = super().__getitem__(i)
        return (torch.full_like(x, float("nan")) if i == self.bad else x), y
