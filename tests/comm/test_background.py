"""The communicator's background thread (runner/comm/background.py): in order, and it ends when closed."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from runner.comm.background import Background
from runner.comm.stats import CommStats


def test_queued_reduces_run_in_order_and_close_ends_the_thread_after_them():
    done: list[int] = []
    gate = threading.Event()

    def reduce(t, op, wire, encoding):
        gate.wait(5)
        done.append(t)

    thread = Background(SimpleNamespace(stats=CommStats()), reduce)
    requests = [thread.submit(i, "sum", None) for i in range(3)]
    thread.close()
    assert thread._thread.is_alive(), "close does not wait for the queued all-reduces"
    gate.set()
    thread._thread.join(5)
    assert not thread._thread.is_alive() and done == [0, 1, 2]
    for request in requests:
        request.wait()
    with pytest.raises(AssertionError, match="closed background thread"):
        thread.submit(3, "sum", None)
