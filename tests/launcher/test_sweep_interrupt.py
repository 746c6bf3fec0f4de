"""Ctrl-C stops a sweep (issue 50): the running points checkpoint and stop, no further point starts.

One SIGINT to a running sweep's process group: the report is written over what finished, the last line
is the ``resume=SWEEP_DIR`` command (exit 130), and ``resume=`` then finishes the sweep. The parts
in-process here (the sweeping process's signals, a point's process following them, the Slurm launcher's
cancellations against stand-ins); the Done-when with real jobs, with the basic launcher and Hydra's joblib
launcher."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from hydra.core.utils import JobReturn, JobStatus

import runner.launcher.job_output
import runner.launcher.supervise
import runner.launcher.watches
from runner.launcher import outcomes, sweep_stop
from runner.launcher.launch import JobEnded
from runner.launcher.sweep_resume import end_point, read_manifest
from runner.launcher.sweep_stop import STOP_FILE, STOP_SIGNALS
from runner.run_folder import CHECKPOINT_INDEX, CHECKPOINTS, CONFIG, METRICS, STOP, SUMMARY
from tests.conftest import ROOT
from tests.launcher.test_supervise import job  # noqa: F401 (a fixture: a Supervisor of a stand-in job)
from tests.launcher.test_sweep_resume import fake_sweeper


@pytest.fixture(autouse=True)
def restored(monkeypatch):
    """This process's stop-signal handlers and sweep (:mod:`runner.launcher.sweep_stop`) as they were."""
    monkeypatch.setattr(outcomes, "NOT_OK", [])
    before = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    yield
    for signum, handler in before.items():
        signal.signal(signum, handler)
    sweep_stop.reset()


def test_the_sweeping_process_takes_the_stop_signals_while_its_points_run(tmp_path):
    (tmp_path / STOP_FILE).write_text("SIGTERM\n")  # an earlier run of the sweep was stopped: forgotten
    with sweep_stop.taking_signals(tmp_path, total=3):
        assert sweep_stop.requested() == [] and not (tmp_path / STOP_FILE).exists()
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt: recorded, for every point
        assert sweep_stop.requested() == ["SIGINT"] and (tmp_path / STOP_FILE).read_text() == "SIGINT\n"
        points = sweep_stop.UntilStopped([["optim.lr=1"], ["optim.lr=2"]])
        assert len(points) == 2 and list(points) == []  # a launcher starts none of them
    assert sweep_stop.last_line() == (
        f"the sweep was stopped (SIGINT): 0 of 3 points ok, 3 not started; finish it with: "
        f"python -m runner resume={tmp_path}"
    )
    with pytest.raises(SystemExit) as ended:  # once its points ended: a second signal ends it at once
        os.kill(os.getpid(), signal.SIGTERM)
    assert ended.value.code == 130


def test_a_sweep_not_stopped_gives_back_the_signals(tmp_path):
    before = signal.getsignal(signal.SIGINT)
    with sweep_stop.taking_signals(tmp_path, total=2):
        assert signal.getsignal(signal.SIGINT) is not before
        assert list(sweep_stop.UntilStopped([["a"], ["b"]])) == [["a"], ["b"]]
    assert signal.getsignal(signal.SIGINT) is before
    assert sweep_stop.requested() == [] and sweep_stop.last_line() is None


