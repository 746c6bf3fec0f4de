"""Emulated links (runner/comm/links.py): the cost of each collective kind against hand-computed numbers,
the delay spent once per outermost call, a non-blocking request that pays only what is left when waited
for, the settings' checks, and (slow) BSP's step time growing by the computed cost in a real job."""

from __future__ import annotations

import math
import re
import time
from types import SimpleNamespace

import pytest
import torch

from runner.comm.links import Links, emulated, latency_steps, leaving_edges, link_bytes
from runner.comm.mpi import Comm
from runner.comm.requests import BackgroundRequest, DistRequest
from runner.comm.routes.base import Route
from runner.comm.routes.wire import Wire16
from runner.comm.staging import Buffers
from runner.comm.stats import CommStats, Transfer, clock, owe
from runner.schema.sections import SimulateConfig
from tests.conftest import ROOT, checked_config

MB = 10**6
#: 1 ms latency and 8 Mbit/s: a crossing of n bytes costs 1e-3 + n / 1e6 seconds.
SLOW = Links(ranks_per_node=1, gbps=0.008, latency_s=1e-3)


@pytest.mark.parametrize(
    "op, nodes, expected",
    [
        ("allreduce", [0, 1, 2, 3], 2 * 3 / 4 * MB),  # ring: 2(N-1)/N of the buffer on each node's link
        ("iallreduce", [0, 0, 1, 1], 2 * 3 / 4 * MB),  # 2 nodes of 2: one ring edge leaves each
        ("allreduce_background", [0, 1, 0, 1], 2 * 2 * 3 / 4 * MB),  # two ring edges leave each node
        ("allreduce", [0, 0, 0, 0], 0.0),  # one node: nothing crosses
        ("broadcast", [0, 1, 2, 3], 3 * MB),  # once per receiving node
        ("broadcast", [0, 0, 1, 1], 1 * MB),
        ("alltoall", [0, 1, 2, 3], 1 * 3 / 4 * MB),  # a node of m ranks sends m(N-m)/N of each buffer
        ("alltoall", [0, 0, 1, 1], 2 * 2 / 4 * MB),
        ("allgather", [0, 1, 2, 3], 3 * MB),  # ring: N-1 buffers on each edge that leaves a node
        ("allgather", [0, 0, 1, 1], 3 * MB),
        ("allgather", [5], 0.0),
    ],
)
def test_bytes_over_the_busiest_link_per_collective(op, nodes, expected):
    assert max(link_bytes(op, nodes, MB).values()) == pytest.approx(expected)
    cost = latency_steps(op, len(nodes)) * 1e-3 + expected / 1e6 if expected else 0.0
    assert SLOW.collective(op, nodes, MB) == pytest.approx(cost)


@pytest.mark.parametrize(
    "op, n, steps",
    [
        ("allreduce", 4, 6),  # a ring: reduce-scatter and all-gather, N-1 rounds each
        ("allreduce_background", 8, 14),
        ("allgather", 4, 3),
        ("alltoall", 4, 3),  # pairwise
        ("broadcast", 4, 2),  # a binomial tree
        ("broadcast", 5, 3),
        ("broadcast", 2, 1),
    ],
)
def test_each_collective_pays_a_latency_per_round_of_its_algorithm(op, n, steps):
    assert latency_steps(op, n) == steps


def test_a_ring_all_reduce_at_100_ms_and_4_ranks_pays_six_latencies_not_one():
    """100 ms one way, a buffer small enough to ignore its transfer: 6 × 100 ms."""
    slow_rtt = Links(ranks_per_node=1, gbps=100.0, latency_s=0.1)
    assert slow_rtt.collective("allreduce", [0, 1, 2, 3], 8) == pytest.approx(0.6, rel=1e-6)
    assert slow_rtt.message(0, 1, 8) == pytest.approx(0.1, rel=1e-6)


def test_ring_edges_and_nodes_by_rank_order():
    def ring_edges(nodes: list[int]) -> int:  # the most ring edges that leave one node
        return max(leaving_edges(nodes).values())

    assert ring_edges([0, 1]) == 1 and ring_edges([0, 0, 1, 1, 2, 2]) == 1 and ring_edges([0, 0]) == 0
    links = Links(ranks_per_node=3, gbps=1.0, latency_s=0.0)
    assert [links.node(r) for r in range(7)] == [0, 0, 0, 1, 1, 1, 2]


