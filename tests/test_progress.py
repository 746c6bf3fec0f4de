"""Rank 0's progress: a bar to a terminal (even under mpirun's 0×0 pseudo-terminals), else plain lines."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.comm import CommStats
from runner.rank.meter import DEFAULT_COLUMNS, Display, Meter, display
from runner.run_folder import COLUMNS_ENV, TTY_ENV

ROOT = Path(__file__).resolve().parents[1]
BAR_UPDATE = re.compile(rb"\r(?!\n)([^\r\n]*)")  # a carriage return that rewrites the line (not a \r\n)


class Log(io.StringIO):
    """A terminal or log file stand-in that says whether it is a terminal."""

    def __init__(self, tty: bool = False):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def set_size(fd: int, rows: int, cols: int) -> None:
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


@pytest.fixture
def pseudo_terminal():
    """A pseudo-terminal's (master, slave) file descriptors, closed afterwards."""
    master, slave = pty.openpty()
    yield master, slave
    for fd in (master, slave):
        try:
            os.close(fd)
        except OSError:
            pass


def test_the_launchers_terminal_decides():
    stream = Log(tty=False)  # what the rank's own stream says does not count when the launcher said
    assert display(True, stream, {TTY_ENV: "1", COLUMNS_ENV: "132"}) == Display("bar", 132)
    assert display(True, stream, {TTY_ENV: "1"}) == Display("bar", DEFAULT_COLUMNS)
    assert display(True, stream, {TTY_ENV: "1", COLUMNS_ENV: "0"}) == Display("bar", DEFAULT_COLUMNS)
    assert display(True, Log(tty=True), {TTY_ENV: "0", COLUMNS_ENV: "132"}) == Display("lines")


def test_no_progress_when_off_or_not_rank_0():
    assert display(False, Log(tty=True), {TTY_ENV: "1", COLUMNS_ENV: "80"}).mode == "none"
    assert display(True, None, {TTY_ENV: "1", COLUMNS_ENV: "80"}).mode == "none"


def test_a_zero_by_zero_pseudo_terminal_gets_a_width(pseudo_terminal):
    """Open MPI's case without the launcher's word: a terminal that reports 0 columns."""
    master, slave = pseudo_terminal
    stream = os.fdopen(os.dup(slave), "w")
    try:
        set_size(slave, 0, 0)
        assert display(True, stream, {}) == Display("bar", DEFAULT_COLUMNS)
        assert display(True, stream, {"COLUMNS": "77"}) == Display("bar", 77)
        set_size(slave, 40, 91)
        assert display(True, stream, {}) == Display("bar", 91)
    finally:
        stream.close()
    assert display(True, Log(tty=False), {}) == Display("lines")


def test_rank_env_passes_the_launchers_terminal(monkeypatch):
    from runner.hardware.mpirun import rank_env

    hw = SimpleNamespace(env={"FOO": "1"})
    monkeypatch.setenv("COLUMNS", "123")
    monkeypatch.setattr(sys, "stdout", Log(tty=True))
    env = rank_env(hw, 2)
    assert env[TTY_ENV] == "1" and env[COLUMNS_ENV] == "123" and env["FOO"] == "1"
    monkeypatch.setattr(sys, "stdout", Log(tty=False))
    env = rank_env(hw, 2)
    assert env[TTY_ENV] == "0" and COLUMNS_ENV not in env