def test_a_point_in_a_process_of_its_own_records_signals_between_its_jobs(tmp_path):
    """A joblib worker records a Ctrl-C between two points, and starts no further point.

    Ended by it, the worker would break its pool, which then kills the points running in the others."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (as a fresh process has it; an
    try:  # xdist worker's, or one an earlier test left, is not the default, and would be left alone)
        sweep_stop.follow(tmp_path, elsewhere=True)
        assert sweep_stop.requested() == []
        os.kill(os.getpid(), signal.SIGINT)
        waited = 0  # (the handler runs in the main thread, between two of its bytecodes)
        while not sweep_stop.requested() and waited < 500:
            time.sleep(0.01)
            waited += 1
    finally:
        signal.signal(signal.SIGINT, before)
    assert sweep_stop.requested() == ["SIGINT"]
    (tmp_path / STOP_FILE).write_text("SIGINT\nSIGINT\n")  # the sweeping process had two
    assert sweep_stop.requested() == ["SIGINT", "SIGINT"]


def test_processes_a_joblib_sweep_starts_hold_its_stop_signals_until_their_point_follows(tmp_path):
    """A Ctrl-C while a joblib worker still imports ended it (KeyboardInterrupt, or death by SIGINT) and broke
    the pool. Its processes start with the stop signals held; the sweeping process still hears them."""
    status = "import re; print(re.search(r'SigBlk:\\s*(\\w+)', open('/proc/self/status').read())[1])"
    with sweep_stop.taking_signals(tmp_path, total=2), sweep_stop.held_from_new_processes(spawns=True):
        held = int(subprocess.run([sys.executable, "-c", status], capture_output=True, text=True).stdout, 16)
        os.kill(os.getpid(), signal.SIGINT)
        waited = 0  # (taken by a thread of this process, handled in its main thread)
        while not sweep_stop.requested() and waited < 500:
            time.sleep(0.01)
            waited += 1
        assert sweep_stop.requested() == ["SIGINT"]
    assert all(held & 1 << (s - 1) for s in STOP_SIGNALS), f"{held:x}"
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # this thread's, as before


def test_a_stop_signal_held_since_a_worker_started_is_taken_when_its_point_follows(tmp_path):
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # (a fresh process's)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # (as it started: held)
    try:
        signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # a Ctrl-C while it imported (pending
        # here: a process-directed one could go to another thread of pytest's, which does not hold it)
        sweep_stop.follow(tmp_path, elsewhere=True)  # no KeyboardInterrupt
        assert sweep_stop.requested() == ["SIGINT"]
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGINT, before)


class StoppedDuring:
    """A launcher whose first point gets a Ctrl-C while it runs and ends preempted (raised: run elsewhere)."""

    def __init__(self, sweep_dir: Path) -> None:
        self.sweep_dir, self.started = sweep_dir, []

    def launch(self, batch: list[list[str]], initial_job_idx: int) -> list[JobReturn]:
        returns = []
        for num, overrides in enumerate(batch, initial_job_idx):  # (as Hydra's launchers: one by one)
            self.started.append(list(overrides))
            end_point(self.sweep_dir, num, "preempted")  # (what its process records)
            os.kill(os.getpid(), signal.SIGINT)
            stopped = JobEnded("by SIGINT: checkpoint 00001-step5 written", "preempted")
            returns.append(JobReturn(overrides=overrides, status=JobStatus.FAILED, _return_value=stopped))
        return returns


@pytest.mark.parametrize("batch", [None, 1])
def test_a_stopped_sweep_starts_no_further_point_and_goes_on_to_its_report(tmp_path, batch):
    sweeper = fake_sweeper(tmp_path, batch=batch)
    sweeper.launcher = StoppedDuring(tmp_path)
    sweeper.sweep(["optim.lr=1,2,3"])  # returns (to the report), though its point raised
    assert sweeper.launcher.started == [["optim.lr=1"]]
    assert outcomes.NOT_OK == [("optim.lr=1", "preempted", 5)]
    states = {n: p["state"] for n, p in read_manifest(tmp_path).items()}
    assert states == {"0": "preempted", "1": "pending", "2": "pending"}
    assert sweep_stop.last_line().startswith(
        "the sweep was stopped (SIGINT): 0 of 3 points ok, 1 preempted, 2 not started"
    )


def test_a_ctrl_c_while_the_points_are_checked_stops_the_sweep_before_any_starts(tmp_path):
    """Checking every point's values takes a while before the first starts (a quarter of a second a point):
    a Ctrl-C then ended the sweep with a KeyboardInterrupt's traceback, exit 1, no resume= line."""
    sweeper = fake_sweeper(tmp_path)
    planned = sweeper._jobs

    def checked_while_signalled(sweep_dir, arguments):
        os.kill(os.getpid(), signal.SIGINT)
        return planned(sweep_dir, arguments)

    sweeper._jobs = checked_while_signalled
    sweeper.sweep(["optim.lr=1,2,3"])
    assert sweeper.launcher.launches == []
    assert sweep_stop.last_line().startswith(
        "the sweep was stopped (SIGINT): 0 of 3 points ok, 3 not started"
    )
    assert {p["state"] for p in read_manifest(tmp_path).values()} == {"pending"}  # resume= runs them


