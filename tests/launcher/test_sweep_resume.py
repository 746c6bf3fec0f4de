"""Sweeps that resume point by point (``resume=SWEEP_DIR``), their manifest (``sweep.json``) and
``sweep.fail_fast``: the decision per point state here, in-process; the Done-when scenario of issue 38 (a
4-point sweep killed after 2 points, then resumed) with real jobs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from runner.launcher import outcomes, sweep_resume
from runner.launcher.sweep_resume import (
    ATTEMPTS,
    MANIFEST,
    batches,
    changed_overrides,
    decide,
    end_point,
    failed_point,
    plan,
    point_state,
    read_manifest,
    resumed_argv,
    start_point,
)
from runner.launcher.sweeper import MpitrainSweeper, zipped_grid
from runner.run_folder import CHECKPOINT_INDEX, CHECKPOINTS, CONFIG, IDENTITY, SUMMARY, SWEEP_CONFIG
from tests.conftest import ROOT, checked_config


def make_point(
    folder: Path, status: str | None = None, checkpoint: bool = False, stale: bool = False
) -> Path:
    """A sweep point's folder: its config, a summary of ``status`` (``stale``: older than the config, an
    earlier job's; ``lost``: the Slurm launcher's for a job Slurm ended; ``stopped``: a job that failed
    after its launcher was told to stop), and an indexed checkpoint."""
    folder.mkdir(parents=True)
    summary = {"status": status}
    if status == "lost":
        summary = {"status": "failed", "slurm_job": "8_2"}
    elif status == "stopped":  # its launcher got SIGTERM (scancel: mpirun too), then mpirun exited 1
        summary = {"status": "failed", "signal": "SIGTERM"}
    if status is not None and stale:
        (folder / SUMMARY).write_text(json.dumps(summary))
        os.utime(folder / SUMMARY, (1, 1))
    (folder / CONFIG).write_text("devices: 1\n")
    if status is not None and not stale:
        (folder / SUMMARY).write_text(json.dumps(summary))
    if checkpoint:
        (folder / CHECKPOINTS).mkdir()
        entry = {
            "step": 5,
            "seq": 1,
            "dir": "00001-step5",
            "world_size": 1,
            "parts": [{"bytes": 1, "crc32": 0}],
        }
        (folder / CHECKPOINTS / CHECKPOINT_INDEX).write_text(json.dumps({"checkpoints": [entry]}))
    return folder


@pytest.mark.parametrize(
    ("status", "checkpoint", "stale", "state", "retry", "decision"),
    [
        ("ok", False, False, "ok", True, "keep"),
        ("ok", True, True, "running", True, "resume"),  # a later job, killed, after an ok one
        (None, True, False, "running", False, "resume"),  # its launcher killed
        (None, False, False, "running", True, "run"),  # killed before its first checkpoint
        ("preempted", True, False, "preempted", False, "resume"),
        ("interrupted", False, False, "preempted", True, "run"),
        ("diverged", True, False, "failed", True, "run"),
        ("failed", False, False, "failed", False, "skip"),
        ("lost", True, False, "preempted", False, "resume"),  # Slurm ended its job (time limit, ...)
        ("stopped", True, False, "preempted", False, "resume"),  # scancel'd: cut off, not failed
        ("stopped", False, False, "preempted", False, "run"),
        ("invalid", False, False, "invalid", True, "run"),
        ("invalid", False, False, "invalid", False, "skip"),
    ],
)
def test_each_point_state_has_its_decision(tmp_path, status, checkpoint, stale, state, retry, decision):
    point = make_point(tmp_path / "0", status, checkpoint, stale)
    recorded = (
        None if stale or status is None else {"lost": "failed", "stopped": "failed"}.get(status, status)
    )
    assert point_state(point) == (state, recorded, checkpoint)
    assert decide(state, checkpoint, retry) == decision


def test_a_point_never_started_is_pending_and_run(tmp_path):
    (tmp_path / "3" / ".hydra").mkdir(parents=True)  # Hydra made its folder, no job wrote a config
    assert point_state(tmp_path / "3") == ("pending", None, False)
    assert point_state(tmp_path / "4") == ("pending", None, False)
    assert decide("pending", False, retry=False) == "run"


def test_points_that_end_at_once_all_reach_the_manifest(tmp_path):
    def point(num: int) -> None:
        ident = {"overrides": [f"optim.lr={num}"], "name": f"optim.lr={num}"}
        assert start_point(tmp_path, num, ident)
        end_point(tmp_path, num, "ok" if num % 2 else "diverged")

    threads = [threading.Thread(target=point, args=(n,)) for n in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    points = read_manifest(tmp_path)
    assert list(points) == [str(n) for n in range(12)]
    assert [p["state"] for p in points.values()] == ["failed", "ok"] * 6
    assert points["4"] | {"time": 0} == {
        "dir": "4",
        "overrides": ["optim.lr=4"],
        "name": "optim.lr=4",
        "state": "failed",
        "status": "diverged",
        "time": 0,
    }


def test_fail_fast_starts_no_point_after_one_not_ok(tmp_path, monkeypatch):
    monkeypatch.setattr(outcomes, "NOT_OK", [])
    ident = {"overrides": [], "name": "optim.lr=1"}
    assert start_point(tmp_path, 0, ident, fail_fast=True)
    end_point(tmp_path, 0, "stalled")
    assert failed_point(tmp_path, 0) is None  # itself
    assert failed_point(tmp_path, 1) == "point 0 (optim.lr=1) stalled"
    assert not start_point(tmp_path, 1, {"overrides": [], "name": "b"}, fail_fast=True)
    assert read_manifest(tmp_path)["1"]["state"] == "pending"
    assert start_point(tmp_path, 2, {"overrides": [], "name": "c"})  # without fail_fast: as before


def test_resuming_plans_each_point_and_sets_failed_attempts_aside(tmp_path, monkeypatch):
    monkeypatch.setattr(outcomes, "NOT_OK", [])
    make_point(tmp_path / "0", "ok")
    make_point(tmp_path / "1", "failed")
    make_point(tmp_path / "2", None, checkpoint=True)
    sweep = ["optim.lr=1,2,3,4,5"]
    grid = [[f"optim.lr={v}"] for v in range(1, 6)]
    jobs = plan(tmp_path, grid, sweep, retry=True)
    assert jobs == [
        (1, ["optim.lr=2"]),
        (2, ["optim.lr=3", f"resume='{tmp_path / '2'}'"]),
        (3, ["optim.lr=4"]),
        (4, ["optim.lr=5"]),
    ]
    assert not (tmp_path / "1").exists() and (tmp_path / ATTEMPTS / "1.1" / SUMMARY).is_file()
    states = {n: p["state"] for n, p in read_manifest(tmp_path).items()}
    assert states == {"0": "ok", "1": "pending", "2": "running", "3": "pending", "4": "pending"}
    assert batches(jobs, None) == [(1, [j for _, j in jobs])]
    assert batches(jobs[:1] + jobs[2:], 1) == [(1, [jobs[0][1]]), (3, [jobs[2][1]]), (4, [jobs[3][1]])]

    make_point(tmp_path / "1", "diverged")
    assert plan(tmp_path, grid[:2], sweep, retry=False) == []  # kept as it failed: counts as not ok
    assert outcomes.NOT_OK == [("optim.lr=2", "diverged", 3)]


def test_resume_of_a_sweep_folder_is_its_own_command_line(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    recorded = {
        "hydra": {
            "sweeper": {"_target_": "hydra._internal.core_plugins.basic_sweeper.BasicSweeper"},
            "sweep": {"dir": "old", "subdir": "${hydra.job.num}"},
            "overrides": {
                "hydra": ["hydra.sweep.dir=old", "hydra.mode=MULTIRUN", "hydra/launcher=joblib"],
                "task": ["optim.lr=0.1,0.2", "train.max_steps=9", "train.progress=false"],
            },
        }
    }
    OmegaConf.save(OmegaConf.create(recorded), sweep / SWEEP_CONFIG)
    argv = resumed_argv([f"resume={sweep}", "train.max_steps=20", "sweep.retry=false"])
    assert argv == [
        "-m",
        "hydra/launcher=joblib",
        "optim.lr=0.1,0.2",
        "train.progress=false",
        "train.max_steps=20",
        "sweep.retry=false",
        f"hydra.sweep.dir={sweep}",
        "hydra.sweeper.resume=true",
    ]
    assert resumed_argv(["train.max_steps=20"]) is None
    with pytest.raises(ValueError, match="optim.momentum: cannot change when resuming the sweep"):
        resumed_argv([f"resume={sweep}", "optim.momentum=0.5"])
    recorded["hydra"]["overrides"]["task"].append("simulate.link_gbps=0.1,null")  # a key resumed runs may
    OmegaConf.save(OmegaConf.create(recorded), sweep / SWEEP_CONFIG)  # change, but this sweep varies it
    for varied in ("simulate.link_gbps=1", "optim.lr=0.3"):  # (the new point was kept as the old one)
        with pytest.raises(ValueError, match=f"{varied.split('=')[0]}: .* the sweep varies it"):
            resumed_argv([f"resume={sweep}", varied])
    assert "simulate.ranks_per_node=1" in resumed_argv([f"resume={sweep}", "simulate.ranks_per_node=1"])
    (tmp_path / "run").mkdir()
    assert resumed_argv([f"resume={tmp_path / 'run'}"]) is None  # a run's folder: resumed as before
    recorded["hydra"]["sweeper"]["_target_"] = (
        "hydra_plugins.hydra_optuna_sweeper.optuna_sweeper.OptunaSweeper"
    )
    OmegaConf.save(OmegaConf.create(recorded), sweep / SWEEP_CONFIG)
    with pytest.raises(ValueError, match="only a grid sweep"):
        resumed_argv([f"resume={sweep}"])
    recorded["hydra"]["sweeper"]["_target_"] = "hydra_plugins.mpitrain.MpitrainSweeper"
    recorded["hydra"]["sweep"]["subdir"] = "${hydra.job.override_dirname}"
    OmegaConf.save(OmegaConf.create(recorded), sweep / SWEEP_CONFIG)
    with pytest.raises(ValueError, match=r"named hydra.sweep.subdir=\$\{hydra.job.override_dirname\}"):
        resumed_argv([f"resume={sweep}"])


def test_a_resumed_point_changes_only_what_it_was_not_started_with(tmp_path):
    (tmp_path / IDENTITY).write_text(json.dumps({"overrides": ["optim.lr=0.1", "model=mlp"]}))
    given = ["optim.lr=0.1", "model=mlp", "resume='x'", "sweep.retry=false", "train.max_steps=50"]
    assert changed_overrides(tmp_path, given) == ["resume='x'", "train.max_steps=50"]


def test_the_sweep_section_has_defaults_and_checks():
    cfg = checked_config(["sweep.fail_fast=true"])
    assert (cfg.sweep.fail_fast, cfg.sweep.retry, cfg.sweep.zip) == (True, True, [])
    with pytest.raises(Exception, match="sweep.retry"):
        checked_config(["sweep.retry=maybe"])
    with pytest.raises(ValueError, match=r"sweep.zip.*two or more different keys"):
        checked_config(["sweep.zip=[optim.lr]"])


def parsed(args: list[str]) -> list:
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return OverridesParser.create().parse_overrides(args)


def test_zipped_keys_vary_together_and_cross_the_others():
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    plain = ["rule=bsp,easgd", "optim.lr=0.1,0.2", "model=mlp", "schedule.warmup_steps=10,20"]
    assert zipped_grid(parsed(plain), []) == BasicSweeper.split_arguments(parsed(plain), None)[0]  # 8 points
    grid = zipped_grid(parsed(plain), ["optim.lr", "schedule.warmup_steps"])
    assert grid == [
        ["rule=bsp", "optim.lr=0.1", "schedule.warmup_steps=10", "model=mlp"],
        ["rule=bsp", "optim.lr=0.2", "schedule.warmup_steps=20", "model=mlp"],
        ["rule=easgd", "optim.lr=0.1", "schedule.warmup_steps=10", "model=mlp"],
        ["rule=easgd", "optim.lr=0.2", "schedule.warmup_steps=20", "model=mlp"],
    ]
    with pytest.raises(ValueError, match=r"as many values each \(optim.lr: 2, schedule.warmup_steps: 3\)"):
        zipped_grid(
            parsed(["optim.lr=0.1,0.2", "schedule.warmup_steps=1,2,3"]), ["optim.lr", "schedule.warmup_steps"]
        )
    with pytest.raises(ValueError, match="sweep.zip names model, which this sweep does not vary"):
        zipped_grid(parsed(plain), ["optim.lr", "model"])


def cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "runner", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=240, **kwargs)


@pytest.mark.slow
def test_fail_fast_stops_a_sweep_at_its_first_point_not_ok(tmp_path):
    """Point 0 is invalid (no such mpirun, refused as it starts): point 1 is not started. (A bad value is
    refused before any point starts: the sweep's own check.)"""
    mpirun = "hardware.mpirun=/nonexistent/mpirun,null"
    run = cli("-m", f"hydra.sweep.dir={tmp_path}", mpirun, "sweep.fail_fast=true", "train.max_steps=1")
    assert run.returncode == 2, run.stdout + run.stderr
    said = "[hardware.mpirun=null] not started: sweep.fail_fast, and point 0 (hardware.mpirun=/nonexistent/"
    assert f"{said}mpirun) invalid" in run.stdout + run.stderr
    assert not (tmp_path / "1" / CONFIG).exists()
    assert {n: p["state"] for n, p in read_manifest(tmp_path).items()} == {"0": "invalid", "1": "pending"}


def files(folder: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every file under ``folder``: its size, modification time (ns) and content."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.mpi
def test_a_sweep_killed_after_two_points_resumes_to_four(tmp_path):
    """Issue 38's Done-when: a 4-point sweep killed during its third point, then ``resume=``d: 4 ok
    points, the 2 finished ones untouched, the third resumed from its checkpoint, one report over all."""
    sweep = tmp_path / "sweep"
    grid = ["optim.lr=0.01,0.02,0.03,0.04", "train.epochs=1", "train.max_steps=40", "model=mlp", "devices=1"]
    slow = [
        "checkpoint.every=5",
        "train.log_every=5",
        "simulate.straggler_ranks=[0]",
        "simulate.straggler_ms=50",
    ]
    argv = [
        sys.executable,
        "-m",
        "runner",
        "-m",
        f"hydra.sweep.dir={sweep}",
        "train.progress=false",
        *grid,
        *slow,
    ]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        index = sweep / "2" / CHECKPOINTS / CHECKPOINT_INDEX
        deadline = time.monotonic() + 120
        while not (index.is_file() and "step10" in index.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, "point 2 wrote no checkpoint"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the sweep's launcher: its jobs' mpirun goes with it
        proc.wait()
    time.sleep(1)  # the job's ranks end (mpirun had SIGTERM when its launcher died)
    assert point_state(sweep / "2")[0] == "running" and not (sweep / "3" / CONFIG).exists()
    finished = {p: files(sweep / p) for p in ("0", "1")}
    cut = json.loads(index.read_text())["checkpoints"][-1]  # the newest: what the point resumes from
    before = (sweep / "2" / "metrics.jsonl").read_text().splitlines()[: cut["metrics_lines"]]

    run = cli(f"resume={sweep}", "train.progress=false")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "point 0 ok: kept as it is" in out and "point 2 running: resumed from its checkpoint" in out
    assert {p: files(sweep / p) for p in ("0", "1")} == finished  # same files: sizes, times, contents
    for point in ("0", "1", "2", "3"):
        assert json.loads((sweep / point / SUMMARY).read_text())["status"] == "ok", point
    lines = (sweep / "2" / "metrics.jsonl").read_text().splitlines()
    assert lines[: len(before)] == before  # the first job's records up to its checkpoint, kept
    steps = [r["step"] for r in map(json.loads, lines) if r["kind"] == "step"]
    after = [r["step"] for r in map(json.loads, lines[len(before) :]) if r["kind"] == "step"]
    assert after and after[0] == cut["step"] + 5 and steps == sorted(set(steps)) and steps[-1] == 40
    assert {n: p["state"] for n, p in read_manifest(sweep).items()} == dict.fromkeys("0123", "ok")
    report = (sweep / "report.csv").read_text().splitlines()
    assert len(report) == 1 + 4, report
    assert MANIFEST in os.listdir(sweep) and sweep_resume.is_sweep_folder(sweep)


@pytest.mark.slow
@pytest.mark.mpi
def test_a_joblib_sweep_resumes_its_points_in_parallel(tmp_path):
    """Points run by Hydra's joblib launcher (2 at a time, in other processes): a point cut off after its
    first checkpoint resumes from it, a failed one runs again, an ok one is kept."""
    pytest.importorskip(
        "hydra_plugins.hydra_joblib_launcher", reason="hydra-joblib-launcher is not installed"
    )
    sweep = tmp_path / "sweep"
    grid = [
        "optim.lr=0.01,0.02,0.03",
        "train.epochs=1",
        "train.max_steps=10",
        "checkpoint.every=5",
        "checkpoint.keep=5",
    ]
    joblib = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "model=mlp", "devices=1"]
    run = cli("-m", f"hydra.sweep.dir={sweep}", "train.progress=false", *joblib, *grid)
    assert run.returncode == 0, run.stdout + run.stderr
    kept = files(sweep / "0")
    (sweep / "1" / SUMMARY).unlink()  # its launcher killed after the checkpoint of step 5
    index = sweep / "1" / CHECKPOINTS / CHECKPOINT_INDEX
    first = json.loads(index.read_text())["checkpoints"][0]
    assert first["step"] == 5
    index.write_text(json.dumps({"checkpoints": [first]}))
    (sweep / "2" / SUMMARY).write_text(json.dumps({"status": "stalled", "exit_status": 4}))

    run = cli(f"resume={sweep}")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "point 1 running: resumed from its checkpoint" in out and "point 2 failed: run" in out
    assert files(sweep / "0") == kept
    assert json.loads((sweep / "1" / SUMMARY).read_text())["resumed_from_step"] == 5
    assert json.loads((sweep / ATTEMPTS / "2.1" / SUMMARY).read_text())["status"] == "stalled"
    for point in ("0", "1", "2"):
        assert json.loads((sweep / point / SUMMARY).read_text())["status"] == "ok", point
    assert len((sweep / "report.csv").read_text().splitlines()) == 1 + 3


class FakeLauncher:
    """Records each launch (its first job number and overrides); a point of ``fails`` ends failed."""

    def __init__(self, sweep_dir: Path, fails: tuple[int, ...] = ()):
        self.sweep_dir, self.fails, self.launches = sweep_dir, fails, []

    def launch(self, batch: list[list[str]], initial_job_idx: int) -> list:
        from hydra.core.utils import JobReturn, JobStatus

        self.launches.append((initial_job_idx, [list(b) for b in batch]))
        for num in range(initial_job_idx, initial_job_idx + len(batch)):
            end_point(self.sweep_dir, num, "failed" if num in self.fails else "ok")
        return [JobReturn(overrides=b, status=JobStatus.COMPLETED, _return_value=0.5) for b in batch]


def fake_sweeper(sweep_dir: Path, fails=(), resume=False, batch=None, **sweep) -> MpitrainSweeper:
    """:class:`MpitrainSweeper` over :class:`FakeLauncher`, as Hydra sets it up (no jobs composed)."""
    sweeper = MpitrainSweeper(max_batch_size=batch, resume=resume)
    settings = {"retry": True, "fail_fast": False, "zip": [], **sweep}
    sweeper.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep_dir)}}, "sweep": settings})
    sweeper.hydra_context = SimpleNamespace(config_loader=None)
    sweeper.launcher = FakeLauncher(sweep_dir, fails)
    sweeper.validate_batch_is_legal = lambda batch: None
    return sweeper