def run_meter(monkeypatch, tty: str | None, steps: int = 12, longer: int = 0, **kwargs) -> tuple[str, str]:
    """What a Meter of ``steps`` steps writes to its terminal and its log file, with an echoed line; with
    ``longer``, the second epoch has that many more steps, told to the meter before it starts."""
    if tty is None:
        monkeypatch.delenv(TTY_ENV, raising=False)
    else:
        monkeypatch.setenv(TTY_ENV, tty)
    monkeypatch.setenv(COLUMNS_ENV, "72")
    terminal, log_file = Log(), Log()
    log = SimpleNamespace(write=lambda *a, **k: None)
    meter = Meter(CommStats(), 2, steps, log, log_every=5, terminal=terminal, log_file=log_file, **kwargs)
    for epoch in range(2):
        if epoch == 1 and longer:
            meter.replan(steps + longer)
        batches = range(steps // 2 + (longer if epoch == 1 else 0))
        for step, _ in enumerate(meter.batches(batches), start=epoch * steps // 2 + 1):
            meter.step_done(step, epoch, 0.5, 8, 0.1)
        meter.epoch_done()
        meter.echo(f"epoch {epoch}: val_acc 0.5")
    meter.close()
    return terminal.getvalue(), log_file.getvalue()


def test_bar_draws_with_carriage_returns_at_the_launchers_width(monkeypatch):
    out, log = run_meter(monkeypatch, "1")
    updates = [u.decode() for u in BAR_UPDATE.findall(out.encode())]
    assert updates, out
    assert all(len(u) <= 72 for u in updates), updates
    last = [u for u in updates if u.strip()][-1]
    assert "step 12/12" in last and "epoch 1" in last and "loss 0.5000" in last
    assert "samples/s" in last and "ETA" in last
    assert "epoch 0: val_acc 0.5\n" in out and "epoch 1: val_acc 0.5\n" in out
    assert log == "epoch 0: val_acc 0.5\nepoch 1: val_acc 0.5\n", "the log gets the echoed lines, no bar"


@pytest.mark.parametrize("tty", ["1", "0"])
def test_a_longer_run_than_planned_is_shown_against_its_new_length(monkeypatch, tty):
    """Survivors of a lost worker run longer epochs: the bar and the lines count against the new total."""
    out, _ = run_meter(monkeypatch, tty, longer=4, line_every_s=0.0)
    shown = [tuple(map(int, m)) for m in re.findall(r"step (\d+)/(\d+)", out)]
    assert shown[-1] == (16, 16) and all(step <= total for step, total in shown), shown


def test_lines_when_not_a_terminal(monkeypatch):
    out, log = run_meter(monkeypatch, "0", line_every_s=0.0)
    assert "\r" not in out
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(lines) == 12, out
    assert lines[-1].startswith("step 12/12 (100%), epoch 1, loss 0.5000, ") and "samples/s" in lines[-1]
    assert "step" not in log


def test_lines_are_spaced_and_each_epoch_ends_with_one(monkeypatch):
    out, _ = run_meter(monkeypatch, "0", line_every_s=3600.0)
    lines = out.splitlines()
    firsts = [line.split(",")[0] for line in lines]
    assert firsts == ["step 6/12 (50%)", "epoch 0: val_acc 0.5", "step 12/12 (100%)", "epoch 1: val_acc 0.5"]


@pytest.mark.parametrize("tty", ["1", "0"])
def test_the_runs_end_is_shown_when_another_worker_trained_its_last_chunk(monkeypatch, tty):
    """Dynamic assignment: rank 0 shows the chunk it trained; once all workers are past the end, the end."""
    monkeypatch.setenv(TTY_ENV, tty)
    terminal = Log()
    meter = Meter(CommStats(), 2, 10, SimpleNamespace(write=lambda *a, **k: None), 5, terminal=terminal)
    for shown in (1, 4, 7, 9):  # the other worker trained 2, 3, 5, 6, 8 and 10
        for _ in meter.batches([0]):
            meter.step_done(shown, 0, 0.5, 8, 0.1, shown)
    meter.epoch_done()
    meter.reach(9, 0)  # not past what is shown: nothing new
    meter.reach(10, 0)
    meter.close()
    shown = [tuple(map(int, m)) for m in re.findall(r"step (\d+)/(\d+)", terminal.getvalue())]
    assert shown[-1] == (10, 10) and shown.count((10, 10)) == 1, shown


def test_nothing_drawn_with_progress_off(monkeypatch):
    out, _ = run_meter(monkeypatch, "1", progress=False)
    assert out == "epoch 0: val_acc 0.5\nepoch 1: val_acc 0.5\n"


STEPS = 20


def progress_argv(run_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "runner",
        f"hydra.run.dir={run_dir}",
        "train.progress=true",
        "train.epochs=1",
        f"train.max_steps={STEPS}",
    ]


def read_until_exit(proc: subprocess.Popen, master: int, timeout: float) -> bytes:
    """Everything written to the pseudo-terminal until the process ends (killed after ``timeout``)."""
    out, deadline = bytearray(), time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            out += chunk
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
        pytest.fail(f"no exit within {timeout} s; output so far:\n{out.decode(errors='replace')}")
    proc.wait(timeout=30)
    return bytes(out)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_bar_under_mpirun_in_a_terminal(tmp_path, pseudo_terminal):
    master, slave = pseudo_terminal
    set_size(slave, 30, 97)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("COLUMNS", None)
    proc = subprocess.Popen(
        progress_argv(tmp_path / "run"),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=env,
    )
    os.close(slave)
    out = read_until_exit(proc, master, timeout=240)
    assert proc.returncode == 0, out.decode(errors="replace")
    updates = [u.decode() for u in BAR_UPDATE.findall(out) if b"step " in u]
    assert updates, out.decode(errors="replace")
    assert all(len(u) <= 97 for u in updates), updates
    assert f"step {STEPS}/{STEPS}" in updates[-1] and "samples/s" in updates[-1], updates[-1]
    log = (tmp_path / "run" / "logs" / "rank0.log").read_bytes()
    assert b"epoch 0: " in log and not BAR_UPDATE.search(log), "rank 0's log holds no bar"


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_piped_output_gets_lines_not_a_bar(tmp_path):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        progress_argv(tmp_path / "run"), cwd=ROOT, capture_output=True, timeout=240, env=env
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out.decode(errors="replace")
    assert b"\r" not in out
    assert re.search(
        rb"^step %d/%d \(100%%\), epoch 0, loss [0-9.]+, [0-9,]+ samples/s" % (STEPS, STEPS), out, re.M
    )
