"""The launcher's supervision of a job: the terminal echo, stop signals, the grace period, the stall
watchdog. Jobs here are stand-in scripts (no MPI); the real-job tests are in test_failures.py."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import runner.launcher.job_output
import runner.launcher.supervise
import runner.launcher.watchdog
import runner.launcher.watches
from runner.launcher.echo import EchoFilter
from runner.launcher.supervise import Supervisor
from runner.launcher.watchdog import ask_stacks, lost_servers, outliving, read_beats, stall_check
from runner.launcher.watches import Watches
from runner.rank.records.heartbeat import Heartbeat

ABORT = b"""--------------------------------------------------------------------------
MPI_ABORT was invoked on rank 0 in communicator MPI_COMM_WORLD
  Proc: [[50001,1],0]
  Errorcode: 1

NOTE: invoking MPI_ABORT causes Open MPI to kill all MPI processes.
You may or may not see output from other processes, depending on
exactly when Open MPI kills them.
--------------------------------------------------------------------------
--------------------------------------------------------------------------
prterun has exited due to process rank 0 with PID 0 on node vm calling
"abort". This may have caused other processes in the application to be
terminated by signals sent by prterun (as reported here).
--------------------------------------------------------------------------
"""
KILLED = b"""--------------------------------------------------------------------------
prterun noticed that process rank 1 with PID 4084 on node vm exited on
signal 9 (Killed).
--------------------------------------------------------------------------
"""
TRACEBACK = b"""Traceback (most recent call last):
  File "/work/main/runner/worker.py", line 163, in main
    run(cfg, run_dir, comm, log_file, terminal)
