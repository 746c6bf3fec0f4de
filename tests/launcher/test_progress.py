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
from runner.launcher.progress import ERASE, Bar, ProgressTap
from runner.rank.pace import Dynamic, Static
from runner.rank.records.meter import Display, Meter, display, progress_record
from runner.rank.state import Position
from runner.run_folder import PROGRESS_RECORD, TTY_ENV

ROOT = Path(__file__).resolve().parents[2]
#: A carriage return that rewrites the line (not a \r\n), after which the line is erased.
BAR_UPDATE = re.compile(rb"\r(?!\n)(?:\x1b\[K)?([^\r\n]*)")


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
    stream = Log(tty=False)  # what the rank's own stream says does not count: the launcher draws the bar
    assert display(True, stream, {TTY_ENV: "1"}) == Display("bar")
    assert display(True, Log(tty=True), {TTY_ENV: "0"}) == Display("lines")
    assert display(True, Log(tty=True), {}) == Display("lines"), "no launcher to draw a bar: lines"


def test_no_progress_when_off_or_not_rank_0():
    assert display(False, Log(tty=True), {TTY_ENV: "1"}).mode == "none"
    assert display(True, None, {TTY_ENV: "1"}).mode == "none"


def test_rank_env_passes_the_launchers_terminal(monkeypatch):
    from runner.hardware.mpirun import rank_env

    hw = SimpleNamespace(env={"FOO": "1"})
    monkeypatch.setattr(sys, "stdout", Log(tty=True))
    env = rank_env(hw, 2)
    assert env[TTY_ENV] == "1" and env["FOO"] == "1"
    monkeypatch.setattr(sys, "stdout", Log(tty=False))
    assert rank_env(hw, 2)[TTY_ENV] == "0"
    monkeypatch.setattr(sys, "stdout", Log(tty=True))
    monkeypatch.setenv(TTY_ENV, "0")  # a sweep point among concurrent ones
    assert rank_env(hw, 2)[TTY_ENV] == "0"


def drawn(rank_output: str, chunk: int = 7, label: bytes = b"") -> bytes:
    """What the launcher's terminal shows of a rank's output, fed in chunks of ``chunk`` bytes."""
    tap, screen = ProgressTap(), io.BytesIO()
    bar = Bar(screen, prefix=label, frame_every_s=0.0)
    data = rank_output.encode()
    for i in range(0, len(data), chunk):
        for part in tap.feed(data[i : i + chunk]):
            bar.write(part) if isinstance(part, bytes) else bar.update(part)
    bar.close()
    return screen.getvalue()


def test_the_tap_takes_records_out_in_order_whatever_the_chunks():
    record = PROGRESS_RECORD + '{"n": 3, "total": 9, "text": "epoch 0"}\n'
    output = "a line\n" + record + "@mpitrain: not a record\n50%|bar\r60%|bar\n" + record + "{bad\n"
    output += PROGRESS_RECORD + "{bad json\nlast"
    for chunk in (1, 2, 5, 64, 4096):
        tap, parts, data = ProgressTap(), [], output.encode()
        for i in range(0, len(data), chunk):
            parts += tap.feed(data[i : i + chunk])
        text = b"".join(p for p in parts if isinstance(p, bytes))
        assert text == b"a line\n@mpitrain: not a record\n50%|bar\r60%|bar\n{bad\nlast", (chunk, text)
        kinds = [type(p).__name__ for p in parts]
        assert [p for p in parts if isinstance(p, dict)] == [{"n": 3, "total": 9, "text": "epoch 0"}] * 2
        first, second = kinds.index("dict"), len(kinds) - 1 - kinds[::-1].index("dict")
        before = b"".join(p for p in parts[:first] if isinstance(p, bytes))
        between = b"".join(p for p in parts[first:second] if isinstance(p, bytes))
        assert before == b"a line\n" and between.endswith(b"60%|bar\n"), (chunk, parts)