def test_messages_cross_only_between_nodes_and_the_16_bit_exchange_moves_half():
    assert SLOW.message(0, 0, MB) == 0.0
    assert SLOW.message(0, 1, MB) == pytest.approx(1e-3 + 1.0)
    assert SLOW.message(0, 1, 0) == 0.0
    # 1000 bf16 values over 4 nodes: chunks of 250; the all-to-all sends 3/4 of 2000 bytes, the all-gather
    # 3 chunks of 500 bytes: 3000 bytes, half of the float32 ring's 6000, and 3 + 3 latencies as the ring's
    assert SLOW.wire_allreduce([0, 1, 2, 3], 1000, 2) == pytest.approx(6e-3 + 3000 / 1e6)
    assert SLOW.collective("allreduce", [0, 1, 2, 3], 4000) == pytest.approx(6e-3 + 6000 / 1e6)
    # 1001 values: the padded buffer (4 chunks of 251) travels
    assert SLOW.wire_allreduce([0, 1, 2, 3], 1001, 2) == pytest.approx(6e-3 + (0.75 * 2008 + 3 * 502) / 1e6)


class Instant(Route):
    """A route that moves nothing and takes no time: what is left of a call is its emulated cost."""

    def allreduce(self, comm, t, op, wire):
        pass

    def iallreduce(self, comm, t, op):
        return DistRequest(comm, None)

    def allreduce_background(self, comm, t, op, wire):
        request = BackgroundRequest(comm)
        request.finish()  # done at once, as a thread that ran it would say
        return request

    def broadcast(self, comm, t, root):
        pass

    def alltoall(self, comm, send, recv):
        pass

    def allgather(self, comm, send, recv):
        pass


class FakeMpi:
    """What ``Comm``'s point-to-point calls use of an MPI communicator."""

    def Send(self, buf, dest, tag):  # noqa: N802 (MPI's name)
        pass

    def Recv(self, buf, source, tag, status):  # noqa: N802
        pass


def bare_comm(nodes: list[int], links: Links, rank: int = 0) -> Comm:
    """A ``Comm`` without MPI: rank ``rank`` of ranks on ``nodes``, over :class:`Instant`."""
    comm = Comm.__new__(Comm)
    comm._c, comm.rank, comm.size = FakeMpi(), rank, len(nodes)
    comm.stats, comm.routes_tried = CommStats(links=links), [Wire16(), Instant()]
    comm.tolerant, comm.dist, comm.buffers = False, None, Buffers(False)
    comm._nodes_of, comm._node_list = (comm._c, links), list(nodes)
    comm._background = None
    return comm


#: 0.5 ms latency, 80 Mbit/s: a 100 kB float32 all-reduce over 2 nodes costs 0.5 + 10 ms.
FAST = Links(ranks_per_node=1, gbps=0.08, latency_s=5e-4)
COST = 2 * 5e-4 + 4e5 * 8 / 0.08e9 / 4  # 100,000 bytes: 2(N-1)/N = 1 of it crosses, 2(N-1) = 2 latencies


def test_a_blocking_call_spends_its_cost_after_the_operation_once():
    comm = bare_comm([0, 1], FAST)
    t = torch.zeros(25_000)  # 100 kB
    start = time.perf_counter()
    comm.allreduce(t)
    elapsed = time.perf_counter() - start
    assert comm.stats.emulated_seconds == pytest.approx(COST, rel=0.05)
    assert COST <= comm.stats.seconds <= elapsed and elapsed < COST + 0.01
    comm.stats = CommStats(links=FAST)
    comm.allreduce(t, wire=torch.bfloat16)  # an all-to-all and an all-gather inside: paid once, by the outer
    expected = FAST.wire_allreduce([0, 1], 25_000, 2)
    assert comm.stats.emulated_seconds == pytest.approx(expected, rel=0.05)
    assert expected == pytest.approx(
        2 * 5e-4 + 50_000 * 8 / 0.08e9
    )  # half the bytes, (N-1) + (N-1) latencies


def test_nested_timed_blocks_pay_only_the_outermost_call_s_cost():
    stats = CommStats(links=FAST)
    with clock(stats):
        owe(0.02)
        with clock(stats):
            owe(0.5)  # a call inside the outer one: its cost is in the outer's
    assert stats.emulated_seconds == pytest.approx(0.02, abs=0.005)


