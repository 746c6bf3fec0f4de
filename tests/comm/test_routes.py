"""The routes a tensor collective takes (runner/comm/routes/): their order, which one each call takes, and
that a route of one new file registered with one line is used by a real ``Comm``."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

from runner.comm import routes
from runner.comm.stats import CommStats, clock, share

CPU = torch.zeros(4)


def chosen(op: str, size: int = 2, dist: object = None, wire: torch.dtype | None = None, n: int = 1) -> str:
    """The class name of the route a communicator of ``size`` ranks (``dist``: its transport) takes."""
    comm = SimpleNamespace(size=size, dist=dist)
    return type(routes.choose(routes.load(), comm, op, (CPU,) * n, wire)).__name__


def test_the_routes_and_their_order():
    assert [type(r).__name__ for r in routes.load()] == [
        "Wire16",
        "TorchDistributed",
        "BackgroundThread",
        "Hierarchical",
        "MpiBuffers",
    ]


GLOO = SimpleNamespace(takes=lambda t: t.device.type == "cpu")


@pytest.mark.parametrize(
    "op, size, dist, wire, n, route",
    [
        ("allreduce", 2, None, None, 1, "MpiBuffers"),
        ("allreduce", 2, None, torch.bfloat16, 1, "Wire16"),
        ("allreduce", 1, None, torch.bfloat16, 1, "MpiBuffers"),  # one rank: nothing to exchange
        ("iallreduce", 2, None, None, 1, "MpiBuffers"),
        ("allreduce_background", 2, None, None, 1, "BackgroundThread"),
        ("allreduce_background", 2, None, torch.float16, 1, "BackgroundThread"),
        ("broadcast", 2, None, None, 1, "MpiBuffers"),
        ("alltoall", 2, None, None, 2, "MpiBuffers"),
        ("allreduce", 2, GLOO, None, 1, "TorchDistributed"),
        ("allreduce", 2, GLOO, torch.bfloat16, 1, "Wire16"),  # whose steps take the transport
        ("allreduce_background", 2, GLOO, torch.bfloat16, 1, "TorchDistributed"),
        ("allgather", 2, GLOO, None, 2, "TorchDistributed"),
        ("allreduce", 2, SimpleNamespace(takes=lambda t: False), None, 1, "MpiBuffers"),  # NCCL, CPU tensor
    ],
)
def test_each_call_takes_the_first_route_that_takes_it(op, size, dist, wire, n, route):
    assert chosen(op, size, dist, wire, n) == route


def test_each_communicator_has_route_objects_of_its_own():
    """What a route keeps (16-bit buffers, the hierarchical exchange's sub-communicators) is for one
    communicator: two communicators, or one replaced after a loss, never share it."""
    first, second = routes.load(), routes.load()
    assert [type(r) for r in first] == [type(r) for r in second]
    assert not any(a is b for a, b in zip(first, second, strict=True))


def test_seconds_are_counted_once_and_bytes_by_one_table():
    stats = CommStats()
    with clock(stats):
        with clock(stats):  # an inner call (the 16-bit exchange's all-to-all inside its all-reduce)
            pass
        outer = stats.seconds
    assert outer == 0.0 and stats.seconds > 0.0
    assert [share(op, 4) for op in ("allreduce", "alltoall", "allgather", "send")] == [1.5, 0.75, 3, 1.0]
    assert share("broadcast", 4, root=True) == 3 and share("broadcast", 4) == 0 and share("allreduce", 1) == 0


SCRIPT = """
import torch
from runner.comm import routes
routes.ROUTES.insert(0, "tests.helpers.doubling_route.Doubling")  # the one registration line
from runner.comm.face import CommLike, MembershipLike
from runner.comm.mpi import init
c = init()
assert isinstance(c, CommLike) and isinstance(c, MembershipLike)
wide, narrow = torch.ones(3, dtype=torch.float64), torch.ones(3)
c.allreduce(wide)
c.allreduce(narrow)
c.allreduce_background(wide).wait()  # the background thread's route, whose all-reduce takes it again
print("routes:", wide.tolist(), narrow.tolist(), type(c.route_for("allreduce", (wide,))).__name__)
"""


def test_a_registered_route_is_tried_first(monkeypatch):
    """One line in ``ROUTES`` puts tests/helpers/doubling_route.py before the others, for what it takes."""
    monkeypatch.setattr(routes, "ROUTES", list(routes.ROUTES))
    routes.ROUTES.insert(0, "tests.helpers.doubling_route.Doubling")
    comm, wide = SimpleNamespace(size=2, dist=None), torch.zeros(2, dtype=torch.float64)
    assert type(routes.choose(routes.load(), comm, "allreduce", (wide,), None)).__name__ == "Doubling"
    assert type(routes.choose(routes.load(), comm, "allreduce", (CPU,), None)).__name__ == "MpiBuffers"
    assert type(routes.choose(routes.load(), comm, "broadcast", (wide,), None)).__name__ == "MpiBuffers"


@pytest.mark.slow
def test_a_route_of_one_file_and_one_line_is_used():
    """tests/helpers/doubling_route.py, registered by one line, takes a real one-rank ``Comm``'s all-reduces
    of float64 tensors (an all-reduce over one rank changes nothing, so only the route doubles them)."""
    from tests.comm.test_comm import run_job

    proc = run_job([sys.executable, "-c", SCRIPT])
    assert "routes: [4.0, 4.0, 4.0] [1.0, 1.0, 1.0] Doubling" in proc.stdout


class _OneRank:
    """MPI's buffer calls over one rank: what is sent is what is received."""

    def Alltoall(self, send, recv):  # noqa: N802 (mpi4py's names)
        recv[...] = send

    def Allgather(self, send, recv):  # noqa: N802
        recv[...] = send


@pytest.mark.parametrize("op", ["alltoall", "allgather"])
def test_a_staged_receive_buffer_gets_the_result(op):
    """A receive buffer MPI cannot write in place (here: not contiguous; on a GPU: without CUDA-aware MPI,
    as the NCCL check found) is staged through a host copy, which must be copied back."""
    from runner.comm.routes.mpi import MpiBuffers
    from runner.comm.staging import Buffers

    comm = SimpleNamespace(buffers=Buffers(cuda_aware=False), _c=_OneRank())
    send = torch.arange(6, dtype=torch.float32)
    recv = torch.zeros(6, 2)[:, 0]  # a strided view
    getattr(MpiBuffers(), op)(comm, send, recv)
    assert torch.equal(recv, send)