RuntimeError: injected failure

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "x.py", line 1, in <module>
ValueError: bad
"""
WARNING = b"""--------------------------------------------------------------------------
WARNING: a note from Open MPI that is not an abort
--------------------------------------------------------------------------
"""


def echo(data: bytes, chunk: int | None = None) -> bytes:
    f = EchoFilter()
    step = chunk or len(data) or 1
    out = b"".join(f.feed(data[i : i + step]) for i in range(0, len(data), step)) + f.flush()
    assert f.tracebacks == data.count(b"Traceback (most recent call last):")
    return out


@pytest.mark.parametrize("chunk", [None, 1, 7])
def test_the_echo_hides_abort_banners_tracebacks_and_failed_lines_whatever_the_chunks(chunk):
    shown = b"epoch 0: val_acc 0.8\n"
    data = shown + TRACEBACK + b"rank 0 failed: RuntimeError: injected failure (x.py:3)\n" + ABORT + KILLED
    out = echo(data + b"last words\n\0", chunk)
    assert out == shown + b"\nlast words\n", out
    assert echo(WARNING, chunk) == WARNING, "other Open MPI notices are shown"
    assert echo(b"rank 0/2 on vm, cores [0]\nranking 3\n", chunk) == b"rank 0/2 on vm, cores [0]\nranking 3\n"


def test_the_echo_keeps_the_causes_it_hides():
    f = EchoFilter()
    f.feed(b"epoch 0\nrank 1 failed: OSError: [Errno 28] No space left on device (x.py:3)\nrank 0 failed: ")
    f.feed(b"MPIError: revoked\n")
    assert f.failures == [
        (1, "OSError: [Errno 28] No space left on device (x.py:3)"),
        (0, "MPIError: revoked"),
    ]


@pytest.mark.parametrize("chunk", [None, 1, 6])
def test_the_echo_leaves_mpiruns_binding_reports_to_the_log(chunk):
    bindings = b"[vm:10789] Rank 0 bound to package[0][core:L0]\n[node7:42] MCW rank 1 is not bound\n"
    kept = b"[rule.alpha=0.9] a labelled line\n[1, 2] a list\n2 more steps\n"
    assert echo(bindings + kept + bindings, chunk) == kept


@pytest.mark.parametrize("chunk", [None, 1, 9])
def test_the_echo_leaves_open_mpis_fault_tolerance_notes_to_the_log(chunk):
    dashes = b"-" * 74 + b"\n"
    untested = (
        b"WARNING: The selected 'osc' module 'sm' is not tested for post-failure\noperation, yet...\n\n"
    )
    more = b"2 more processes have sent help message help-mpi-ft.txt / module:untested:failundef\n"
    data = b"rank 0/3 on vm\n" + dashes + untested + b"failure scenarios: {}\n" + dashes + b"step 1\n" + more
    assert echo(data + b"epoch 0\n", chunk) == b"rank 0/3 on vm\nstep 1\nepoch 0\n"


@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_the_echo_hides_open_mpis_notes_on_revoked_collectives(chunk):
    note = b"NBC_Progress: an error 77 was found during schedule 0x56 - aborting the schedule\n"
    lost = b"rank 2 (vm) lost at step 29; continuing with 3 workers (recovered in 0.01 s)\n"
    data = b"epoch 1: val_acc 0.8\n" + (note + b"\n") * 3 + lost + b"\nepoch 2\n"
    assert echo(data, chunk) == b"epoch 1: val_acc 0.8\n" + lost + b"\nepoch 2\n"


@pytest.mark.parametrize("chunk", [None, 1, 5])
def test_the_echo_hides_prteruns_last_words_after_a_job_that_spawned(chunk):
    data = b"epoch 5: val_acc 0.98\ncheckpoint after step 98\nLAUNCHER JOB OBJECT NOT FOUND"
    assert echo(data, chunk) == b"epoch 5: val_acc 0.98\ncheckpoint after step 98\n"
    assert echo(data + b"\n", chunk) == b"epoch 5: val_acc 0.98\ncheckpoint after step 98\n"


def test_progress_bars_pass_at_once():
    f = EchoFilter()
    assert f.feed(b"\r 10%|#         | 3/30") == b"\r 10%|#         | 3/30"
    assert f.feed(b"\r 20%|##        | 6/30") == b"\r 20%|##        | 6/30"
    assert f.feed(b"\n") == b"\n"
    assert f.feed(b"--") == b"", "could open a banner: held"
    assert f.feed(b"-" * 70 + b"\nnot a banner\n") == b"-" * 72 + b"\nnot a banner\n"
    assert f.feed(b"half a line") == b"half a line" and f.flush() == b""


def beat(step, progress, alive, **extra):
    return {"rank": 0, "pid": 100, "host": "h", "role": "worker", "step": step, **extra} | {
        "progress_time": progress,
        "alive_time": alive,
    }


def test_a_stopped_rank_is_named_not_the_ones_waiting_for_it():
    now = 1000.0
    beats = {0: beat(57, 975, 999.5), 1: beat(57, 975, 980, pid=123)}
    stall = stall_check(beats, now, launch_time=900, timeout=20)
    assert stall.ranks == [1]
    assert stall.message == (
        "rank 1 (host h, pid 123) not responding for 20 s (its last heartbeat: step 57); "
        "no rank made progress for 25 s"
    )
    assert stall_check(beats, now, 900, timeout=30) is None


def test_blocked_ranks_name_the_lowest_step_and_a_server_that_does_not_answer():
    now = 1000.0
    behind = {0: beat(58, 970, 999), 1: beat(57, 970, 999, pid=7), 2: beat(58, 999, 999)}
    stall = stall_check(behind, now, 900, 20)
    assert stall.ranks == [1]
    assert stall.message == "rank 1 (host h, pid 7) stuck at step 57; ranks 0, 1 made no progress for 30 s"
    server = {0: beat(5, 970, 999), 1: beat(-1, 970, 999, role="server", pid=9)}
    assert stall_check(server, now, 900, 20).message.startswith("server rank 1 (host h, pid 9) stuck;")


def test_a_rank_that_never_beat_counts_from_the_launch():
    beats = {0: beat(3, 995, 999), 1: None}
    assert stall_check(beats, 1000, launch_time=990, timeout=20) is None
    stall = stall_check(beats, 1000, launch_time=970, timeout=20)
    assert stall.ranks == [1] and stall.message.startswith("rank 1 sent no heartbeat since the launch")


def test_read_beats_skips_old_finished_and_torn_beats(tmp_path):
    write = lambda r, b: (tmp_path / f"rank{r}.beat").write_text(json.dumps(b))  # noqa: E731
    write(0, beat(1, 50, 50))
    write(1, beat(4, 150, 150))
    write(2, beat(9, 150, 150, done=True))
    seen: dict[int, dict] = {}
    beats = read_beats(tmp_path, 4, launch_time=100, previous=seen)
    assert beats == {0: None, 1: beat(4, 150, 150), 3: None}, "rank 0's beat is a previous job's"
    (tmp_path / "rank1.beat").write_text('{"rank": 1, "st')
    assert read_beats(tmp_path, 2, 100, seen)[1] == beat(4, 150, 150), "a torn read keeps the last beat"
    (tmp_path / "rank1.beat").unlink()
    assert 1 not in read_beats(tmp_path, 2, 100, seen), "a beat file removed after it was seen: finished"


ORPHAN = """
import json, os, socket, sys, time
run, lives = sys.argv[1], float(sys.argv[2])
def beat(**extra):
    path = os.path.join(run, "logs", "rank0.beat")
    record = {"rank": 0, "pid": os.getpid(), "host": socket.gethostname(), "role": "worker", "step": 5,
              "progress_time": time.time(), "alive_time": time.time(), **extra}
    open(path + ".tmp", "w").write(json.dumps(record)); os.replace(path + ".tmp", path)
