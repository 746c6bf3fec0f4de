"""What every data set provides: train/validation splits, and loaders sharded across ranks.

Training data is sharded with ``torch.utils.data.DistributedSampler``: each epoch all ranks draw the same
permutation (seed + epoch), pad it to a multiple of the number of ranks, and rank r takes every N-th index
starting at r. The shards are disjoint up to that padding and every rank runs the same number of steps; the
k-th batches of all ranks together are the k-th batch of N·b samples of one process with the same seed.
Validation is sharded without padding, so every sample is counted exactly once.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset


class TensorData(Dataset):
    """An in-memory data set of (inputs, labels) that fetches whole batches by fancy indexing."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        assert len(x) == len(y)
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices)
        return self.x[idx], self.y[idx]


def _batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch


class ClassificationData:
    """Base of the data sets: subclasses set ``train``, ``val``, ``shape`` and ``num_classes``."""

    train: Dataset
    val: Dataset
    shape: tuple[int, ...]
    num_classes: int

    def _loader(self, dataset: Dataset, batch_size: int, **kwargs) -> DataLoader:
        root = dataset
        while isinstance(root, Subset):
            root = root.dataset
        collate = _batch if isinstance(root, TensorData) else None
        return DataLoader(dataset, batch_size=batch_size, collate_fn=collate, **kwargs)

    def train_loader(self, rank: int, world: int, batch_size: int, seed: int) -> DataLoader:
        """Loader of this rank's shard; call ``loader.sampler.set_epoch(e)`` before each epoch."""
        sampler = DistributedSampler(self.train, num_replicas=world, rank=rank, shuffle=True, seed=seed)
        return self._loader(self.train, batch_size, sampler=sampler)

    def val_loader(self, rank: int, world: int, batch_size: int) -> DataLoader:
        """Loader of this rank's share of the validation set (rank, rank + N, ...; no padding)."""
        return self._loader(Subset(self.val, range(rank, len(self.val), world)), batch_size)
