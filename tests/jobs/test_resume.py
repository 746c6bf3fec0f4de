"""Runs that survive, end to end: preempted (SIGTERM) and resumed runs end bit-identical to uninterrupted
ones, a killed launcher's run resumes with each step recorded once, divergence ends the job cleanly."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT, Run, cli_argv, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.mpi]

COMMON = ("train.epochs=3", "checkpoint.every=15", "train.log_every=5", "hardware.bind=none")


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        cli_argv(run_dir, *overrides),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_checkpoint(run_dir: Path, proc: subprocess.Popen, timeout: float = 120) -> None:
    index = run_dir / "checkpoints" / "checkpoint.json"
    deadline = time.time() + timeout
    while not index.exists():
        assert proc.poll() is None, f"the job ended before its first checkpoint:\n{proc.stdout.read()}"
        assert time.time() < deadline, "no checkpoint was written"
        time.sleep(0.05)


def interrupted(run_dir: Path, sig: int, *overrides: str) -> tuple[int, str]:
    """Start a run; send ``sig`` to the launcher once a checkpoint exists; its exit status and output."""
    proc = start(run_dir, *overrides)
    wait_for_checkpoint(run_dir, proc)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=180)
    return proc.returncode, out


def models_equal(a: Path, b: Path) -> list[str]:
    """The keys whose tensors differ (bit for bit) between two saved models."""
    x, y = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert x.keys() == y.keys()
    return [k for k in x if not torch.equal(x[k], y[k])]


def same_records(a: Run, b: Run) -> None:
    """Every step, epoch and validation record once, and equal to the uninterrupted run's but for times."""

    def strip(r: dict) -> dict:
        return {k: v for k, v in r.items() if k != "time" and not k.endswith(("_frac", "_s", "_ms"))}

    for kind in ("step", "val", "epoch"):
        ra, rb = a.records(kind), b.records(kind)
        assert [r["step"] for r in rb] == [r["step"] for r in ra], kind
        if kind != "epoch":
            assert [strip(r) for r in rb] == [strip(r) for r in ra], kind


def test_preempted_and_resumed_run_equals_the_uninterrupted_one(tmp_path):
    """2 ranks, momentum, BatchNorm (the CNN): SIGTERM after a checkpoint, then resume=, bit for bit. (BSP;
    every deterministic rule's state resumes exactly in tests/rank/test_checkpoint.py, in-process.)"""
    args = (*COMMON, "devices=2", "rule=bsp")
    whole = run_cli(tmp_path / "whole", *args, timeout=240)
    assert whole.returncode == 0, whole.output
    status, out = interrupted(tmp_path / "cut", signal.SIGTERM, *args)
    cut = Run(subprocess.CompletedProcess([], status, out, ""), tmp_path / "cut")
    assert status == 5, out
    preempted = cut.summary
    assert preempted["status"] == "preempted" and preempted["steps"] < whole.summary["steps"]
    again = run_cli(tmp_path / "again", f"resume={tmp_path / 'cut'}", timeout=240)
    assert again.returncode == 0, again.output
    resumed = Run(again.proc, tmp_path / "cut")
    assert resumed.summary["status"] == "ok"
    assert resumed.summary["resumed_from_step"] == preempted["steps"]
    assert models_equal(whole.dir / "model.pt", resumed.dir / "model.pt") == []
    same_records(whole, resumed)


def test_gosgd_resumes_with_its_seeded_pushes_and_weights_summing_to_one(tmp_path):
    """Gossip merges arrive in an order MPI does not fix, so the model may differ in its last bits; the
    seeded push decisions do not (with static shards: under dynamic assignment each worker's step count,
    and so its pushes, depends on the machine's speed), and the weights still sum to 1."""
    args = (*COMMON, "devices=2", "rule=gosgd", "rule.p=0.3", "data.assignment=static")  # steps as seeded
    whole = run_cli(tmp_path / "whole", *args, timeout=240)
    assert whole.returncode == 0, whole.output
    status, out = interrupted(tmp_path / "cut", signal.SIGTERM, *args)
    assert status == 5, out
    again = run_cli(tmp_path / "again", f"resume={tmp_path / 'cut'}", timeout=240)
    assert again.returncode == 0, again.output
    s = Run(again.proc, tmp_path / "cut").summary
    assert s["pushes"] == whole.summary["pushes"] and s["weight_sum"] == pytest.approx(1.0, abs=1e-9)
    assert s["final_val_acc"] > 0.9