start = time.time()
while time.time() - start < lives:
    beat(); time.sleep(0.2)
open(os.path.join(run, "late_checkpoint"), "w").write(repr(time.time()))
beat(done=True)
"""

STAND_IN = (
    f"ORPHAN = {ORPHAN!r}\n"
    + """
import json, os, signal, sys, time
run, mode = sys.argv[1], sys.argv[2]
def beat(rank, step, progress):
    path = os.path.join(run, "logs", f"rank{rank}.beat")
    record = {"rank": rank, "pid": os.getpid(), "host": "h", "role": "worker", "step": step,
              "progress_time": progress, "alive_time": time.time()}
    open(path + ".tmp", "w").write(json.dumps(record)); os.replace(path + ".tmp", path)
if mode == "chatty":
    for i in range(20000):
        print(f"line {i} " + "x" * 100)
    sys.exit(0)
if mode in ("ignore", "agent"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "agent":  # a launch agent in a process group of its own (PRRTE's ssh), holding the output
    import subprocess
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    agent = subprocess.Popen([sys.executable, "-c", code], process_group=0)
    open(os.path.join(run, "agent"), "w").write(str(agent.pid))
if mode.startswith("orphan"):  # a rank that outlives its runtime, out of the job's session (PRRTE's)
    import subprocess
    lives = "1.0" if mode == "orphan" else "60"
    subprocess.Popen([sys.executable, "-c", ORPHAN, run, lives, "runner.rank"], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while not os.path.exists(os.path.join(run, "logs", "rank0.beat")):
        time.sleep(0.01)
    sys.exit(1)
print("started", flush=True)
open(os.path.join(run, "ready"), "w").close()
start = time.time()
summary = os.path.join(run, "summary.json")
while time.time() - start < 60:
    if mode == "preempt" and os.path.exists(os.path.join(run, "STOP")):
        print("stopping on", open(os.path.join(run, "STOP")).read().strip(), flush=True)
        json.dump({"status": "preempted"}, open(os.path.join(run, "summary.json"), "w"))
        sys.exit(0)
    if mode in ("agent", "beating") and time.time() - start > 0.1 and not os.path.exists(summary + "_time"):
        json.dump({"status": "ok"}, open(summary, "w"))  # rank 0's last write; mpirun then waits on
        open(summary + "_time", "w").write(repr(time.time()))  # a daemon that is gone
    if mode == "beating":  # a rank elsewhere still beating after rank 0's summary (writing its model)
        beat(1, 5, start)
    if mode == "beats":
        beat(0, 5, start)
        if time.time() - start < 0.5:
            beat(1, 5, start)
    if mode == "server_dies":  # worker 0 blocked (beating, no progress); server rank 1's process ended
        beat(0, 5, start)
        if not os.path.exists(os.path.join(run, "logs", "rank1.beat")):
            import socket, subprocess
            gone = subprocess.Popen([sys.executable, "-c", ""]); gone.wait()
            record = {"rank": 1, "pid": gone.pid, "host": socket.gethostname(), "role": "worker",
                      "step": -1, "progress_time": start, "alive_time": time.time()}
            open(os.path.join(run, "logs", "rank1.beat"), "w").write(json.dumps(record))
            open(os.path.join(run, "server_gone"), "w").write(repr(time.time()))
    time.sleep(0.1)
"""
)


@pytest.fixture
def job(tmp_path, monkeypatch):
    """Call with a mode: a Supervisor of the stand-in job in that mode, in ``tmp_path``."""
    monkeypatch.setattr(runner.launcher.supervise, "TERM_TIMEOUT_S", 1.0)
    script = tmp_path / "stand_in.py"
    script.write_text(STAND_IN)
    (tmp_path / "logs").mkdir()

    def make(mode: str, stall_timeout: float | None = None, servers: tuple[int, ...] = ()) -> Supervisor:
        argv = [sys.executable, str(script), str(tmp_path), mode]
        return Supervisor(argv, tmp_path, 2, stall_timeout, servers=servers)

    return make


def signal_when_ready(run_dir: Path, *signums: int) -> threading.Thread:
    """Send this process ``signums`` (0.3 s apart) once the stand-in job has started."""

    def send() -> None:
        deadline = time.time() + 20
        while not (run_dir / "ready").exists() and time.time() < deadline:
            time.sleep(0.05)
        for signum in signums:
            os.kill(os.getpid(), signum)
            time.sleep(0.3)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_stop_signal_asks_the_ranks_to_stop_and_the_job_goes_on_until_they_do(job, tmp_path, capfd, signum):
    before = signal.getsignal(signum)
    signal_when_ready(tmp_path, signum)
    outcome = job("preempt").run()
    name = signal.Signals(signum).name
    assert (outcome.returncode, outcome.signal, outcome.interrupted) == (0, name, None)
    assert (tmp_path / "STOP").read_text() == f"{name}\n"
    assert f"stopping on {name}" in (tmp_path / "mpirun.log").read_text()
    assert f"stopping on {name}" in capfd.readouterr().out
    assert signal.getsignal(signum) == before, "the launcher's own handlers are put back"


def test_a_job_that_does_not_stop_within_the_grace_period_is_ended(job, tmp_path, monkeypatch):
    monkeypatch.setattr(runner.launcher.watches, "GRACE_S", 1.0)
    signal_when_ready(tmp_path, signal.SIGTERM)
    start = time.time()
    outcome = job("ignore").run()
    assert outcome.returncode != 0 and outcome.signal == "SIGTERM"
    assert outcome.interrupted == "the job did not stop within 1 s of SIGTERM"
    assert time.time() - start < 10, "grace 1 s + SIGTERM ignored + SIGKILL after 1 s"


def test_a_second_signal_ends_the_job_at_once(job, tmp_path):
    signal_when_ready(tmp_path, signal.SIGINT, signal.SIGINT)
    start = time.time()
    outcome = job("ignore").run()
    assert outcome.interrupted == "a second signal (SIGINT)" and outcome.returncode != 0
    assert time.time() - start < 10


def test_the_watchdog_ends_a_stalled_job_and_names_the_silent_rank(job, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(runner.launcher.watchdog, "NOT_RESPONDING_S", 0.5)
    start = time.time()
    outcome = job("beats", stall_timeout=2.0).run()
    assert outcome.stall is not None and outcome.stall.ranks == [1], outcome
    assert "(its last heartbeat: step 5)" in outcome.stall.message, outcome.stall.message
    assert outcome.stall.message.startswith("rank 1 (host h, pid ") and "not responding for " in (
        outcome.stall.message
    )
    assert time.time() - start < 8
    warnings = [
        r for r in caplog.records if r.levelname == "WARNING" and "the job is ended after" in r.message
    ]
    assert len(warnings) == 1 and warnings[0].message.startswith("rank 1 (host h"), "one at half the timeout"
    assert "ending the job: stalled: rank 1" in caplog.text


def test_a_stall_has_the_ranks_of_this_machine_still_running_write_where_they_wait(tmp_path):
    (tmp_path / "logs").mkdir()
    stacks = tmp_path / "logs" / "rank3.stacks"
    here, beat = socket.gethostname(), Heartbeat(tmp_path, 3)
    try:
        others = {4: {"host": "elsewhere", "pid": os.getpid()}, 5: None}
        assert ask_stacks({3: {"host": here, "pid": os.getpid()}, **others}, here) == [3]
        deadline = time.time() + 5
        while "test_a_stall_has" not in stacks.read_text() and time.time() < deadline:
            time.sleep(0.05)
    finally:
        beat.close()
    written = stacks.read_text()
    assert "Thread 0x" in written and "heartbeat.py" in written, "every thread: the heartbeat's too"
    assert "in test_a_stall_has_the_ranks_of_this_machine_still_running_write_where_they_wait" in written


def test_a_rank_never_asked_leaves_no_stacks_file(tmp_path):
    (tmp_path / "logs").mkdir()
    Heartbeat(tmp_path, 0).close()
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["rank0.beat"]


def test_a_job_whose_server_process_ended_is_ended_naming_it_after_the_grace(job, tmp_path, monkeypatch):
    """A worker blocked where MPI does not report the server's loss keeps beating: the launcher sees the
    server's process gone and ends the job SERVER_LOSS_GRACE_S later, long before the stall watchdog."""
    monkeypatch.setattr(runner.launcher.watches, "SERVER_LOSS_GRACE_S", 1.0)
    outcome = job("server_dies", stall_timeout=30.0, servers=(1,)).run()
    ended = time.time()
    gone = float((tmp_path / "server_gone").read_text())
    assert outcome.lost is not None and outcome.lost.ranks == [1] and outcome.stall is None, outcome
    assert outcome.lost.message.startswith(f"server rank 1 (host {socket.gethostname()}, pid ")
    assert "was lost at step 5: its process ended" in outcome.lost.message, outcome.lost.message
    assert 1.0 <= ended - gone < 1.0 + 1.0 + 3.0, "the grace, a tick, SIGTERM's wait, and slack"


def test_a_server_process_elsewhere_or_alive_is_not_taken_for_lost(tmp_path):
    """Only this machine's processes are looked at; a live one, or a worker's ended one, is not a loss."""
    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()
    here = socket.gethostname()
    beats = {
        0: beat(5, 0.0, 0.0, pid=ended.pid, host=here),  # a worker's process ended: fault tolerance's
        1: beat(-1, 0.0, 0.0, pid=os.getpid(), host=here),
        2: beat(-1, 0.0, 0.0, pid=ended.pid, host="elsewhere"),
        3: None,
    }
    assert lost_servers(beats, [1, 2, 3]) is None
    assert lost_servers({**beats, 1: beat(-1, 0.0, 0.0, pid=ended.pid, host=here)}, [1, 2, 3]).ranks == [1]


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and is no zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_an_mpirun_outliving_the_jobs_summary_is_ended_after_the_grace(job, tmp_path, monkeypatch, caplog):
    """A cut link leaves mpirun waiting for a daemon it cannot reach after rank 0 wrote the final
    summary.json: the launcher ends it SUMMARY_GRACE_S later, not before, and the job counts as ended by
    its summary (status 0 here), not by the launcher's SIGTERM. PRRTE starts its launch agents (ssh) in
    process groups of their own, in mpirun's session: they end too (killing mpirun's group alone left them
    running, holding the job's output, which the launcher then waited for twice TERM_TIMEOUT_S)."""
    monkeypatch.setattr(runner.launcher.watches, "SUMMARY_GRACE_S", 0.6)
    (tmp_path / "summary.json").write_text('{"status": "failed"}')  # a previous job's: not this one's end
    os.utime(tmp_path / "summary.json", (time.time() - 60, time.time() - 60))
    outcome = job("agent").run()
    ended = time.time()
    written = float((tmp_path / "summary.json_time").read_text())
    assert outcome.after_summary and outcome.returncode == 0, outcome
    assert 0.6 <= ended - written < 0.6 + 1.0 + 1.0 + 1.5, "the grace, a tick, SIGTERM's wait, and slack"
    assert re.search(r"mpirun is still running [12] s after the job wrote its summary.json \(", caplog.text)
    agent, deadline = int((tmp_path / "agent").read_text()), time.time() + 5
    while running(agent) and time.time() < deadline:  # (SIGKILL is sent; the process ends when scheduled)
        time.sleep(0.05)
    assert not running(agent), "the launch agent outlived the job"


@pytest.mark.parametrize("mode", ["agent", "beating"])
def test_once_every_rank_ended_mpirun_outliving_the_summary_is_ended_sooner(
    job, tmp_path, monkeypatch, caplog, mode
):
    """Once no rank runs (their heartbeats ended, here: none beat), mpirun is ended ENDED_GRACE_S after
    rank 0's summary, not SUMMARY_GRACE_S; a rank elsewhere still beating (writing its files) holds it."""
    monkeypatch.setattr(runner.launcher.watches, "SUMMARY_GRACE_S", 1.5)
    monkeypatch.setattr(runner.launcher.watches, "ENDED_GRACE_S", 0.3)
    monkeypatch.setattr(runner.launcher.watches, "WATCH_INTERVAL_S", 0.2)
    outcome = job(mode).run()
    waited = time.time() - float((tmp_path / "summary.json_time").read_text())
    assert outcome.after_summary and outcome.returncode == 0, outcome
    if mode == "agent":
        assert waited < 0.3 + 0.4 + 1.0 + 0.5, "the grace, two ticks, SIGTERM's wait and slack"
        assert "after the job wrote its summary.json and its ranks ended (waiting for" in caplog.text
    else:
        assert waited >= 1.5 and "its ranks ended" not in caplog.text, caplog.text


def test_each_watch_reads_the_heartbeats_once(tmp_path, monkeypatch):
    """Before the job's summary the server and stall checks, after it the outliving and stall checks, share
    one reading of the heartbeats per watch (one file per rank, every second)."""
    readings = []
    real = runner.launcher.watches.read_beats
    monkeypatch.setattr(runner.launcher.watches, "read_beats", lambda *a: readings.append(1) or real(*a))
    watches = Watches(tmp_path, 2, time.time() - 1, 60.0, (1,), lambda pid: False, print)
    (tmp_path / "logs").mkdir()
    now = time.time()
    assert watches.tick(now) is None
    (tmp_path / "summary.json").write_text("{}")
    for later in (2, 4):  # the watch that sees the summary, then one after it
        assert watches.tick(now + later) is None
    assert watches.summary.since is not None
    assert readings == [1, 1, 1]


class FullDisk(io.BytesIO):
    """A file on a full disk: every write fails."""

    def write(self, data) -> int:
        raise OSError(28, "No space left on device")


def test_a_full_disk_under_mpirun_log_neither_hangs_nor_silences_the_job(
    job, tmp_path, capfd, caplog, monkeypatch
):
    """Writing the log fails (the disk is full): said once, and the job's output is still drained (a
    job whose pipe is not read blocks forever) and shown."""
    monkeypatch.setattr(runner.launcher.job_output, "open_in_folder", lambda path, mode: FullDisk())
    outcome = job("chatty").run()
    assert outcome.returncode == 0
    assert (
        caplog.text.count(f"cannot write {tmp_path / 'mpirun.log'}: [Errno 28] No space left on device") == 1
    )
    assert capfd.readouterr().out.count("\nline ") == 19999


def orphan_beat(pid: int, alive: float, host: str = "here") -> dict:
    return {"rank": 0, "pid": pid, "host": host, "step": 3, "progress_time": alive, "alive_time": alive}


def test_a_rank_outliving_mpirun_is_told_by_its_process_here_and_by_its_heartbeat_elsewhere():
    beats = {
        0: orphan_beat(10, 990.0),  # here, alive though its beat is old
        1: orphan_beat(11, 999.5),  # here, its process gone though its beat is fresh
        2: orphan_beat(12, 999.0, host="far"),  # elsewhere, beating
        3: orphan_beat(13, 997.0, host="far"),  # elsewhere, silent for 3 s
        4: None,
    }
    running = outliving(beats, 1000.0, "here", alive=lambda pid: pid == 10)
    assert sorted(running) == [0, 2]


def test_the_launcher_reads_the_job_after_a_rank_that_outlived_mpirun_has_written(job, tmp_path):
    """A rank goes on 1 s after its runtime ended (a node was lost; the rank writes a checkpoint): the
    supervisor returns after that write, not before, so the launcher names the checkpoint it left."""
    outcome = job("orphan").run()
    returned = time.time()
    assert outcome.returncode == 1
    assert (tmp_path / "late_checkpoint").exists(), "returned before the outliving rank's last write"
    assert returned - float((tmp_path / "late_checkpoint").read_text()) < 1.0


def test_a_rank_outliving_mpirun_on_this_machine_is_killed_after_the_wait(job, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(runner.launcher.supervise, "OUTLIVED_WAIT_S", 1.0)
    start = time.time()
    outcome = job("orphan_forever").run()
    assert outcome.returncode == 1 and time.time() - start < 6
    pid = json.loads((tmp_path / "logs" / "rank0.beat").read_text())["pid"]
    assert f"rank 0 (host {socket.gethostname()}, pid {pid}) outlived mpirun by 1 s: killed" in caplog.text
    for _ in range(50):
        if not Path(f"/proc/{pid}").exists() or b"runner.rank" not in _cmdline(pid):
            break
        time.sleep(0.1)
    else:
        pytest.fail(f"the outliving rank {pid} still runs")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def test_the_launchers_own_lines_about_a_sweep_point_carry_its_label(tmp_path, caplog):
    """Points of a parallel sweep run at once: "ending the job: ..." must say whose job it is."""
    output = runner.launcher.job_output.JobOutput(tmp_path, "rule.alpha=0.1")
    with caplog.at_level("WARNING", logger="runner"):
        output.say("ending the job: a rank failed with an error and the others did not stop")
        runner.launcher.job_output.JobOutput(tmp_path).say("a single job's line")
    assert [r.getMessage() for r in caplog.records] == [
        "[rule.alpha=0.1] ending the job: a rank failed with an error and the others did not stop",
        "a single job's line",
    ]
