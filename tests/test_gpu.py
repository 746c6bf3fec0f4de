"""hardware=gpu end to end: each rank on its planned GPU, every rule training there (skipped without CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [
    pytest.mark.slow,
    pytest.mark.mpi,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_each_rank_trains_on_its_planned_gpu(cli):
    ranks = min(GPUS, 4)
    run = cli(
        "hardware=gpu", f"devices={ranks}", "train.epochs=3", "hardware.oversubscribe=true", timeout=300
    )
    assert run.returncode == 0, run.output
    plan = json.loads((run.dir / "plan.json").read_text())
    report = json.loads((run.dir / "bindings.json").read_text())
    assert [b["gpu"] for b in report["ranks"]] == [p["gpu"] for p in plan]
    assert len({p["gpu"] for p in plan}) == ranks, "one GPU per rank"
    assert report["problems"] == [], report["problems"]
    assert run.summary["final_val_acc"] > 0.95


@pytest.mark.parametrize("rule", ["bsp", "easgd", "gosgd", "asgd"])
def test_every_rule_trains_on_gpus_shared_by_two_ranks(cli, rule):
    run = cli(
        "hardware=gpu",
        f"rule={rule}",
        "devices=2",
        "hardware.gpus_per_node=1",
        "hardware.ranks_per_gpu=3",  # asgd adds a server rank
        "hardware.cuda_aware=false",
        "train.epochs=3",
        timeout=300,
    )
    assert run.returncode == 0, run.output
    report = json.loads((run.dir / "bindings.json").read_text())
    assert {b["gpu"] for b in report["ranks"] if b["gpu"] is not None} == {0}
    assert run.summary["versions"]["cuda_aware_mpi"] is False
    assert run.summary["final_val_acc"] > 0.9, run.summary