def test_point_to_point_pays_across_nodes_only():
    comm = bare_comm([0, 0, 1], FAST)
    t = torch.zeros(25_000)
    comm.send(t, dest=1)
    assert comm.stats.emulated_seconds == 0.0
    comm.send(t, dest=2)
    assert comm.stats.emulated_seconds == pytest.approx(5e-4 + 1e5 * 8 / 0.08e9, rel=0.05)


def test_a_request_waited_for_late_pays_nothing_more():
    comm = bare_comm([0, 1], FAST)
    t = torch.zeros(25_000)
    early = comm.iallreduce(t)
    assert not early.test(), "the emulated transfer is not through yet"
    early.wait()
    assert comm.stats.emulated_seconds == pytest.approx(COST, rel=0.2)
    paid = comm.stats.emulated_seconds
    late = comm.allreduce_background(t)  # complete at once: its transfer starts now
    time.sleep(COST + 0.005)  # computing while the transfer runs: it overlaps
    assert late.test()
    start = time.perf_counter()
    late.wait()
    assert time.perf_counter() - start < 5e-3 and comm.stats.emulated_seconds == paid


def test_a_transfer_starts_when_the_real_operation_is_complete():
    """A queued all-reduce that the thread took 20 ms to run: its transfer starts then, not at its start
    (the real operation's time is the rank's own work, which real links would add to, not hide)."""
    stats = CommStats(links=FAST)
    request = BackgroundRequest(SimpleNamespace(stats=stats))
    request.transfer = Transfer(stats, 0.02)
    time.sleep(0.02)  # the thread runs the real all-reduce
    request.finish()
    start = time.perf_counter()
    with clock(stats):
        request.wait()
    assert 0.018 < time.perf_counter() - start < 0.035
    assert stats.emulated_seconds == pytest.approx(0.02, abs=0.005)


def test_requests_started_together_share_the_link():
    comm = bare_comm([0, 1], FAST)
    t = torch.zeros(25_000)
    start = time.perf_counter()
    first, second = comm.allreduce_background(t), comm.allreduce_background(t)  # both complete at once
    second.wait()
    first.wait()
    assert 0.95 * 2 * COST < time.perf_counter() - start < 2 * COST + 0.015  # (a loaded machine wakes late)


def test_the_settings_make_links_or_none():
    assert emulated(SimulateConfig()) is None
    assert emulated(SimulateConfig(ranks_per_node=2)) is None
    assert emulated(SimulateConfig(ranks_per_node=2, link_gbps=0.1, spin=True)) == Links(2, 0.1, 5e-5, True)
    assert "no link is emulated" in SimulateConfig(link_gbps=0.1).warning()
    assert "no link is emulated" in SimulateConfig(ranks_per_node=1).warning()
    assert "link_gbps=[1,0.05] with no" in SimulateConfig(link_gbps=[1, 0.05]).warning()


def test_a_link_per_node_takes_its_own_share_and_the_largest_latency_of_a_round():
    """4 nodes of 1 rank, the fourth at 1/20 of the others' rate and 40 ms away: a ring all-reduce moves
    2(N-1)/N of the buffer over every node's link, so the slow one sets the transfer; each of its 6 rounds
    waits for the slowest crossing (40 ms). Uniform lists are the single value's links."""
    one_slow = Links(1, (1.0, 1.0, 1.0, 0.05), (1e-3, 1e-3, 1e-3, 0.04))
    transfer = 2 * 3 / 4 * MB * 8 / 0.05e9
    assert one_slow.collective("allreduce", [0, 1, 2, 3], MB) == pytest.approx(6 * 0.04 + transfer)
    assert one_slow.collective("allreduce", [0, 1, 2], MB) == pytest.approx(
        4 * 1e-3 + 2 * 2 / 3 * MB * 8 / 1e9
    )
    assert one_slow.message(0, 3, MB) == pytest.approx(0.04 + MB * 8 / 0.05e9)  # the slower end
    assert one_slow.message(0, 1, MB) == pytest.approx(1e-3 + MB * 8 / 1e9)
    assert one_slow.rate(7) == 0.05 and one_slow.latency(9) == 0.04  # past the list: its last value
    uniform = Links(1, (0.1,) * 4, (2e-3,) * 4)
    for op in ("allreduce", "broadcast", "alltoall", "allgather"):
        for nodes in ([0, 1, 2, 3], [0, 0, 1, 1], [0, 1, 0, 1]):
            same = Links(1, 0.1, 2e-3).collective(op, nodes, MB)
            assert uniform.collective(op, nodes, MB) == pytest.approx(same), (op, nodes)


