"""What every data set's ``build()`` returns: train/validation splits, and loaders sharded across ranks.

Training data is sharded with ``torch.utils.data.DistributedSampler``: each epoch all ranks draw the same
permutation (seed + epoch), pad it to a multiple of the number of ranks, and rank r takes every N-th index
starting at r. The shards are disjoint up to that padding and every rank runs the same number of steps; the
k-th batches of all ranks together are the k-th batch of N·b samples of one process with the same seed.
Validation is sharded without padding, so every sample is counted exactly once.

Loading runs in the background when a data set has ``workers > 0``: torch DataLoader worker processes started
with the ``forkserver`` method (a process that has initialised MPI must not fork), which prepare the next
batches while the current one trains; with a GPU, batches come in pinned memory for asynchronous copies.
``workers=None`` (the default of the data sets read from disk) leaves the count to :func:`loader_workers`,
decided on the rank from the cores it is bound to. A loader process ends with its rank
(:func:`end_with_rank`): a rank killed under fault tolerance must not leave them behind.

On a GPU, a data set held in memory as tensors (:class:`TensorData`) that takes at most
:data:`RESIDENT_SHARE` of the GPU's free memory is moved there once (:meth:`ClassificationData.place`):
each batch is then gathered on the GPU, with no loader process, host copy or pinned transfer per step.
"""

from __future__ import annotations

import functools
import math
import os
import select
import threading
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Sampler, Subset

#: The most background loader processes per rank that ``workers=None`` starts.
MAX_AUTO_WORKERS = 4
#: An in-memory data set moves to the GPU where it takes at most this share of the GPU's free memory.
RESIDENT_SHARE = 0.25


def end_with_rank(rank_pid: int, worker_id: int) -> None:
    """In a loader process: end it as soon as the rank ``rank_pid`` that started it has ended. Its parent
    is the forkserver, not the rank, so torch's own watch (of the parent) misses a killed rank; and the
    forkserver lives while its children hold its pipe: a killed rank's loaders, its forkserver and mpirun's
    output pipe they keep open would otherwise outlive the job."""
    try:
        handle = os.pidfd_open(rank_pid)
    except (OSError, AttributeError):  # no such process any more, or no pidfd (not Linux 5.3+)
        handle = None
    if handle is None and not _alive(rank_pid):
        os._exit(1)

    def watch() -> None:
        if handle is not None:
            select.select([handle], [], [])  # readable once the process has ended
        else:
            while _alive(rank_pid):
                threading.Event().wait(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="end-with-rank", daemon=True).start()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def loader_workers(requested: int | None) -> int:
    """Background loader processes per rank: ``requested`` where given, else one per core this process is
    bound to beyond the first (which trains), at most :data:`MAX_AUTO_WORKERS`: 0 on a one-core rank, where
    loading runs in the training process (more would only compete with it for the core)."""
    if requested is not None:
        return requested
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform (macOS): all cores
        cores = os.cpu_count() or 1
    return max(0, min(MAX_AUTO_WORKERS, cores - 1))


def root_dataset(dataset: Dataset) -> Dataset:
    """The data set under any ``Subset`` wrappers (a held-out split, a rank's validation share)."""
    while isinstance(dataset, Subset):
        dataset = dataset.dataset
    return dataset


class BatchedData(Dataset):
    """A data set that builds whole batches: ``__getitems__(indices)`` returns ``(inputs, labels)``."""

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.__getitems__([i])
        return x[0], y[0]