def test_a_point_of_a_stopped_sweep_does_not_start_nor_leave_a_folder(tmp_path):
    ident = {"overrides": ["optim.lr=2"], "name": "optim.lr=2"}
    new, resumed = tmp_path / "1", tmp_path / "2"
    for point in (new, resumed):  # what Hydra made before the point's task ran
        (point / ".hydra").mkdir(parents=True)
        for name in ("config.yaml", "hydra.yaml", "overrides.yaml", "cli.log"):
            (point / (name if name.endswith(".log") else f".hydra/{name}")).write_text("x")
    (resumed / CONFIG).write_text("devices: 1\n")  # a point resumed: its job's files
    sweep_stop.follow(tmp_path, elsewhere=False)
    assert not sweep_stop.not_started((tmp_path, 1), ident, new, new / ".hydra")  # not stopped: it starts
    (tmp_path / STOP_FILE).write_text("SIGTERM\n")
    assert sweep_stop.not_started((tmp_path, 1), ident, new, new / ".hydra")
    assert not new.exists() and read_manifest(tmp_path)["1"]["state"] == "pending"
    assert sweep_stop.not_started((tmp_path, 2), ident, resumed, resumed / ".hydra")
    assert (
        (resumed / CONFIG).is_file() and (resumed / "cli.log").is_file() and not (resumed / ".hydra").exists()
    )
    assert "2" not in read_manifest(tmp_path)  # (as the resume's plan recorded it)


def write_later(path: Path, *texts: str, after: Path) -> None:
    """Write ``texts`` to ``path`` in turn, 0.3 s apart, once ``after`` exists."""

    def write() -> None:
        deadline = time.time() + 20
        while not after.exists() and time.time() < deadline:
            time.sleep(0.05)
        for text in texts:
            path.write_text(text)
            time.sleep(0.3)

    threading.Thread(target=write, daemon=True).start()


def test_a_points_job_stops_on_its_sweeps_stop_as_on_its_own_signal(job, tmp_path):  # noqa: F811
    """A point's job stops on its sweep's stop, which the sweeping process alone had; a second ends it.

    (``kill PID`` of the sweep; a point on another node.) The first: checkpoint and stop; the second: at
    once."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    sweep_stop.follow(sweep, elsewhere=False)
    write_later(sweep / STOP_FILE, "SIGTERM\n", after=tmp_path / "ready")
    outcome = job("preempt").run()
    assert (outcome.returncode, outcome.signal, outcome.interrupted) == (0, "SIGTERM", None)
    assert (tmp_path / STOP).read_text() == "SIGTERM\n"

    (sweep / STOP_FILE).unlink()
    (tmp_path / "ready").unlink()
    write_later(sweep / STOP_FILE, "SIGTERM\n", "SIGTERM\nSIGINT\n", after=tmp_path / "ready")
    start = time.time()
    outcome = job("ignore").run()
    assert outcome.interrupted == "a second signal (SIGINT)" and time.time() - start < 10


def test_a_signal_that_reached_the_point_and_its_sweep_counts_once(job, tmp_path, monkeypatch):  # noqa: F811
    """A Ctrl-C that reached a point's process and its sweeping process is one stop request, not two.

    The worker may read the sweep's stop before its own signal; two would end the job at once."""
    monkeypatch.setattr(runner.launcher.watches, "GRACE_S", 1.0)
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    sweep_stop.follow(sweep, elsewhere=True)
    (sweep / STOP_FILE).write_text("SIGINT\n")

    def own_signal() -> None:
        while not (tmp_path / STOP).exists():
            time.sleep(0.02)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=own_signal, daemon=True).start()
    outcome = job("ignore").run()
    assert outcome.interrupted == "the job did not stop within 1 s of SIGINT"


