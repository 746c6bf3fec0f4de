"""A worker's training batches on its device.

On a GPU the loader's batches come in pinned memory (``runner.rank.worker.loaders``), so their copies to the
device need not wait for the host; :class:`Prefetch` also starts the next step's copies on a side stream
while the current step computes, one step ahead. Elsewhere (the CPU) each batch is moved as it comes.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

Batch = tuple[torch.Tensor, torch.Tensor]


def moved(group: list[Batch], device: torch.device) -> list[Batch]:
    """``group``'s micro-batches on ``device`` (from pinned memory, copies the host does not wait for)."""
    return [(x.to(device, non_blocking=True), y.to(device, non_blocking=True)) for x, y in group]


class Prefetch:
    """Moves the groups of micro-batches (one step's each) a loader gives to ``device``.

    On CUDA, with ``ahead``, the copies of group i+1 start on a side stream before group i is handed over;
    the step's stream waits for its own group's copies only (an event per group), and the allocator is told
    that the tensors are used there (``record_stream``), so their memory is not reused before that stream is
    done. The meter's data wait of a step is then the wait for the batch of the step after it (the same
    total)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def __call__(self, groups: Iterable[list[Batch]], ahead: bool = True) -> Iterator[list[Batch]]:
        if self.stream is None or not ahead:
            for group in groups:
                yield moved(group, self.device)
            return
        waiting: tuple[list[Batch], torch.cuda.Event] | None = None
        for group in groups:
            with torch.cuda.stream(self.stream):
                started = moved(group, self.device), torch.cuda.Event()
                started[1].record(self.stream)
            if waiting is not None:
                yield self.ready(*waiting)
            waiting = started
        if waiting is not None:
            yield self.ready(*waiting)

    def ready(self, group: list[Batch], copied: torch.cuda.Event) -> list[Batch]:
        """``group`` for the current stream: it waits for ``copied`` (the group's copies) to run on."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(copied)
        for x, y in group:
            x.record_stream(current)
            y.record_stream(current)
        return group
