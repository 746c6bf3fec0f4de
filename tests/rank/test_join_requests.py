"""``RUN_DIR/JOIN`` can neither end nor hang a job (issue 37, item 5): its text is parsed strictly (a small
number of ASCII digits, else one warning and the job goes on), a job that cannot grow (no fault tolerance,
or its collectives on gloo or NCCL) refuses it in one warning, and a request left by an earlier job of the
run folder is not applied by ``resume=``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.rank.agreement import Control
from runner.rank.checkpoint import Checkpointer
from runner.run_folder import CONFIG, JOIN
from runner.schema.sections import CheckpointConfig
from tests.helpers.fakecomm import FakeWorld

BAD_TEXTS = ["²", "9" * 400, "9" * 5000, "٣", "0", "1001", "-1", "1e3", "2 workers", "\x00\xff"]
ELASTIC = SimpleNamespace(rank=0, tolerant=True, dist=None)  # worker 0 of a job that can grow


def polled(tmp_path: Path, text: str) -> int:
    """The workers' agreement (worker 0 reads JOIN) on a one-worker job at the step after ``text`` was
    written: the workers it asks for (a job on the in-process communicator, which cannot grow: 0 for any
    text, but no exception)."""
    cfg = CheckpointConfig(every=None, every_minutes=None)

    def main(comm):
        control = Control(comm, tmp_path, Checkpointer(cfg, tmp_path, comm, None), 1)
        control.poll(1)
        (tmp_path / JOIN).write_bytes(text.encode(errors="surrogateescape"))
        control.poll(2)
        decision = control.poll(3)
        control.close()
        return decision.join

    return FakeWorld(1).run(main)[0]


@pytest.mark.parametrize("text", BAD_TEXTS, ids=lambda t: repr(t[:6]) + f"({len(t)})")
def test_a_join_text_that_is_no_small_number_is_named_and_ignored(tmp_path, capsys, text):
    """Before: ``²`` and 5,000 digits raised ValueError, 400 digits OverflowError, ending the job."""
    asked = polled(tmp_path, text)
    out = capsys.readouterr().out
    assert asked == 0 and not (tmp_path / JOIN).exists()
    assert out.count("warning: ") == 1 and f"{tmp_path / JOIN} says " in out, out
    assert "write the number of workers to add, 1 to 1000" in out and len(out) < 400, out


@pytest.mark.parametrize("text, asked", [("3", 3), (" 2\n", 2), ("", 1), ("1000", 1000), ("+2", 2)])
def test_a_small_number_asks_for_that_many_workers_of_a_job_that_can_grow(tmp_path, capsys, text, asked):
    control = Control(ELASTIC, tmp_path, None, interval=1, split=False)
    (tmp_path / JOIN).write_text(text)
    assert control.join_granted() == asked and not (tmp_path / JOIN).exists()
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    "workers, why",
    [
        (SimpleNamespace(rank=0, tolerant=False, dist=None), "hardware.fault_tolerance=none"),
        (SimpleNamespace(rank=0, tolerant=True, dist=SimpleNamespace(backend="gloo")), "transport=gloo"),
        (SimpleNamespace(rank=0, tolerant=True, dist=SimpleNamespace(backend="nccl")), "transport=nccl"),
    ],
)
def test_a_job_that_cannot_grow_refuses_a_join_in_one_warning(tmp_path, capsys, workers, why):
    """Before: a non-elastic job took the file without a word; gloo and NCCL jobs under continue tried to
    grow, and the spawn hung until the stall watchdog ended the job."""
    control = Control(workers, tmp_path, None, interval=1, split=False)
    (tmp_path / JOIN).write_text("2\n")
    assert control.join_granted() == 0 and not (tmp_path / JOIN).exists()
    out = capsys.readouterr().out
    assert out.count("warning: ") == 1 and f"{tmp_path / JOIN} refused: " in out and why in out, out


def test_a_join_left_by_an_earlier_job_is_removed_unread_as_the_job_starts(tmp_path, capsys):
    """Before: a JOIN written after a job's last agreement grew the job ``resume=`` started next."""
    (tmp_path / JOIN).write_text("2\n")
    old = time.time() - 60
    os.utime(tmp_path / JOIN, (old, old))
    (tmp_path / CONFIG).write_text("devices: 2\n")  # the launcher writes it as each job starts
    control = Control(ELASTIC, tmp_path, None, interval=1, split=False)
    control.drop_stale_join()
    assert not (tmp_path / JOIN).exists() and "left by an earlier job" in capsys.readouterr().out
    (tmp_path / JOIN).write_text("2\n")  # one written while this job runs is this job's
    control.drop_stale_join()
    assert control.join_granted() == 2


