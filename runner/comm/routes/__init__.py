"""The routes a tensor collective may take, in the order a communicator tries them (Horovod's dispatch).

The first route that takes a call performs it (:func:`choose`).

Adding a route is one new file, a :class:`~runner.comm.routes.base.Route` subclass, and one line in
:data:`ROUTES`, before the routes it should be tried before. It imports no route until one is chosen. Each
communicator has route objects of its own (:func:`load`), which keep what they made for it (the 16-bit
exchange's buffers, the hierarchical exchange's sub-communicators).

"""

from __future__ import annotations

import functools
import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from runner.comm.routes.base import Carrier, Route

#: Each route as ``module.Class``, in the order they are tried.
ROUTES = [
    "runner.comm.routes.wire.Wire16",  # all-reduces asked in 16 bits: an all-to-all and an all-gather
    "runner.comm.routes.dist.TorchDistributed",  # the torch.distributed transport's tensors
    "runner.comm.routes.thread.BackgroundThread",  # queued all-reduces: MPI on the background thread
    "runner.comm.routes.hierarchical.Hierarchical",  # all-reduces across hosts: inside each host first
    "runner.comm.routes.mpi.MpiBuffers",  # everything else: MPI, directly or staged
]


def load(names: tuple[str, ...] | None = None) -> list[Route]:
    """New objects of the routes of ``names`` (default: :data:`ROUTES` as it is now), in order.

    They are a communicator's own."""
    return [_route_class(name)() for name in (ROUTES if names is None else names)]


@functools.lru_cache(maxsize=32)
def _route_class(name: str) -> type[Route]:
    module, _, cls = name.rpartition(".")
    return getattr(importlib.import_module(module), cls)


def choose(
    routes: list[Route], comm: Carrier, op: str, tensors: tuple[torch.Tensor, ...], wire: torch.dtype | None
) -> Route:
    """The first of ``routes`` that performs ``op`` and takes it for ``tensors``."""
    for route in routes:
        if route.performs(op) and route.takes(comm, op, tensors, wire):
            return route
    raise AssertionError(f"no route takes {op} of {[(t.dtype, t.device.type) for t in tensors]}")
