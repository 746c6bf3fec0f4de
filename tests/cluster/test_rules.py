"""One rule of each kind of exchange across two nodes (own network stacks, TCP between them), as users run
it: one epoch each.

The rules are tests/helpers/rules.py's SAMPLED and SparseLoCo (an encoded exchange, gathered); every rule's
own math and training is tested on one node. A rule with a server rank has it on the node its first
worker is not on, so every server message crosses the link. Also: dynamic assignment across nodes with a
straggler on the other node (each sample trained exactly once), and the gloo transport across nodes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.rank.assignment import Chunks
from runner.run_folder import BINDINGS
from tests.cluster.conftest import mpitrain
from tests.helpers.rules import SAMPLED, variants
from tests.helpers.traced import OVERRIDES as TRACED

pytestmark = pytest.mark.cluster

#: More ranks than the machine's 2 cores in total: ranks waiting in MPI yield instead of busy-polling.
YIELD = "+hardware.mca.mpi_yield_when_idle=1"

#: Per rule and variant: overrides that make it exchange within one epoch (12 steps of 2 workers).
SETTINGS = {
    "easgd": {"async": ["rule.variant=async", "rule.tau=4"]},
    "async_diloco": {"": ["rule.inner_steps=4"]},
    "streaming_diloco": {"": ["rule.inner_steps=4", "rule.fragments=2"]},
    "sparseloco": {"": ["rule.inner_steps=4"]},
}


def hosts_of(run_dir: Path) -> dict[int, str]:
    """Each rank's node, as the ranks recorded it (bindings.json)."""
    ranks = json.loads((run_dir / BINDINGS).read_text())["ranks"]
    return {r["rank"]: r["host"] for r in ranks}


@pytest.mark.parametrize("rule, overrides", variants(SETTINGS, default=[], only=(*SAMPLED, "sparseloco")))
def test_each_kind_of_rule_trains_across_two_nodes(cluster, tmp_path, rule, overrides):
    """Two workers, one a node (a server rank, when the rule has one, on the second node); BSP's gradients
    travel on the gloo transport (torch.distributed over TCP between the nodes, its store on node 1)."""
    transport = ["hardware.transport=gloo"] if rule == "bsp" else []
    n1, n2 = cluster.names
    run = mpitrain(
        cluster,
        tmp_path / "run",
        f"rule={rule}",
        *overrides,
        *transport,
        "devices=2",
        "hardware=cluster",
        f"hardware.hosts=[{n1}:1,{n2}:2]",
        "train.epochs=1",
        YIELD,
        timeout=150,
    )
    assert run.returncode == 0, run.output
    s = run.summary
    hosts = hosts_of(run.dir)
    assert set(hosts.values()) == {n1, n2}, hosts
    if s["world_size"] > 2:  # the rule's server ranks are the last ones: on the node worker 0 is not on
        assert hosts[s["world_size"] - 1] != hosts[0], hosts
    # the epoch's 24 steps of the two workers (dealt unevenly under dynamic assignment: worker 0 may take 9)
    assert sum(s["steps_per_worker"]) >= 20 and s["bytes_sent"] > 0, s
    assert s["final_val_acc"] > 0.2, "above chance (0.1) after one epoch"
    if rule == "bsp":
        assert s["versions"]["transport"] == "gloo"
    if rule == "gosgd":
        assert abs(s["weight_sum"] - 1) < 1e-12


def test_dynamic_assignment_deals_each_sample_once_across_nodes_with_a_straggler(cluster, tmp_path):
    """GoSGD with dynamic assignment: its counter lives in a one-sided window (osc over TCP between the
    nodes); worker 1, on node 2, sleeps 30 ms a step. The model records every training batch: each chunk
    of each epoch is trained exactly once, and the fast worker, on node 1, takes more of them."""
    trace = tmp_path / "trace"
    trace.mkdir()
    n1, n2 = cluster.names
    run = mpitrain(
        cluster,
        tmp_path / "run",
        *TRACED,
        "rule=gosgd",
        "data.assignment=dynamic",
        "devices=2",
        "hardware=cluster",
        f"hardware.hosts=[{n1}:1,{n2}:1]",
        "train.epochs=2",
        "simulate.straggler_ranks=[1]",
        "simulate.straggler_ms=30",
        f"+hardware.env={{MPITRAIN_TRACE: '{trace}'}}",  # the remote node's ranks get no launcher env
        YIELD,
        timeout=150,
    )
    assert run.returncode == 0, run.output
    assert hosts_of(run.dir) == {0: n1, 1: n2}
    from tests.rank.test_assignment import traced_batches

    chunks = Chunks(300, 10, 1, seed=0)
    trained = traced_batches(trace, chunks, 2)
    dealt = sorted(t for ts in trained.values() for t in ts)
    assert dealt == list(range(2 * chunks.per_epoch)), "a chunk was lost or trained twice"
    assert len(trained[0]) > len(trained[1]), {r: len(t) for r, t in trained.items()}
