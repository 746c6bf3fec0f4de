"""Supervising a running job: its output, the launcher's signals, and the ranks' heartbeats.

The job runs in a session of its own, so nothing reaches it but what the launcher sends:

- **Output.** Everything the job prints goes to ``mpirun.log`` as it comes; the terminal gets the same
  bytes less what would bury the cause under noise: Open MPI's abort banners (``MPI_ABORT was invoked``,
  ``prterun has exited due to ...``, ``... noticed that process rank``), Python tracebacks and the ranks'
  own ``rank N failed:`` lines. The launcher's last line names the cause. Rank 0's progress records go to
  neither: the launcher draws the progress bar from them (:mod:`runner.launcher.progress`).
- **Signals.** SIGTERM, SIGUSR1 (Slurm's ``--signal``, ``scancel``) and SIGINT (Ctrl-C) write
  ``RUN_DIR/STOP`` holding the signal's name; the ranks then finish their step, write a checkpoint and
  exit. A second signal, or :data:`GRACE_S` without the job ending, ends it at once. A sweep point's job
  also takes its sweep's stop requests as its own signals (:mod:`runner.launcher.sweep_stop`).
- **A job that does not end after its summary.** Rank 0 writes ``summary.json`` last; an ``mpirun`` still
  running :data:`SUMMARY_GRACE_S` later is waiting for something that will not come (a daemon on a node it
  cannot reach since a cut link) and is ended; the job counts as ended by its summary's status.
- **Stalls.** With ``train.stall_timeout`` set, the ranks' heartbeats (``logs/rank<r>.beat``) are read
  every second; :func:`stall_check` decides, from them alone, whether and which ranks are stuck.

Ending a job is SIGTERM to its process group, then SIGKILL to its whole session after :data:`TERM_TIMEOUT_S`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from runner.folder_files import is_regular, open_in_folder
from runner.launcher import sweep_stop
from runner.launcher.echo import EchoFilter
from runner.launcher.progress import Bar, ProgressTap
from runner.launcher.session_dir import session_dir
from runner.launcher.watchdog import Stall, ask_stacks, lost_servers, outliving, read_beats, stall_check
from runner.run_folder import LOGS, MPIRUN_LOG, STACKS, STOP, SUMMARY, rank_file_name, write_atomic

#: Seconds the ranks get, after the first stop signal, to checkpoint and exit before the job is killed.
GRACE_S = 120.0
#: Seconds between SIGTERM and SIGKILL when the launcher ends a job.
TERM_TIMEOUT_S = 5.0
#: Seconds the ranks are given to write their stacks (a signal handler's few writes) before the job is ended.
STACKS_WAIT_S = 0.5
#: Seconds between two readings of the heartbeats.
WATCH_INTERVAL_S = 1.0
#: A rank that failed with an error aborts the job (MPI_Abort); under ULFM (fault_tolerance=continue) the
#: other ranks are not stopped by it, so the job is ended this long after the rank's error file appeared.
FAILED_RANK_GRACE_S = 3.0
#: Seconds a server rank's process may be gone, with no rank's error file, before the job is ended (the
#: workers that notice the loss write one, naming the step, within about a second).
SERVER_LOSS_GRACE_S = 5.0
#: Seconds mpirun may outlive the job's final summary.json (rank 0's last write) before it is ended: rank
#: 0's own model files are written before it, the other ranks' within seconds; mpirun itself can wait forever
#: for a daemon it lost the link to.
SUMMARY_GRACE_S = 12.0
#: Seconds mpirun may outlive the job's final summary.json once every rank has ended (its heartbeat said so,
#: or its process here is gone, or, elsewhere, its heartbeat went silent): a healthy mpirun ends well within.
ENDED_GRACE_S = 5.0
#: Seconds the launcher waits, after mpirun ended, for ranks that outlived it (a rank on a node the runtime
#: did not lose can go on writing checkpoints) before it reads what the job left; those on this machine
#: are then killed.
OUTLIVED_WAIT_S = 5.0
STOP_SIGNALS = sweep_stop.STOP_SIGNALS


@dataclass
class Outcome:
    """How a job ended. ``signal``: the first stop signal the launcher got; ``interrupted``: why the launcher
    killed the job after one (a second signal, the grace period); ``stall``: the watchdog ended it."""

    returncode: int
    signal: str | None = None
    interrupted: str | None = None
    stall: Stall | None = None
    log_start: int = 0  # where this job's output starts in mpirun.log (a resumed run appends to it)
    stop_time: float | None = None  # when the first stop signal came
    said: tuple[tuple[int, str], ...] = ()  # the ranks' ``rank N failed: cause`` lines, as (rank, cause)
    after_summary: bool = False  # ended by the launcher SUMMARY_GRACE_S after the job's final summary.json
    lost: Stall | None = None  # ended by the launcher: server ranks whose process ended, no rank said so


def _die_with_parent() -> None:
    """In the mpirun child: SIGTERM when the launcher dies, even by SIGKILL (Linux), so no job is orphaned."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _log(text: str) -> None:
    logging.getLogger("runner").warning(text)