def test_the_bar_fits_the_terminal_and_gives_way_to_other_lines(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    texts = {n: f"epoch 0, loss {1 / n:.4f}, 1,234 samples/s, ETA 00:{40 - n:02d}" for n in (1, 2)}
    rank0 = "".join(progress_record(n, 40, text) for n, text in texts.items())
    screen = drawn(rank0 + "epoch 0: val_acc 0.9\n" + progress_record(40, 40, "epoch 0, ETA 00:00", True))
    frames = [f.decode() for f in BAR_UPDATE.findall(screen) if b"step " in f]
    assert len(frames) == 4 and all(len(f) <= 59 for f in frames), frames  # 1, 2, 2 again below the line, 40
    assert "step 2/40" in frames[2] and "step 40/40" in frames[3] and "|" in frames[3], frames
    lines = screen.split(b"\n")
    assert lines[0].endswith(ERASE + b"epoch 0: val_acc 0.9"), "the line erases the bar and takes its place"
    assert screen.endswith(b"\n") and screen.count(b"step 40/40") == 1, screen
    labelled = drawn(rank0, label=b"[3] ")
    assert all(f.startswith(b"[3] ") and len(f) <= 59 for f in BAR_UPDATE.findall(labelled) if f)


def run_meter(monkeypatch, tty: str | None, steps: int = 12, longer: int = 0, **kwargs) -> tuple[str, str]:
    """What a Meter of ``steps`` steps writes to its terminal and its log file, with an echoed line; with
    ``longer``, the second epoch has that many more steps, told to the meter before it starts."""
    if tty is None:
        monkeypatch.delenv(TTY_ENV, raising=False)
    else:
        monkeypatch.setenv(TTY_ENV, tty)
    monkeypatch.setenv("COLUMNS", "72")  # the launcher's terminal
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
    out = terminal.getvalue()
    if tty == "1" and kwargs.get("progress", True):  # the rank sends records; the launcher draws the bar
        assert PROGRESS_RECORD in out and "\r" not in out, out
        out = drawn(out).decode()
    return out, log_file.getvalue()


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
    out = terminal.getvalue() if tty == "0" else drawn(terminal.getvalue()).decode()
    shown = [tuple(map(int, m)) for m in re.findall(r"step (\d+)/(\d+)", out)]
    assert shown[-1] == (10, 10) and shown.count((10, 10)) == 1, shown


@pytest.mark.parametrize("progress", [True, False])
def test_a_dynamic_runs_checkpoint_line_names_worker_0s_step_and_the_bars(progress):
    """Under dynamic assignment a checkpoint is named by worker 0's own steps while the bar counts the
    run's: the line says both, so `step 10/10` beside `checkpoint after step 4` is no puzzle (GoSGD showed
    `step 220/220` and `checkpoint after step 216`). Static: the checkpoint's step is the bar's."""
    meter = Meter(CommStats(), 2, 10, SimpleNamespace(write=lambda *a, **k: None), 5, progress=progress)
    for shown in (1, 4, 7, 9):
        for _ in meter.batches([0]):
            meter.step_done(shown, 0, 0.5, 8, 0.1, shown)
    meter.reach(10, 0)
    pace = Dynamic.__new__(Dynamic)
    pace.given = SimpleNamespace(meter=meter)
    words = pace.checkpoint_words(4, Position(4, 0, 1))
    assert words == "checkpoint after step 4 (worker 0's own steps; the run's: 10 of 10)"
    static = Static.__new__(Static).checkpoint_words(4, Position(4, 0, 4))
    assert static == "checkpoint after step 4 (epoch 0, batch 4)"  # the form tests/jobs read
    # a 2-epoch run's last checkpoint, at the start of the epoch it does not have: not "(epoch 2, batch 0)"
    last = Static.__new__(Static).checkpoint_words(10, Position(10, 2, 0))
    assert last == "checkpoint after step 10 (end of epoch 1)"


def test_nothing_drawn_with_progress_off(monkeypatch):
    out, _ = run_meter(monkeypatch, "1", progress=False)
    assert out == "epoch 0: val_acc 0.5\nepoch 1: val_acc 0.5\n"


STEPS = 20


def progress_argv(run_dir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "runner",
        f"hydra.run.dir={run_dir}",
        "train.progress=true",
        "train.epochs=1",
        f"train.max_steps={STEPS}",
        *extra,
    ]


def read_until_exit(proc: subprocess.Popen, master: int, timeout: float) -> list[tuple[float, bytes]]:
    """Everything written to the pseudo-terminal until the process ends (killed after ``timeout``), as
    (seconds since the start, bytes) in the order it came."""
    out, start = [], time.monotonic()
    while time.monotonic() < start + timeout:
        ready, _, _ = select.select([master], [], [], 0.5)
        if ready:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal
                break
            if not chunk:
                break
            out.append((time.monotonic() - start, chunk))
        elif proc.poll() is not None:
            break
    else:
        proc.kill()
        pytest.fail(f"no exit within {timeout} s; output so far:\n{b''.join(c for _, c in out)!r}")
    proc.wait(timeout=30)
    return out


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_bar_under_mpirun_in_a_terminal_is_live(tmp_path, pseudo_terminal):
    """Frames reach the terminal while the epoch runs (mpirun forwards whole lines: the launcher draws),
    at the terminal's width, and never reach the logs."""
    master, slave = pseudo_terminal
    set_size(slave, 30, 97)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("COLUMNS", None)
    slow = ("simulate.straggler_ranks=[0,1]", "simulate.straggler_ms=150")  # an epoch of about 3 s
    proc = subprocess.Popen(
        progress_argv(tmp_path / "run", *slow),
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=slave,
        env=env,
    )
    os.close(slave)
    came = read_until_exit(proc, master, timeout=240)
    out = b"".join(chunk for _, chunk in came)
    assert proc.returncode == 0, out.decode(errors="replace")
    frames = [
        (t, int(m.group(1)))
        for t, chunk in came
        for m in re.finditer(rb"\r\x1b\[K[^\r\n]*step (\d+)/", chunk)
    ]
    assert frames and frames[-1][1] == STEPS, out.decode(errors="replace")
    during = sorted({step: t for t, step in frames if step < STEPS}.items())
    assert len(during) >= 8, f"distinct frames before the last step: {during}"
    spread = during[-1][1] - during[0][1]
    assert spread >= 0.4 * STEPS * 0.15, f"the frames came together, not while the epoch ran: {during}"
    assert all(t1 <= t2 for (_, t1), (_, t2) in zip(during, during[1:], strict=False)), during
    updates = [u.decode() for u in BAR_UPDATE.findall(out) if b"step " in u]
    assert all(len(u) <= 97 for u in updates), updates
    before = out.split(b"\r", 1)[0].decode(errors="replace").splitlines()  # the lines before training
    assert before and all(len(line) <= 97 for line in before), before
    assert not any(line.startswith(("versions:", "topology:", "starting:", "[vm")) for line in before), before
    assert "samples/s" in updates[-1], updates[-1]
    assert PROGRESS_RECORD.encode() not in out, "records are drawn, not shown"
    for log in (tmp_path / "run" / "logs" / "rank0.log", tmp_path / "run" / "mpirun.log"):
        text = log.read_bytes()
        assert not BAR_UPDATE.search(text) and PROGRESS_RECORD.encode() not in text, log
    rank0 = (tmp_path / "run" / "logs" / "rank0.log").read_bytes()
    assert re.search(rb"epoch 0 \(\d+%\): ", rank0), "train.max_steps ended the run within the epoch"


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