def test_the_sweeper_launches_the_points_left_under_their_own_numbers(tmp_path, monkeypatch):
    """What every launcher (basic, joblib, submitit, Slurm's) is given: runs of consecutive point numbers,
    which name the points' folders."""
    monkeypatch.setattr(outcomes, "NOT_OK", [])
    sweep = ["optim.lr=1,2,3,4,5"]
    fresh = fake_sweeper(tmp_path / "fresh", batch=2)
    fresh.sweep(sweep)
    assert [start for start, _ in fresh.launcher.launches] == [0, 2, 4]
    assert (tmp_path / "fresh" / SWEEP_CONFIG).is_file()

    make_point(tmp_path / "old" / "0", "ok")
    make_point(tmp_path / "old" / "2", "ok")
    (tmp_path / "old" / SWEEP_CONFIG).write_text("kept: as the first run wrote it\n")
    resumed = fake_sweeper(tmp_path / "old", resume=True)
    resumed.sweep(sweep)
    assert resumed.launcher.launches == [(1, [["optim.lr=2"]]), (3, [["optim.lr=4"], ["optim.lr=5"]])]
    assert (tmp_path / "old" / SWEEP_CONFIG).read_text() == "kept: as the first run wrote it\n"


def test_fail_fast_launches_nothing_after_a_launch_with_a_point_not_ok(tmp_path, monkeypatch):
    monkeypatch.setattr(outcomes, "NOT_OK", [])
    sweeper = fake_sweeper(tmp_path, fails=(1,), batch=1, fail_fast=True)
    sweeper.sweep(["optim.lr=1,2,3,4"])
    assert [start for start, _ in sweeper.launcher.launches] == [0, 1]
    zipped = fake_sweeper(tmp_path / "zip", zip=["optim.lr", "train.seed"])
    zipped.sweep(["optim.lr=1,2", "train.seed=3,4"])
    assert zipped.launcher.launches == [(0, [["optim.lr=1", "train.seed=3"], ["optim.lr=2", "train.seed=4"]])]