def test_a_join_that_is_a_folder_is_named_once(tmp_path, capsys):
    (tmp_path / JOIN).mkdir()
    control = Control(ELASTIC, tmp_path, None, interval=1, split=False)
    assert control.join_granted() == 0 and control.join_granted() == 0
    assert capsys.readouterr().out.count("cannot be read") == 1


# -- real mpirun jobs ------------------------------------------------------------------------------------


def start(run_dir: Path, *overrides: str) -> subprocess.Popen:
    argv = [sys.executable, "-m", "runner", f"hydra.run.dir={run_dir}", *overrides]
    env = {**os.environ, "MPITRAIN_TTY": "0", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def wait_for(run_dir: Path, kind: str, deadline: float) -> None:
    metrics = run_dir / "metrics.jsonl"
    while time.time() < deadline and not (metrics.exists() and f'"kind": "{kind}"' in metrics.read_text()):
        time.sleep(0.2)
    assert time.time() < deadline, f"no {kind} record in time"


def served(join: Path, deadline: float) -> None:
    while join.exists() and time.time() < deadline:
        time.sleep(0.1)
    assert not join.exists(), "the JOIN was not read in time"


def finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.mpi
def test_bad_join_texts_warn_and_a_fault_tolerant_job_ends_ok(tmp_path):
    run_dir = tmp_path / "run"
    proc = start(
        run_dir, "devices=2", "hardware.oversubscribe=true", "hardware.fault_tolerance=continue",
        "train.epochs=4", "simulate.straggler_ms=40", "simulate.straggler_ranks=[0,1]",
    )  # fmt: skip
    deadline = time.time() + 150
    try:
        wait_for(run_dir, "step", deadline)
        for text in ("²", "9" * 400, "9" * 5000):
            (run_dir / JOIN).write_text(text)
            served(run_dir / JOIN, deadline)
    finally:
        output = finish(proc, 200)
    assert proc.returncode == 0, output
    assert output.count(f"warning: {run_dir / JOIN} says ") == 3, output
    warned = "\n".join(line for line in output.splitlines() if "JOIN says" in line)
    assert "'\\xb2'" in warned and "(400 characters)" in warned and "(4096+ characters)" in warned, warned
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["workers_at_end"] == 2 and not summary.get("joins")


@pytest.mark.slow
@pytest.mark.mpi
def test_a_join_on_gloo_under_continue_after_a_lost_worker_is_refused_at_once(tmp_path):
    """Before: the survivors spawned into a job whose collectives are on gloo, and waited there until the
    stall watchdog ended it."""
    run_dir = tmp_path / "run"
    proc = start(
        run_dir, "hydra.searchpath=[file://tests/conf]", "model=dies", "model.die_rank=2", "model.die_at=5",
        "devices=3", "hardware.oversubscribe=true", "hardware.fault_tolerance=continue",
        "hardware.transport=gloo", "train.epochs=3", "train.stall_timeout=60",
        "simulate.straggler_ms=30", "simulate.straggler_ranks=[0,1]",
    )  # fmt: skip
    deadline = time.time() + 150
    try:
        wait_for(run_dir, "failure", deadline)
        (run_dir / JOIN).write_text("1\n")
        served(run_dir / JOIN, deadline)
    finally:
        output = finish(proc, 200)
    assert proc.returncode == 0, output
    assert f"warning: {run_dir / JOIN} refused: " in output and "hardware.transport=gloo" in output, output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["workers_at_end"] == 2 and not summary.get("joins")