class TensorData(BatchedData):
    """An in-memory data set of (inputs, labels) that fetches whole batches by fancy indexing."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor):
        assert len(x) == len(y)
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        idx = torch.as_tensor(indices)
        if self.x.is_cuda:  # from pinned memory: a pageable copy would wait for the GPU's queued work
            idx = idx.pin_memory().to(self.x.device, non_blocking=True)
        return self.x[idx], self.y[idx]

    def nbytes(self) -> int:
        return self.x.nbytes + self.y.nbytes

    def to(self, device: torch.device) -> None:
        self.x, self.y = self.x.to(device), self.y.to(device)


class ShardSampler(DistributedSampler):
    """``DistributedSampler`` whose next epoch can start part-way, after ``start_at(n)`` samples (a run
    resumed from a checkpoint taken mid-epoch); its length stays that of a whole epoch.

    ``set_epoch`` also reseeds ``generator``, the loader's own, from which a DataLoader draws the seeds of
    its worker processes when an epoch begins: so starting an epoch takes nothing from the global torch
    generator, whose state a checkpoint saves, and a resumed run draws the same random numbers."""

    def __init__(self, *args, generator: torch.Generator, **kwargs):
        super().__init__(*args, **kwargs)
        self.generator = generator
        self.start = 0

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        self.generator.manual_seed(self.seed + 1_000_003 * epoch + 7919 * self.rank)

    def start_at(self, samples: int) -> None:
        self.start = samples

    def reshard(self, rank: int, replicas: int) -> None:
        """Deal the next epochs to ``replicas`` ranks, this one being ``rank`` (after workers were lost)."""
        self.rank, self.num_replicas = rank, replicas
        self.num_samples = math.ceil(len(self.dataset) / replicas)
        self.total_size = self.num_samples * replicas

    def __iter__(self):
        indices = list(super().__iter__())[self.start :]
        self.start = 0
        return iter(indices)


def _batch(batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return batch


@dataclass
class ClassificationData:
    """A loaded data set, as the training loop uses it: the two splits, what a sample looks like, and how
    many background loader processes each rank starts (``workers``; 0 loads in the training process, None
    decides by the rank's cores through :func:`loader_workers`). ``num_classes`` is None where unknown (a
    user's data set that declares none)."""

    train: Dataset
    val: Dataset
    shape: tuple[int, ...]
    num_classes: int | None
    workers: int | None = 0
    classes: list[str] | None = None  # class names, where the data set has them

    resident: bool = False  # both splits in GPU memory (:meth:`place`)

    def __post_init__(self) -> None:
        self.shape = tuple(self.shape)
        self.workers = loader_workers(self.workers)

    def place(self, device: torch.device) -> int:
        """Move in-memory splits to the GPU ``device`` where they fit in :data:`RESIDENT_SHARE` of its free
        memory; the bytes moved (0: they stay on the host, and batches come through pinned memory)."""
        roots = list({id(r): r for r in map(root_dataset, (self.train, self.val))}.values())
        if device.type != "cuda" or not all(type(r) is TensorData for r in roots):
            return 0
        size = sum(r.nbytes() for r in roots)
        if size > RESIDENT_SHARE * torch.cuda.mem_get_info(device)[0]:
            return 0
        for r in roots:
            r.to(device)
        self.resident, self.workers = True, 0  # loader processes cannot read CUDA tensors
        return size

    def _loader(
        self, dataset: Dataset, batch_size: int | None, pin_memory: bool = False, prefetch: int = 4, **kwargs
    ) -> DataLoader:
        if self.workers > 0:
            kwargs.update(
                num_workers=self.workers,
                multiprocessing_context="forkserver",
                persistent_workers=True,
                prefetch_factor=prefetch,
                worker_init_fn=functools.partial(end_with_rank, os.getpid()),
            )
        if batch_size is not None:
            kwargs["batch_size"] = batch_size
        collate = _batch if isinstance(root_dataset(dataset), BatchedData) else None
        return DataLoader(dataset, collate_fn=collate, pin_memory=pin_memory, **kwargs)

    def train_loader(
        self, rank: int, world: int, batch_size: int, seed: int, pin_memory: bool = False
    ) -> DataLoader:
        """Loader of this rank's shard; call ``loader.sampler.set_epoch(e)`` before each epoch."""
        generator = torch.Generator()
        sampler = ShardSampler(
            self.train, num_replicas=world, rank=rank, shuffle=True, seed=seed, generator=generator
        )
        return self._loader(self.train, batch_size, pin_memory, sampler=sampler, generator=generator)

    def dealt_loader(self, dealer: Sampler[list[int]], seed: int, pin_memory: bool = False) -> DataLoader:
        """Loader of the micro-batches ``dealer`` draws (dynamic assignment, runner/rank/assignment.py).
        Loader processes take one batch ahead each, so a worker holds few chunks it has not trained."""
        generator = torch.Generator().manual_seed(seed)
        return self._loader(
            self.train, None, pin_memory, prefetch=1, batch_sampler=dealer, generator=generator
        )

    def val_loader(self, rank: int, world: int, batch_size: int, pin_memory: bool = False) -> DataLoader:
        """Loader of this rank's share of the validation set (rank, rank + N, ...; no padding)."""
        return self._loader(Subset(self.val, range(rank, len(self.val), world)), batch_size, pin_memory)


def spread(dataset: Dataset, count: int | None) -> Dataset:
    """``count`` samples of ``dataset`` spread evenly over it (the same ones for any number of ranks, every
    run), or the whole of it where ``count`` is None or not smaller."""
    if count is None or count >= len(dataset):
        return dataset
    return Subset(dataset, [i * len(dataset) // count for i in range(count)])


def normalize(x: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    """uint8 NHWC or NCHW batch → float NCHW in [0, 1], then per-channel standardised."""
    if x.shape[-1] == len(mean) and x.shape[1] != len(mean):
        x = x.permute(0, 3, 1, 2)
    x = x.float().div_(255)
    m = torch.tensor(mean).view(1, -1, 1, 1)
    s = torch.tensor(std).view(1, -1, 1, 1)
    return x.sub_(m).div_(s).contiguous()


def random_crop_flip(x: torch.Tensor, size: int, padding: int = 0) -> torch.Tensor:
    """Per-sample random crop of ``size`` (after zero ``padding``) and horizontal flip of an NCHW batch."""
    if padding:
        x = torch.nn.functional.pad(x, (padding, padding, padding, padding))
    n, _, h, w = x.shape
    top = torch.randint(0, h - size + 1, (n,))
    left = torch.randint(0, w - size + 1, (n,))
    rows = (top[:, None] + torch.arange(size))[:, None, :, None]
    cols = (left[:, None] + torch.arange(size))[:, None, None, :]
    out = x[torch.arange(n)[:, None, None, None], torch.arange(x.shape[1])[None, :, None, None], rows, cols]
    flip = torch.rand(n) < 0.5
    out[flip] = out[flip].flip(-1)
    return out


def center_crop(x: torch.Tensor, size: int) -> torch.Tensor:
    h, w = x.shape[-2:]
    top, left = (h - size) // 2, (w - size) // 2
    return x[..., top : top + size, left : left + size]
