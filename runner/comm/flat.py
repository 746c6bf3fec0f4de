"""Flat parameter storage: one contiguous buffer per (dtype, device) that the model's tensors are views of.

A rule that exchanges whole parameter vectors (model averaging, EASGD, gossip, parameter servers) then
sends one message per buffer, with no packing or unpacking copies.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import TYPE_CHECKING

from runner.lazy import lazy_import

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")


def message_buffer(numel: int, dtype: torch.dtype, device: torch.device, zero: bool = False) -> torch.Tensor:
    """A contiguous buffer that MPI will send.

    On the CPU it is numpy's memory, which numpy asks Linux to back with transparent huge pages (madvise,
    arrays of 4 MB and more), which Open MPI's shared-memory all-reduce reads faster than torch's own memory
    (benchmarks/README.md)."""
    import numpy as np

    np_dtype = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}.get(dtype)
    if torch.device(device).type != "cpu" or np_dtype is None:
        return (torch.zeros if zero else torch.empty)(numel, dtype=dtype, device=device)
    return torch.from_numpy((np.zeros if zero else np.empty)(numel, dtype=np_dtype))


class FlatTensors:
    """Re-points ``tensors`` into contiguous buffers (one per dtype and device) without changing values.

    After construction ``t.data`` of every tensor is a view into ``self.buffers``; writing a buffer writes
    the tensors and the other way round. Optimizers keep working: they hold the same Parameter objects.
    """

    def __init__(self, tensors: Iterable[torch.Tensor]):
        self.tensors = [t for t in tensors]
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in self.tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        self.buffers: list[torch.Tensor] = []
        for (dtype, device), ts in groups.items():
            flat = message_buffer(sum(t.numel() for t in ts), dtype, device)
            offset = 0
            for t in ts:
                n = t.numel()
                view = flat[offset : offset + n].view_as(t)
                view.copy_(t.data)
                t.data = view
                offset += n
            self.buffers.append(flat)

    @property
    def numel(self) -> int:
        return sum(b.numel() for b in self.buffers)


def float_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    """The floating-point buffers of ``module`` (BatchNorm running statistics and the like)."""
    return [b for b in module.buffers() if b.is_floating_point()]


def flat_copy(model: torch.nn.Module) -> tuple[torch.nn.Module, FlatTensors]:
    """A deep copy of ``model`` whose parameters live in flat buffers (for center or consensus models)."""
    clone = copy.deepcopy(model)
    return clone, FlatTensors(clone.parameters())