def test_every_points_values_are_checked_before_the_first_starts():
    """A bad value of the sweep's last point was found when that point started, after the others had run;
    each problem is named with the points it is found in (all of them: no list)."""
    from runner.launcher.sweeper import check_values
    from tests.conftest import compose_config

    grid = [["optim.lr=0.1", "rule=bsp"], ["optim.lr=-1", "rule=bsp"], ["optim.lr=0.1", "rule=demo"]]
    with pytest.raises(ValueError) as refused:
        check_values(grid, compose_config, ["optim.lr=0.1,-1", "rule=bsp,demo"])
    lines = str(refused.value).splitlines()
    assert lines[0] == "2 settings are invalid:", lines
    assert lines[1].startswith("  - optim.lr=-1.0 is invalid") and lines[1].endswith(
        "(point optim.lr=-1,rule=bsp)"
    )
    assert "rule=demo keeps the momentum itself" in lines[2] and lines[2].endswith(
        "(point optim.lr=0.1,rule=demo)"
    )
    check_values([["optim.lr=0.1"], ["optim.lr=0.2"]], compose_config, ["optim.lr=0.1,0.2"])  # none: no error
    with pytest.raises(ValueError, match=r"^train.epochs=0 is invalid: .*=10\)$"):  # in every point: no list
        check_values(
            [["train.epochs=0", "optim.lr=0.1"], ["train.epochs=0", "optim.lr=0.2"]], compose_config, []
        )