def test_a_stopped_slurm_sweep_cancels_its_jobs_not_started_then_all(tmp_path, monkeypatch):
    """A stopped Slurm sweep cancels its jobs not started, then, at a second stop, all its jobs.

    Against stand-ins, untested on a real Slurm (tests/cluster needs root): the ``scancel`` calls, and a
    point whose job was cancelled before it started, which leaves no folder and counts as not started."""
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the slurm extra is not installed")
    from types import SimpleNamespace

    from runner.launcher import slurm_sweep
    from tests.launcher.test_slurm_sweep import slurm_launcher

    calls = []
    monkeypatch.setattr(
        slurm_sweep, "_call", lambda argv: (calls.append(argv), (SimpleNamespace(returncode=0), None))[1]
    )
    sweep = tmp_path / "sweep"
    launcher = slurm_launcher(sweep, ["optim.lr=0.05,0.1,0.2"])
    tasks = [SimpleNamespace(job_id=f"8_{i}") for i in range(3)]
    returns = [None, JobReturn(status=JobStatus.COMPLETED), None]
    with sweep_stop.taking_signals(sweep, total=3):
        assert launcher.follow_stop(tasks, returns, 0) == 0 and calls == []
        assert not launcher.unstarted(tasks[2], ["optim.lr=0.2"], 2)  # not stopped: a lost point
        sweep_stop.heard("SIGINT")
        assert launcher.follow_stop(tasks, returns, 0) == 1
        assert launcher.follow_stop(tasks, returns, 1) == 1
        assert calls == [["scancel", "--state=PENDING", "8_0", "8_2"]]
        assert launcher.unstarted(tasks[2], ["optim.lr=0.2"], 2) and not (sweep / "2").exists()
        (sweep / "0").mkdir(parents=True)
        (sweep / "0" / CONFIG).write_text("devices: 4\n")  # its job started: Slurm ended it, as before
        assert not launcher.unstarted(tasks[0], ["optim.lr=0.05"], 0)
        sweep_stop.heard("SIGINT")
        assert launcher.follow_stop(tasks, returns, 1) == 2
        assert calls[-1] == ["scancel", "8_0", "8_2"]


POINTS = ["optim.lr=0.01,0.02,0.03,0.04,0.05"]
#: Each point: about 40 steps of 50 ms, a checkpoint every 5 (so a stop lands within a step or two).
JOB = [
    "model=mlp",
    "devices=1",
    "train.epochs=1",
    "train.max_steps=40",
    "train.log_every=5",
    "checkpoint.every=5",
    "simulate.straggler_ranks=[0]",
    "simulate.straggler_ms=50",
    "train.progress=false",
]


def stepped(point: Path) -> bool:
    """Whether the point's job has logged a training step (it runs, past its start)."""
    try:
        return '"kind": "step"' in (point / METRICS).read_text()
    except OSError:
        return False