def test_a_broadcast_sends_from_the_roots_node_and_each_other_node_receives_once():
    slow_root = Links(1, (0.01, 1.0, 1.0), 0.0)  # rank 0's node is slow: it sends the buffer twice
    assert slow_root.collective("broadcast", [0, 1, 2], MB) == pytest.approx(2 * MB * 8 / 0.01e9)
    slow_leaf = Links(1, (1.0, 1.0, 0.01), 0.0)  # a slow receiver gets it once
    assert slow_leaf.collective("broadcast", [0, 1, 2], MB) == pytest.approx(MB * 8 / 0.01e9)


def test_a_list_longer_than_the_nodes_is_refused_naming_both():
    with pytest.raises(ValueError, match=re.escape("3 values, one per emulated node, but the job's 2 ranks")):
        checked_config(["devices=2", "simulate.ranks_per_node=1", "simulate.link_gbps=[1,1,1]"])
    servers = checked_config(
        ["rule=asgd", "devices=2", "simulate.ranks_per_node=1", "simulate.link_gbps=[1,1,1]"]
    )
    assert emulated(servers.simulate).rate(2) == 1.0  # 2 workers and a server: 3 nodes


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "conf" / "network").glob("*.yaml")))
def test_every_network_preset_makes_links_for_any_number_of_nodes(preset):
    for devices in (2, 4, 8):  # (a per-node list's last value serves the nodes past it)
        links = emulated(checked_config([f"network={preset}", f"devices={devices}"]).simulate)
        assert links is not None and links.ranks_per_node == 1, preset
    slow = emulated(checked_config(["network=one_slow_node", "devices=4"]).simulate)
    assert (slow.rate(0), slow.latency(0), slow.rate(3), slow.latency(3)) == (0.05, 0.04, 1.0, 5e-5)
    given = checked_config(["network=internet", "simulate.link_gbps=0.5"]).simulate  # the command line wins
    assert (given.link_gbps, given.link_latency_ms) == (0.5, 40)


def test_per_node_settings_reach_the_links():
    simulate = SimulateConfig(ranks_per_node=1, link_gbps=[1, 1, 0.05], link_latency_ms=[0.05, 0.05, 40])
    assert emulated(simulate) == Links(1, (1.0, 1.0, 0.05), (5e-5, 5e-5, 0.04))
    cfg = checked_config(["devices=4", "simulate.ranks_per_node=1", "simulate.link_gbps=[1,1,1,0.05]"])
    assert emulated(cfg.simulate).rate(3) == 0.05