def test_launcher_killed_then_resumed_asgd_one_worker_matches_and_records_each_step_once(tmp_path):
    """kill -9 of the launcher takes the job down with it (PR_SET_PDEATHSIG); resume= finishes the run,
    which with one worker is deterministic: the same model as uninterrupted."""
    args = (*COMMON, "devices=1", "rule=asgd", "rule.n_fetch=2")
    whole = run_cli(tmp_path / "whole", *args, timeout=240)
    assert whole.returncode == 0, whole.output
    status, _ = interrupted(tmp_path / "cut", signal.SIGKILL, *args)
    assert status == -signal.SIGKILL
    time.sleep(1)
    again = run_cli(tmp_path / "again", f"resume={tmp_path / 'cut'}", timeout=240)
    assert again.returncode == 0, again.output
    resumed = Run(again.proc, tmp_path / "cut")
    assert models_equal(whole.dir / "model.pt", resumed.dir / "model.pt") == []
    same_records(whole, resumed)


def test_async_easgd_is_preempted_resumes_and_finishes(tmp_path):
    args = (*COMMON, "devices=2", "hardware.oversubscribe=true", "rule=easgd", "rule.variant=async")
    status, out = interrupted(tmp_path / "cut", signal.SIGUSR1, *args)
    assert status == 5, out
    again = run_cli(tmp_path / "again", f"resume={tmp_path / 'cut'}", "train.epochs=4", timeout=240)
    assert again.returncode == 0, again.output
    s = Run(again.proc, tmp_path / "cut").summary
    assert s["status"] == "ok" and s["epochs"] == 4 and s["final_val_acc"] > 0.9
    # the run is finished: resuming it again (its length as it was, or as given again) does nothing
    before = files(tmp_path / "cut")
    for extra in ((), ("train.epochs=4",)):
        done = run_cli(tmp_path / "done", f"resume={tmp_path / 'cut'}", *extra, timeout=120)
        assert done.returncode == 0, done.output
        assert "the run finished" in done.output and "train.epochs=N (now 4)" in done.output, done.output
        assert "run folder:" not in done.output, done.output  # no job was started
        assert files(tmp_path / "cut") == before


