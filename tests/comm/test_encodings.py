"""Encodings as a parameter of the collective (runner/comm/encodings/): one module and one line each, and
the communicator runs, prices and counts them, blocking or on its background thread (the sums' math:
tests/rules/test_compress.py)."""

from __future__ import annotations

import ast
import pkgutil
import time
from pathlib import Path

import pytest
import torch

from runner.comm import encodings
from runner.comm.encodings import ENCODINGS, KINDS, encoding, encoding_class
from runner.comm.encodings.base import Encoding
from runner.comm.links import Links
from runner.comm.stats import CommStats
from tests.comm.test_links import FAST, Instant, bare_comm

ROOT = Path(__file__).resolve().parents[2]

#: 1 Mbit/s, 10 ms one way: an encoded sum of 8,000 values costs 11 to 90 ms (a margin for a busy machine).
SLOW = Links(ranks_per_node=1, gbps=0.001, latency_s=0.01)


class Mirror(Instant):
    """Every rank sent what this one sends (so that what is decoded is data), at once."""

    def alltoall(self, comm, send, recv):
        recv.copy_(send)

    def allgather(self, comm, send, recv):
        recv.view(comm.size, -1).copy_(send.view(1, -1).expand(comm.size, -1))


def mirrored(nodes: list[int], links: Links):
    comm = bare_comm(nodes, links)
    comm.routes_tried = [Mirror()]
    return comm


def test_every_encoding_is_one_module_and_one_registration_line():
    """Each module of the package but the contract is registered once, by a line naming its class, whose
    ``name`` is its key; ``rule.compress`` takes exactly the registered ones (and none)."""
    modules = {m.name for m in pkgutil.iter_modules(encodings.__path__)} - {"base"}
    registered = {target.split(":")[0].rpartition(".")[2] for target in ENCODINGS.values()}
    assert registered == modules, "a module not registered, or a line naming no module"
    for name in ENCODINGS:
        cls = encoding_class(name)
        assert issubclass(cls, Encoding) and cls.name == name
    assert KINDS == ("none", *ENCODINGS)
    source = (ROOT / "runner/comm/encodings/__init__.py").read_text()
    assert all(source.count(f'"{name}": "') == 1 for name in ENCODINGS)


@pytest.mark.parametrize("name", list(ENCODINGS))
def test_an_encoded_sum_is_priced_once_blocking_and_in_the_background_and_its_bytes_counted(name):
    """Over two emulated nodes: the blocking encoded all-reduce owes the encoding's seconds once (its
    all-to-all and all-gather inside pay nothing more); queued on the background thread, its request books
    the same from when the thread is done with it, its wait pays what is left, and it holds the bytes the
    thread sent for it, those the communicator counted."""
    t = torch.randn(8_000)
    comm = mirrored([0, 1], SLOW)
    expected = encoding(name, t, 2).seconds(SLOW, [0, 1], t)
    assert expected > 0.0101, "its bytes cost something beyond the one latency: else this proves little"
    comm.allreduce(t.clone(), encoding=encoding(name, t, 2))
    assert comm.stats.emulated_seconds == pytest.approx(expected, rel=0.05)
    blocking_bytes = comm.stats.bytes_sent
    assert blocking_bytes > 0

    comm.stats = CommStats(links=SLOW)
    request = comm.allreduce_background(t.clone(), encoding=encoding(name, t, 2))
    request.wait()
    comm.end_background()
    assert request.transfer.seconds == expected, "priced once, as the blocking sum"
    assert request.transfer.due == pytest.approx(request._finished + expected, abs=1e-9), "from its end"
    assert time.perf_counter() >= request.transfer.due, "the wait pays what is left of it"
    assert comm.stats.emulated_seconds <= expected
    assert request.sent == comm.stats.bytes_sent == blocking_bytes


def test_a_plain_background_all_reduce_holds_its_bytes_too():
    t = torch.randn(1000)
    comm = mirrored([0, 1], FAST)
    comm.stats = CommStats()
    request = comm.allreduce_background(t)
    request.wait()
    comm.end_background()
    assert request.sent == comm.stats.bytes_sent == 4000  # 2(N-1)/N of 4000 bytes at N = 2


def test_streaming_diloco_has_no_link_pricing_or_thread_of_its_own():
    """Its exchanges are the communicator's (tests/rules/test_streaming_diloco.py shows it uses them): it
    imports nothing of the links, the counts or the thread, and names none of their prices."""
    tree = ast.parse((ROOT / "runner/rules/streaming_diloco.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert not imported & {"runner.comm.links", "runner.comm.stats", "runner.comm.background", "threading"}
    names = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert not names & {"Transfer", "Background", "two_phase", "book", "links", "emulated_seconds"}