@pytest.mark.parametrize(
    "override, message",
    [
        ("simulate.link_gbps=0", "simulate.link_gbps=0 is invalid"),
        ("simulate.link_gbps=[1,0]", "simulate.link_gbps=[1, 0] is invalid"),
        ("simulate.link_gbps=[]", "simulate.link_gbps=[] is invalid"),
        ("simulate.link_gbps=fast", "simulate.link_gbps='fast' is invalid"),
        ("simulate.link_latency_ms=[0,-1]", "simulate.link_latency_ms=[0, -1] is invalid"),
        ("simulate.ranks_per_node=-1", "simulate.ranks_per_node=-1 is invalid"),
        ("simulate.link_latency_ms=-1", "simulate.link_latency_ms=-1 is invalid"),
        ("simulate.ranks_per_node=2", "puts all 2 ranks on one emulated node"),
    ],
)
def test_bad_link_settings_name_the_key_before_launch(override, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        checked_config(["devices=2", "simulate.link_gbps=0.1", override])


def fastest_step_s(run) -> float:
    """A run's fastest step, in seconds (the first steps left out: start-up): other work on the machine
    only adds to a step, and a sleeping rank woken late adds more (the median grew 0.9-1.5x under load)."""
    return min(r["step_ms"] for r in run.records("step")[3:]) / 1e3


@pytest.mark.slow
@pytest.mark.mpi
def test_bsp_steps_grow_by_the_emulated_cost(cli):
    """2 nodes of 1 rank at 10 Mbit/s: each BSP step all-reduces the MLP's gradients, 2(N-1)/N = 1 of them
    over the link, so a step grows by latency + bytes / bandwidth (about 60 ms here)."""
    common = ("model=mlp", "train.max_steps=25", "train.log_every=1", "train.epochs=1")
    free = cli(*common)
    slow = cli(*common, "simulate.ranks_per_node=1", "simulate.link_gbps=0.01")
    assert free.returncode == 0 and slow.returncode == 0, free.output + slow.output
    s = slow.summary
    per_step = s["bytes_sent"] / 2 / s["steps"]  # each worker's share of the all-reduce: the buffer once
    expected = 5e-5 + per_step * 8 / 0.01e9
    grown = fastest_step_s(slow) - fastest_step_s(free)
    assert 0.8 < grown / expected < 1.25, (grown, expected)
    assert s["emulated_comm_s"] == pytest.approx(expected * s["steps"], rel=0.3)
    assert free.summary["emulated_comm_s"] == 0.0


def test_a_link_event_slows_or_downs_its_node_for_its_window_only():
    from runner.comm.links import Event

    slowed, down = Event(1, 10.0, 5.0, 0.001), Event(2, 12.0, 2.0)
    links = Links(1, 1.0, 0.0, events=(slowed, down), start=time.monotonic() - 11.0)  # 11 s into the job
    assert links.rate(0) == 1.0 and links.rate(1) == 0.001 and links.rate(2) == 1.0
    assert links.down_for([0, 1, 2]) == 0.0
    megabyte = {1: 1e6, 0: 1e6}
    assert links.over(megabyte, 1) == pytest.approx(8e6 / 1e6, rel=1e-3), "1 MB at 1 Mbit/s: 8 s"
    later = Links(1, 1.0, 0.0, events=(slowed, down), start=time.monotonic() - 13.0)
    wait = later.down_for([0, 2])
    assert 0.9 < wait <= 1.0, "node 2 is down until 14 s"
    assert later.over({0: 1e6, 2: 1e6}, 1) == pytest.approx(wait + 8e6 / 1e9, abs=0.01)
    assert [(at, e.node, began) for at, e, began in later.edges(0.0, 14.5)] == [
        (10.0, 1, True), (12.0, 2, True), (14.0, 2, False),
    ]  # fmt: skip
    assert Links(1, 1.0, 0.0) == Links(1, 1.0, 0.0), "clocks are not compared"


@pytest.mark.parametrize(
    "events, message",
    [
        ("[{node:1,at_s:-1,for_s:2}]", "simulate.link_events[0].at_s=-1.0 is invalid"),
        ("[{node:1,at_s:1,for_s:0}]", "simulate.link_events[0].for_s=0.0 is invalid"),
        ("[{node:1,at_s:1,for_s:2,gbps:0}]", "simulate.link_events[0].gbps=0.0 is invalid"),
        ("[{node:2,at_s:1,for_s:2}]", "link_events[0].node=2 is invalid: the job's 2 ranks make 2 emulated"),
    ],
)
def test_bad_link_events_name_the_key_before_launch(events, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        checked_config(
            [
                "devices=2",
                "simulate.ranks_per_node=1",
                "simulate.link_gbps=1",
                f"simulate.link_events={events}",
            ]
        )
    with pytest.raises(ValueError, match="events change emulated links, and there are none"):
        checked_config(["devices=2", "simulate.link_events=[{node:1,at_s:1,for_s:2}]"])


def test_the_settings_carry_the_events_to_the_links():
    cfg = checked_config(
        [
            "devices=2",
            "simulate.ranks_per_node=1",
            "simulate.link_gbps=1",
            "simulate.link_events=[{node:1,at_s:3,for_s:2,gbps:0.5},{node:0,at_s:4,for_s:1}]",
        ]
    )
    from runner.comm.links import Event

    assert emulated(cfg.simulate).events == (Event(1, 3.0, 2.0, 0.5), Event(0, 4.0, 1.0, None))


@pytest.mark.slow
@pytest.mark.mpi
def test_a_link_slowed_mid_run_slows_the_steps_of_its_window_and_the_records_say_so(cli):
    """2 nodes at 1 Gbit/s; node 1's link drops to 5 Mbit/s for 1 s, 2.5 s into the job's clock: the steps
    between the metrics' ``link`` records take many times longer than the others, and the run ends as usual.
    Each step sleeps 10 ms (both ranks stragglers), so the 400 steps outlast the event on any machine (a
    fast one ran them all in under 2.5 s, and no event came)."""
    event = "[{node:1,at_s:2.5,for_s:1,gbps:0.005}]"
    run = cli(
        "model=mlp", "train.max_steps=400", "train.epochs=20", "train.log_every=1",
        "simulate.ranks_per_node=1", "simulate.link_gbps=1", f"simulate.link_events={event}",
        "simulate.straggler_ranks=[0,1]", "simulate.straggler_ms=10",
    )  # fmt: skip
    assert run.returncode == 0, run.output
    links = run.records("link")
    assert [(r["node"], r["state"]) for r in links] == [(1, "slowed"), (1, "restored")], links
    assert links[0]["gbps"] == 0.005 and links[0]["at_s"] == 2.5 and links[1]["at_s"] == 3.5
    steps = run.records("step")
    # (the steps each record names hold an edge: the restored one's may have run almost all after it)
    inside = [r["step_ms"] for r in steps if links[0]["step"] < r["step"] < links[1]["step"]]
    outside = [
        r["step_ms"] for r in steps[3:] if not links[0]["step"] - 1 <= r["step"] <= links[1]["step"] + 1
    ]
    assert len(inside) >= 3 and min(inside) > 3 * sorted(outside)[len(outside) // 2], (inside, outside)


def test_a_wrong_key_in_a_link_event_is_named_with_the_events_keys():
    from runner.launcher.explain import every_mistake

    [line] = every_mistake(
        ["simulate.ranks_per_node=1", "simulate.link_gbps=1", "simulate.link_events=[{node:1,at:1}]"]
    )
    assert line == (
        "simulate.link_events: an item has the key 'at', which it does not take; its keys are node, at_s, "
        "for_s, gbps"
    ), line


def test_a_misspelt_key_on_the_overrides_own_path_keeps_its_did_you_mean():
    """``trian.epochs``: Hydra's cause names 'trian' in the config's schema, which is not an item's key."""
    from runner.launcher.explain import every_mistake

    [line] = every_mistake(["trian.epochs=3"])
    assert "(did you mean train?)" in line and "an item has" not in line, line


def test_a_down_link_is_waited_for_once_per_operation_and_an_event_at_0_is_recorded():
    from runner.comm.links import Event

    down = Links(1, 1.0, 0.0, events=(Event(1, 0.0, 100.0),), start=time.monotonic() - 50.0)
    wait = down.down_for([0, 1])
    assert 49 < wait <= 50
    assert down.wire_allreduce([0, 1], 1000, 2) == pytest.approx(wait, abs=0.05), (
        "the 16-bit exchange's two parts"
    )
    assert [(at, began) for at, _, began in down.edges(-math.inf, 60.0)] == [(0.0, True)]


def test_overlapping_events_of_one_node_are_refused():
    events = "[{node:1,at_s:0,for_s:10,gbps:0.1},{node:1,at_s:5,for_s:10}]"
    refused = r"simulate.link_events\[1\].at_s=5.0 is invalid: node 1's event before it lasts until 10 s"
    with pytest.raises(ValueError, match=refused):
        checked_config(
            [
                "devices=2",
                "simulate.ranks_per_node=1",
                "simulate.link_gbps=1",
                f"simulate.link_events={events}",
            ]
        )
    checked_config(
        [
            "devices=3",
            "simulate.ranks_per_node=1",
            "simulate.link_gbps=1",
            "simulate.link_events=[{node:1,at_s:0,for_s:10},{node:2,at_s:5,for_s:10},{node:1,at_s:10,for_s:1}]",
        ]
    )


def test_a_link_event_mistake_is_named_beside_the_command_lines_other_mistakes():
    from runner.launcher.explain import every_mistake

    events = "simulate.link_events=[{node:1,at_s:-1,for_s:2}]"
    lines = every_mistake(["simulate.ranks_per_node=1", "simulate.link_gbps=1", events, "optim.lr=-1"])
    assert any(line.startswith("simulate.link_events[0].at_s=-1.0 is invalid") for line in lines), lines
    assert any(line.startswith("optim.lr=") for line in lines), lines