def interrupt(sweep: Path, *args: str, running: tuple[str, ...]) -> tuple[int, str, float]:
    """Start the sweep, SIGINT its group once the ``running`` points trained a step; (status, output, end).

    ``end``: when it exited."""
    argv = [sys.executable, "-m", "runner", "-m", f"hydra.sweep.dir={sweep}", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not all(stepped(sweep / p) for p in running):
            assert proc.poll() is None and time.monotonic() < deadline, "the points did not start"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # a terminal's Ctrl-C: the sweep's whole process group
        out, _ = proc.communicate(timeout=120)
        return proc.returncode, out, time.time()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def assert_stopped(sweep: Path, code: int, out: str, ended: float, stopped: tuple[str, ...]) -> None:
    """Exit 130 soon after the ``stopped`` points' checkpoints, and only those started.

    They ended preempted, the report is over them and the resume command is the last line."""
    assert code == 130, out
    lines = [line for line in out.splitlines() if line.strip()]
    assert f"resume={sweep}" in lines[-1], out
    for point in stopped:
        summary = json.loads((sweep / point / SUMMARY).read_text())
        assert summary["status"] == "preempted", (point, summary)
        index = json.loads((sweep / point / CHECKPOINTS / CHECKPOINT_INDEX).read_text())["checkpoints"]
        assert index[-1]["step"] == summary["steps"] < 40
        assert ended - index[-1]["time"] < 10, f"exit {ended - index[-1]['time']:.1f} s after the checkpoint"
    started = sorted(p.name for p in sweep.iterdir() if p.is_dir() and p.name.isdigit())
    assert started == sorted(stopped), out  # no point started after the stop: not even its folder
    assert len((sweep / "report.csv").read_text().splitlines()) == 1 + len(stopped)
    states = {n: p["state"] for n, p in read_manifest(sweep).items()}
    assert states == {str(n): "preempted" if str(n) in stopped else "pending" for n in range(5)}, states


def assert_resumed(sweep: Path, stopped: tuple[str, ...]) -> None:
    """``resume=SWEEP_DIR`` ends with all 5 points ok, the stopped ones from their checkpoints."""
    argv = [sys.executable, "-m", "runner", f"resume={sweep}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    run = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    for point in stopped:
        assert f"point {point} preempted: resumed from its checkpoint" in out, out
    for point in range(5):
        summary = json.loads((sweep / str(point) / SUMMARY).read_text())
        assert summary["status"] == "ok" and summary["steps"] == 40, (point, summary)
    assert {p["state"] for p in read_manifest(sweep).values()} == {"ok"}
    assert len((sweep / "report.csv").read_text().splitlines()) == 1 + 5


@pytest.mark.slow
@pytest.mark.mpi
def test_one_ctrl_c_stops_a_sweep_and_resume_finishes_it(tmp_path):
    """Issue 50's Done-when, basic launcher: SIGINT during point 0 of 5."""
    sweep = tmp_path / "sweep"
    code, out, ended = interrupt(sweep, *POINTS, *JOB, running=("0",))
    assert "] not started" not in out, out  # (the basic launcher: no point is even handed over)
    assert_stopped(sweep, code, out, ended, ("0",))
    assert_resumed(sweep, ("0",))


@pytest.mark.slow
@pytest.mark.mpi
def test_one_ctrl_c_stops_a_joblib_sweep_and_resume_finishes_it(tmp_path):
    """The same with Hydra's joblib launcher, 2 points at a time: both running points are stopped.

    The points already handed to its workers do not start."""
    pytest.importorskip(
        "hydra_plugins.hydra_joblib_launcher", reason="hydra-joblib-launcher is not installed"
    )
    sweep = tmp_path / "sweep"
    joblib = ["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"]
    code, out, ended = interrupt(sweep, *joblib, *POINTS, *JOB, running=("0", "1"))
    assert_stopped(sweep, code, out, ended, ("0", "1"))
    assert "Error executing job" not in out and "Joblib.Parallel(" not in out, out  # (preempted, as asked)
    assert_resumed(sweep, ("0", "1"))


def loky_worker_started(pid: int) -> bool:
    """Whether a process of ``pid``'s session is a joblib (loky) worker."""
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)[1].split()
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[3]) == pid and b"popen_loky_posix" in cmdline:  # (its session: the sweep's pid)
            return True
    return False


@pytest.mark.slow
@pytest.mark.mpi
def test_a_ctrl_c_while_joblibs_workers_start_stops_the_sweep_cleanly(tmp_path):
    """SIGINT to the group as the first worker process appears (still importing): exit 130, every point
    not started, no traceback (it was a TerminatedWorkerError or BrokenProcessPool)."""
    pytest.importorskip(
        "hydra_plugins.hydra_joblib_launcher", reason="hydra-joblib-launcher is not installed"
    )
    sweep = tmp_path / "sweep"
    argv = [sys.executable, "-m", "runner", "-m", f"hydra.sweep.dir={sweep}", "hydra/launcher=joblib"]
    argv += ["hydra.launcher.n_jobs=2", *POINTS, *JOB]
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while not loky_worker_started(proc.pid):
            assert proc.poll() is None and time.monotonic() < deadline, "no worker started"
            time.sleep(0.01)
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130 and "Traceback" not in out, out
    assert (
        out.strip()
        .splitlines()[-1]
        .endswith(f"0 of 5 points ok, 5 not started; finish it with: python -m runner resume={sweep}")
    ), out
    assert not [p for p in sweep.iterdir() if p.is_dir() and p.name.isdigit()], out