def files(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file of a run folder but its lock, with its size and modification time."""
    return {
        str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in run_dir.rglob("*")
        if p.is_file() and p.name != "job.lock"
    }


def test_resume_refuses_a_change_that_the_checkpoint_cannot_take_and_passes_over_a_damaged_one(tmp_path):
    """And with its newest checkpoint truncated and its index torn, resume= names both, rebuilds the index
    and goes on from the checkpoint before, each record once."""
    run = run_cli(tmp_path / "a", "train.epochs=1", "model=mlp", "checkpoint.every=5", "checkpoint.keep=10")
    assert run.returncode == 0, run.output
    refused = run_cli(tmp_path / "b", f"resume={tmp_path / 'a'}", "optim.lr=0.5")
    assert refused.returncode == 2
    assert "optim.lr: cannot change when resuming" in refused.output
    index = run.dir / "checkpoints" / "checkpoint.json"
    *_, before, newest = json.loads(index.read_text())["checkpoints"]
    damaged = run.dir / "checkpoints" / newest["dir"] / "rank0.pt"
    size = damaged.stat().st_size
    damaged.write_bytes(damaged.read_bytes()[: size // 2])
    index.write_text('{"checkpoints": [')
    longer = run_cli(tmp_path / "c", f"resume={tmp_path / 'a'}", "train.epochs=2")
    assert longer.returncode == 0, longer.output
    assert "checkpoints/checkpoint.json is damaged (not JSON: " in longer.output
    truncated = f"(truncated: {size // 2} of {size} bytes): resuming from {before['dir']}"
    assert f"checkpoint checkpoints/{newest['dir']}/rank0.pt is damaged {truncated}" in longer.output
    resumed = Run(longer.proc, tmp_path / "a")
    assert resumed.summary["resumed_from_step"] == before["step"]
    assert [r["epoch"] for r in resumed.records("val")] == [0, 1]
    steps = [r["step"] for r in resumed.records("step")]
    assert steps == sorted(set(steps)) and steps[0] < before["step"], "each step once, from the start"


def test_divergence_stops_at_the_step_and_keeps_the_last_good_checkpoint(tmp_path):
    run = run_cli(tmp_path / "nan", "optim.lr=1000", "train.epochs=3", "checkpoint.every=2")
    assert run.returncode == 3, run.output
    s = run.summary
    assert s["status"] == "diverged" and "non-finite" in s["error"] and re.search(r"step \d+", s["error"])
    json.loads((run.dir / "summary.json").read_text(), parse_constant=pytest.fail)
    for line in (run.dir / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=pytest.fail)
    index = json.loads((run.dir / "checkpoints/checkpoint.json").read_text())["checkpoints"]
    step = int(re.search(r"step (\d+)", s["error"]).group(1))
    assert index and index[-1]["step"] < step
    assert f"its last good checkpoint (after step {index[-1]['step']}) is kept" in s["error"], s["error"]
    part = torch.load(run.dir / "checkpoints" / index[-1]["dir"] / "rank0.pt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in part["model"].values() if v.is_floating_point())


def test_skip_drops_a_non_finite_step_on_every_rank_and_trains_on(tmp_path):
    """Rank 1's output is NaN at its 5th step: under BSP every rank drops that step (rank 0 too, which
    saw a finite loss: the NaN came to it in the mean gradient) and the run trains on."""
    searchpath = f"hydra.searchpath=[file://{ROOT / 'tests' / 'conf'}]"
    run = run_cli(
        tmp_path / "skip", searchpath, "model=nan_once", "train.epochs=3", "train.on_nonfinite=skip"
    )
    assert run.returncode == 0, run.output
    assert run.summary["skipped_steps"] == 1 and run.summary["final_val_acc"] > 0.9
    assert "step 5: non-finite" in run.output
    stopped = run_cli(tmp_path / "stop", searchpath, "model=nan_once", "train.epochs=3")
    assert stopped.returncode == 3 and stopped.summary["status"] == "diverged"
    assert "at step 5 on rank" in stopped.summary["error"]
    assert "no checkpoint was written before it" in stopped.summary["error"], "none was: none is kept"


def test_a_run_ended_by_max_steps_within_an_epoch_resumes_longer_from_there(tmp_path):
    """train.max_steps=10 of a 45-step epoch, then resume= with train.max_steps=30: epoch 0 goes on from
    batch 10, not skipped (its final checkpoint was named epoch 1, batch 0), and the model is the one a run
    of 30 steps makes, bit for bit (one rank: no BatchNorm statistics averaged at the extra epoch end)."""
    args = ("devices=1", "train.log_every=5", "hardware.bind=none")
    whole = run_cli(tmp_path / "whole", *args, "train.max_steps=30", timeout=240)
    assert whole.returncode == 0, whole.output
    cut = run_cli(tmp_path / "cut", *args, "train.max_steps=10", timeout=240)
    assert "checkpoint after step 10 (epoch 0, batch 10)" in cut.output, cut.output
    assert "epoch 0 (22%): val_loss" in cut.output, "its validation says the epoch was cut"
    again = run_cli(tmp_path / "again", f"resume={tmp_path / 'cut'}", "train.max_steps=30", timeout=240)
    assert again.returncode == 0, again.output
    resumed = Run(again.proc, tmp_path / "cut")
    assert models_equal(whole.dir / "model.pt", resumed.dir / "model.pt") == []
    vals = [(r["epoch"], r["step"]) for r in resumed.records("val")]
    assert vals == [(0, 10), (0, 30)], vals  # the cut's end, then the run's (an epoch is 45 steps on 1 rank)
    assert resumed.records("val")[-1]["val_acc"] == whole.records("val")[-1]["val_acc"]
