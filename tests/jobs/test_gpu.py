"""hardware=gpu end to end: each rank on its planned GPU, every rule training there (skipped without CUDA)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.rules import needs, rules

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


@pytest.mark.parametrize("rule", rules())
def test_every_rule_trains_on_gpus_shared_by_two_ranks(cli, rule):
    run = cli(
        "hardware=gpu",
        f"rule={rule}",
        *needs(rule),
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


@pytest.mark.parametrize(
    "precision,extra",
    [("bf16", []), ("fp16", []), ("fp16", ["train.accumulate=2", "train.grad_clip=1.0", "train.epochs=5"])],
)
def test_mixed_precision_trains_on_the_gpu_and_its_saved_model_evaluates_alike(cli, precision, extra):
    """fp16 goes through the gradient scaler (with accumulation and clipping: unscaled once, after BSP's
    all-reduce of the last micro-batch); ``eval=RUN_DIR`` on the saved model gives the run's last metrics."""
    import subprocess
    import sys

    run = cli(
        "hardware=gpu",
        "devices=2",
        "hardware.gpus_per_node=1",
        "hardware.ranks_per_gpu=2",
        f"train.precision={precision}",
        "train.epochs=3",
        *extra,
        timeout=300,
    )
    assert run.returncode == 0, run.output
    s = run.summary
    assert s["final_val_acc"] >= 0.95, s
    if precision == "fp16":
        assert 0 <= s["fp16_overflow_steps"] <= s["steps"] // 5, s["fp16_overflow_steps"]
    done = subprocess.run(
        [sys.executable, "-m", "runner", f"eval={run.dir}"], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((run.dir / "eval.json").read_text())
    assert record["device"].startswith("cuda")
    assert record["val_acc"] == pytest.approx(s["final_val_acc"], abs=3e-3)


# -- the NCCL transport (hardware.transport; tests/comm/test_transport.py runs the same code on gloo) --------


def _nccl() -> str:
    from runner.comm.dist import nccl_version

    return nccl_version() or "none"


@pytest.mark.parametrize("rule", rules())
def test_every_rule_runs_on_the_nccl_transport_with_one_worker(cli, rule):
    """World size 1 on NCCL: the bootstrap from MPI (store on rank 0, port broadcast), the group, its
    stream and BSP's overlap. A rule with a server rank shares the GPU with it (the server is no worker)."""
    run = cli(
        "hardware=gpu",
        f"rule={rule}",
        *needs(rule),
        "devices=1",
        "hardware.gpus_per_node=1",
        "hardware.ranks_per_gpu=2",
        "hardware.transport=nccl",
        "train.epochs=2",
        *(["rule.p=0"] if rule == "gosgd" else []),  # gossip needs a peer: one worker keeps its own model
        timeout=300,
    )
    assert run.returncode == 0, run.output
    assert run.summary["versions"]["transport"] == "nccl", f"NCCL {_nccl()}"
    assert run.summary["final_val_acc"] > 0.8, run.summary


def test_the_transport_job_on_nccl_equals_mpi_with_one_rank():
    """tests/helpers/transport_job.py on the GPU: every collective of the NCCL group against staged MPI."""
    import subprocess
    import sys

    from tests.conftest import ROOT, mpirun_argv

    job = ROOT / "tests" / "helpers" / "transport_job.py"
    proc = subprocess.run(
        mpirun_argv(1, sys.executable, "-m", "mpi4py", str(job), "nccl"),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "transport checks passed on 1 ranks (nccl)" in proc.stdout


def test_two_workers_on_one_gpu_on_nccl_where_the_nccl_allows_it(cli):
    """NCCL 2.30 and later take several ranks on one GPU with NCCL_MULTI_RANK_GPU_ENABLE=1; older ones
    refuse them ("Duplicate GPU detected"), so ``auto`` stays on MPI and says why."""
    from runner.rank.placement import SHARE_GPUS, nccl_shares_gpus

    version = _nccl()
    shared = ["hardware=gpu", "devices=2", "hardware.gpus_per_node=1", "hardware.ranks_per_gpu=2"]
    if version == "none" or not nccl_shares_gpus(version):
        run = cli(*shared, "train.epochs=1", timeout=300)
        assert run.returncode == 0, run.output
        assert run.summary["versions"]["transport"] == "mpi"
        assert "transport: mpi, staged through host memory, since workers share a GPU" in run.output
        pytest.skip(f"NCCL {version} takes one rank per GPU (2.30 or later with {SHARE_GPUS}=1 is needed)")
    run = cli(
        *shared, "hardware.transport=nccl", f"+hardware.env.{SHARE_GPUS}=1", "train.epochs=2", timeout=300
    )
    assert run.returncode == 0, run.output
    assert run.summary["versions"]["transport"] == "nccl"
    assert run.summary["final_val_acc"] > 0.9, run.summary
