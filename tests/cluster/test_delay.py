"""The delaying forwarder (tests/cluster/delay.py) gives the namespaced nodes' real links their latency.

A TCP round trip between two nodes takes twice the larger of their one-way latencies, and little more (what
the forwarder adds itself: ``benchmarks/forwarder.py``); a latency set while the nodes are up applies at
once; a node cut from the forwarder's switch is unreachable until restored.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.delay import IDLE_S

pytestmark = pytest.mark.cluster

PROBE = [sys.executable, str(Path(__file__).with_name("probe.py"))]
PORT = "5301"
#: What a round trip may take beyond its two latencies: the forwarder's epoll waits in whole milliseconds
#: (up to 1 ms late each way) on a machine other tests load.
SLACK_MS = 6.0


def rtt_ms(nodes, count: int = 20, timeout: float = 30) -> float:
    done = nodes.run(0, [*PROBE, "ping", nodes.addrs[1], PORT, str(count)], timeout=timeout, check=True)
    return float(done.stdout.split()[1])


def test_round_trips_take_the_larger_latency_both_ways_and_follow_changes(make_nodes):
    nodes = make_nodes(2, latency_ms=10.0)
    nodes.popen(1, [*PROBE, "serve", PORT])
    assert 20.0 <= rtt_ms(nodes) <= 20.0 + SLACK_MS
    nodes.latency([2.0, 30.0])  # one way: the larger of the two ends
    assert 60.0 <= rtt_ms(nodes) <= 60.0 + SLACK_MS
    nodes.latency(0.0)
    assert rtt_ms(nodes) <= SLACK_MS


def test_a_cut_node_is_unreachable_until_restored(make_nodes):
    nodes = make_nodes(2, latency_ms=1.0)
    nodes.popen(1, [*PROBE, "serve", PORT])
    assert rtt_ms(nodes) >= 2.0
    nodes.cut(1)
    with pytest.raises(subprocess.TimeoutExpired):
        rtt_ms(nodes, timeout=2 + 10 * IDLE_S)
    nodes.restore(1)
    assert 2.0 <= rtt_ms(nodes) <= 2.0 + SLACK_MS