class Supervisor:
    """Starts ``argv`` and watches it to the end (:meth:`run`). Call from the main thread to handle
    signals (elsewhere, e.g. in a sweep launcher's thread, signals are left alone)."""

    def __init__(
        self,
        argv: list[str],
        run_dir: Path,
        ranks: int,
        stall_timeout: float | None,
        label: str | None = None,
        env: Mapping[str, str] | None = None,
        servers: Sequence[int] = (),
    ):
        self.argv, self.run_dir, self.ranks, self.stall_timeout = argv, run_dir, ranks, stall_timeout
        self.servers = tuple(servers)  # the rule's server ranks: their loss ends the job
        self.servers_gone_since: float | None = None
        self.env = {**os.environ, **(env or {})}  # hardware.env: mpirun's -x KEY reads them here
        self.prefix = f"[{label}] ".encode() if label else b""
        self.line_start = True
        self.signals: list[str] = []  # the stop requests: this launcher's signals, or its sweep's
        self.heard = 0  # the stop signals this launcher had
        self.stop_time: float | None = None
        self.ending_since: float | None = None
        self.killed = False
        self.interrupted: str | None = None
        self.stall: Stall | None = None
        self.lost: Stall | None = None  # server ranks whose process ended (_check_servers)
        self.warned: Stall | None = None
        self.beats: dict[int, dict] = {}
        self.next_watch = 0.0
        self.failed_since: float | None = None
        self.summary_since: float | None = None  # when this job's summary.json was first seen
        self.ended_since: float | None = None  # since when, after it, no rank has been running
        self.after_summary = False
        self.filter = EchoFilter()
        self.tap = ProgressTap()
        self.bar = Bar(prefix=self.prefix)

    def run(self) -> Outcome:
        """Run the job to its end and say how it ended. Any exception here ends the job first. mpirun's
        session files go to a folder of this job's, removed after it (:mod:`runner.launcher.session_dir`)."""
        with session_dir(self.env) as env:
            return self._run(env)

    def _run(self, env: dict[str, str]) -> Outcome:
        previous = self._install_handlers()
        self.proc: subprocess.Popen | None = None
        log = self.run_dir / MPIRUN_LOG
        log_start = log.stat().st_size if is_regular(log) else 0
        try:
            self.launch_time = time.time()
            self.proc = subprocess.Popen(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            reader = threading.Thread(target=self._copy_output, name="job-output", daemon=True)
            reader.start()
            while True:
                try:
                    status = self.proc.wait(timeout=0.25)
                    break
                except subprocess.TimeoutExpired:
                    self._tick(time.time())
            reader.join(timeout=TERM_TIMEOUT_S)
            if reader.is_alive():  # processes of the job that outlived mpirun still hold the output
                self._signal_group(signal.SIGKILL)
                reader.join(timeout=TERM_TIMEOUT_S)
            if self.ending_since is None:  # (a job the launcher ended was killed whole)
                self._await_outliving()
        except BaseException:
            self._signal_group(signal.SIGKILL)
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        if status == 0 and self.filter.tracebacks:
            self._say(f"the job printed {self.filter.tracebacks} Python traceback(s): see mpirun.log")
        first = self.signals[0] if self.signals else None
        said = tuple(self.filter.failures)
        if self.after_summary:
            status = 0  # the job's own end is its summary's; mpirun's is the launcher's SIGTERM
        return Outcome(
            status,
            first,
            self.interrupted,
            self.stall,
            log_start,
            self.stop_time,
            said,
            self.after_summary,
            self.lost,
        )

    def _await_outliving(self) -> None:
        """Wait up to :data:`OUTLIVED_WAIT_S` for the ranks that outlived mpirun, so that what the job left
        (its last checkpoint) is read after its last write; kill those on this machine that go on, and
        name those elsewhere."""
        host, deadline = socket.gethostname(), time.time() + OUTLIVED_WAIT_S
        while True:
            beats = read_beats(self.run_dir / LOGS, self.ranks, self.launch_time, self.beats)
            running = outliving(beats, time.time(), host, _is_rank)
            if not running or time.time() >= deadline:
                break
            time.sleep(0.1)
        for rank, beat in running.items():
            where = f"rank {rank} (host {beat.get('host')}, pid {beat.get('pid')})"
            if beat.get("host") == host:
                _kill(int(beat["pid"]))
                self._say(f"{where} outlived mpirun by {OUTLIVED_WAIT_S:.0f} s: killed")
            else:
                self._say(f"{where} still runs {OUTLIVED_WAIT_S:.0f} s after mpirun ended: end it there")

    def _say(self, text: str) -> None:
        """One of the launcher's own lines, above the progress bar."""
        self.bar.above(lambda: _log(text))

    def _install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        self.heard += 1
        if self.heard > len(self.signals):  # (not yet taken from the sweep's stop: the same request)
            self._request(name)
        if (said := sweep_stop.heard(name)) is not None:  # the sweep this job is a point of stops too
            self._say(said)

    def _request(self, name: str) -> None:
        """A stop request (signal ``name``, this launcher's or its sweep's).

        The first has the ranks checkpoint and stop, a second ends the job at once (:meth:`_tick`)."""
        self.signals.append(name)
        if len(self.signals) > 1 or self.ending_since is not None:
            return
        self.stop_time = time.time()
        try:
            write_atomic(self.run_dir / STOP, name + "\n")
        except OSError as err:
            self._end(f"{name}, and the ranks could not be told to stop ({err})", interrupted=True)
            return
        self._say(
            f"{name}: the ranks will checkpoint and stop after their current step; a second signal, or "
            f"{GRACE_S:.0f} s without the job ending, ends it at once"
        )

    def _tick(self, now: float) -> None:
        if self.ending_since is not None:
            if not self.killed and now - self.ending_since > TERM_TIMEOUT_S:
                self._signal_group(signal.SIGKILL)
                self.killed = True
            return
        for name in sweep_stop.requested()[len(self.signals) :]:  # its sweep's (its sweeping process's)
            self._request(name)
        if len(self.signals) > 1:
            self._end(f"a second signal ({self.signals[1]})", interrupted=True)
        elif self.stop_time is not None and now - self.stop_time > GRACE_S:
            self._end(f"the job did not stop within {GRACE_S:.0f} s of {self.signals[0]}", interrupted=True)
        elif now >= self.next_watch:
            self.next_watch = now + WATCH_INTERVAL_S
            self._check_errors(now)
            self._watch_beats(now)

    def _watch_beats(self, now: float) -> None:
        """The checks that read the ranks' heartbeats, from one reading of them: after the job's summary,
        whether mpirun outlives it; before it, a lost server; and stalls."""
        after_summary = self.summary_since is not None
        if not after_summary and self._summary_written():
            self.summary_since = now
        servers = bool(self.servers) and self.failed_since is None and self.summary_since is None
        if not (after_summary or servers or self.stall_timeout) or self.ending_since is not None:
            return  # (nothing reads them, or the job is being ended: by a rank's error just now)
        beats = read_beats(self.run_dir / LOGS, self.ranks, self.launch_time, self.beats)
        if after_summary:
            self._check_summary(now, beats)
        if servers and self.ending_since is None:
            self._check_servers(now, beats)
        if self.stall_timeout and self.ending_since is None:
            self._watch(now, beats)

    def _summary_written(self) -> bool:
        """Whether this job wrote its summary.json (rank 0's last write)."""
        try:
            return (self.run_dir / SUMMARY).stat().st_mtime >= self.launch_time
        except OSError:
            return False

    def _check_errors(self, now: float) -> None:
        """End a job that goes on after one of its ranks failed with an error."""
        if self.failed_since is None:
            errors = (self.run_dir / LOGS).glob("rank*.error")
            if any(e.stat().st_mtime >= self.launch_time for e in errors):
                self.failed_since = now
        elif now - self.failed_since > FAILED_RANK_GRACE_S:
            self._end("a rank failed with an error and the others did not stop")

    def _check_servers(self, now: float, beats: Mapping[int, dict | None]) -> None:
        """End a job whose server rank's process ended, if no rank said so (an error file) within
        :data:`SERVER_LOSS_GRACE_S` and the job wrote no summary: a worker blocked where MPI does not report
        the loss would otherwise wait for the stall watchdog."""
        lost = lost_servers(beats, self.servers)
        if lost is None:
            self.servers_gone_since = None
        elif self.servers_gone_since is None:
            self.servers_gone_since = now
        elif now - self.servers_gone_since > SERVER_LOSS_GRACE_S:
            self.lost = lost
            self._end(lost.message)

    def _check_summary(self, now: float, beats: Mapping[int, dict | None]) -> None:
        """End an mpirun that outlives the job's final summary.json (seen at ``summary_since``) by
        :data:`SUMMARY_GRACE_S`, or by :data:`ENDED_GRACE_S` once none of the job's ranks is running."""
        assert self.summary_since is not None
        if outliving(beats, now, socket.gethostname(), _is_rank):
            self.ended_since = None
        elif self.ended_since is None:
            self.ended_since = now
        ended = self.ended_since is not None and now - self.ended_since > ENDED_GRACE_S
        if (ended or now - self.summary_since > SUMMARY_GRACE_S) and self.ending_since is None:
            self.after_summary = True
            self._end(
                f"mpirun is still running {now - self.summary_since:.0f} s after the job wrote its "
                "summary.json"
                + (" and its ranks ended" if ended else "")
                + " (waiting for a node it cannot reach?)"
            )

    def _watch(self, now: float, beats: Mapping[int, dict | None]) -> None:
        stall = stall_check(beats, now, self.launch_time, self.stall_timeout)
        if stall is not None:
            self.stall = stall
            self._end(f"stalled: {stall.message}{self._stacks(beats)}")
            return
        warning = stall_check(beats, now, self.launch_time, self.stall_timeout / 2)
        if warning is not None and self.warned is None:
            self._say(
                f"{warning.message}; the job is ended after {self.stall_timeout:.0f} s without "
                "progress (train.stall_timeout)"
            )
        self.warned = warning

    def _stacks(self, beats: Mapping[int, dict | None]) -> str:
        """What to add to the stall's line: where the ranks of this machine still running wait."""
        asked = ask_stacks(beats, socket.gethostname())
        time.sleep(STACKS_WAIT_S if asked else 0)
        files = ", ".join(f"{LOGS}/{rank_file_name(r, STACKS)}" for r in asked)
        return f" (where the ranks still running wait: {files})" if asked else ""

    def _end(self, reason: str, interrupted: bool = False) -> None:
        if interrupted:
            self.interrupted = reason
        self._say(f"ending the job: {reason}")
        self.ending_since = time.time()
        self._signal_group(signal.SIGTERM)

    def _signal_group(self, signum: int) -> None:
        """Signal mpirun's process group; SIGKILL also reaches the rest of its session: the launch agents
        (ssh) it put in groups of their own, which would hold the job's output open (and linger) after it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
        if signum == signal.SIGKILL:
            for pid in session_members(self.proc.pid):
                _kill(pid)

    def _copy_output(self) -> None:
        """Copy the job's output to mpirun.log and, filtered, to the terminal, until it ends. A log that
        cannot be written (full disk) is reported once and dropped; the pipe is drained regardless, so
        the job never blocks on its output."""
        log: BinaryIO | None
        try:
            log = open_in_folder(self.run_dir / MPIRUN_LOG, "ab")  # (never through a link)
        except OSError as err:
            log = None
            self._say(
                f"cannot write {self.run_dir / MPIRUN_LOG}: {err}; the output goes to the terminal alone"
            )
        fd = self.proc.stdout.fileno()
        while data := os.read(fd, 65536):
            parts = self.tap.feed(data)
            chunk = b"".join(p for p in parts if isinstance(p, bytes))
            if log is not None and chunk:
                try:
                    log.write(chunk)
                    log.flush()
                except OSError as err:
                    self._say(f"cannot write {self.run_dir / MPIRUN_LOG}: {err}; it stops here")
                    _close_quietly(log)
                    log = None
            for part in parts:
                if isinstance(part, bytes):
                    self._echo(self.filter.feed(part))
                else:
                    self.bar.update(part)
        self._echo(self.filter.flush())
        self.bar.close()
        if log is not None:
            _close_quietly(log)

    def _echo(self, data: bytes) -> None:
        """Write to the terminal; with a label (a sweep's point), at the start of every line."""
        if not data:
            return
        if self.prefix:
            lines = data.split(b"\n")
            data = b"\n".join(
                (self.prefix if (i > 0 or self.line_start) and line else b"") + line
                for i, line in enumerate(lines)
            )
            self.line_start = data.endswith(b"\n")
        self.bar.write(data)


def _close_quietly(stream: BinaryIO) -> None:
    try:
        stream.close()
    except OSError:
        pass


def session_members(sid: int) -> list[int]:
    """The processes of session ``sid`` (Linux's /proc; none where it cannot be read)."""
    members = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if os.getsid(int(entry.name)) == sid:
                members.append(int(entry.name))
        except OSError:  # ended meanwhile, or not ours to see
            pass
    return members


def _is_rank(pid: int) -> bool:
    """Whether ``pid`` is a running rank of an mpitrain job (not a process that took its number since)."""
    try:
        return b"runner.rank" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
