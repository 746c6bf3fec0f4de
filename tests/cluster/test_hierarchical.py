"""The hierarchical exchange (``hardware.hierarchical``, runner/comm/routes/hierarchical.py) across two nodes
of two ranks each: BSP trains the same model as with Open MPI's flat ring, and each node's link carries
the gradients once each way instead of the ring's one and a half (the nodes' veth counters)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from runner.run_folder import MODEL
from tests.cluster.conftest import mpitrain

pytestmark = pytest.mark.cluster

TX = "/sys/class/net/eth0/statistics/tx_bytes"
#: Open MPI's flat ring (han, its default across nodes, is hierarchical itself): the exchange compared.
RING = [
    "+hardware.mca.coll='^han'",
    "+hardware.mca.coll_tuned_use_dynamic_rules=1",
    "+hardware.mca.coll_tuned_allreduce_algorithm=4",
]
#: 4 ranks on the machine's 2 cores: waiting ranks yield; a model whose gradients (4.5 MB a step) dwarf the
#: job's other traffic across the link.
JOB = [
    "devices=4",
    "hardware.bind=none",
    "+hardware.mca.mpi_yield_when_idle=1",
    "rule=bsp",
    "model=mlp",
    "model.hidden=[1024,1024]",
    "train.max_steps=6",
    "optim.lr=0.05",
]


def sent(cluster) -> int:  # noqa: ANN001
    """The bytes both nodes' links have sent so far."""
    return sum(int(cluster.run(i, ["cat", TX], check=True).stdout) for i in (0, 1))


def test_bsp_hierarchical_equals_the_flat_ring_and_crosses_the_link_once(cluster, tmp_path: Path):
    runs, crossed = {}, {}
    for mode in ("off", "on"):
        before = sent(cluster)
        run = mpitrain(cluster, tmp_path / mode, *JOB, *RING, f"hardware.hierarchical={mode}", timeout=120)
        crossed[mode] = sent(cluster) - before
        assert run.returncode == 0, run.output
        assert run.summary["versions"]["hierarchical"] == mode
        runs[mode] = run
    assert "hierarchical exchange: 2 hosts x 2 ranks" in runs["on"].output
    ours = torch.load(runs["on"].dir / MODEL, weights_only=True)
    flat = torch.load(runs["off"].dir / MODEL, weights_only=True)
    ours, flat = ours.get("model", ours), flat.get("model", flat)
    for name, value in flat.items():
        assert torch.allclose(ours[name].double(), value.double(), rtol=1e-6, atol=1e-6), name
    # a ring over 2 nodes of 2 carries 1.5 buffers each way per all-reduce, the hierarchical exchange 1
    print(f"bytes across the links: {crossed}")
    assert crossed["on"] < 0.8 * crossed["off"], crossed
