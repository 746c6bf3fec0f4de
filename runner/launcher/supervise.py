"""Supervising a running job: its output, the launcher's signals, and the ranks' heartbeats.

The job runs in a session of its own, so nothing reaches it but what the launcher sends:

- **Output.** Everything the job prints goes to ``mpirun.log`` as it comes; the terminal gets the same
  bytes less what would bury the cause under noise: Open MPI's abort banners (``MPI_ABORT was invoked``,
  ``prterun has exited due to ...``, ``... noticed that process rank``), Python tracebacks and the ranks'
  own ``rank N failed:`` lines. The launcher's last line names the cause. Rank 0's progress records go to
  neither: the launcher draws the progress bar from them (:mod:`runner.launcher.progress`).
- **Signals.** SIGTERM, SIGUSR1 (Slurm's ``--signal``, ``scancel``) and SIGINT (Ctrl-C) write
  ``RUN_DIR/STOP`` holding the signal's name; the ranks then finish their step, write a checkpoint and
  exit. A second signal, or ``GRACE_S`` without the job ending, ends it at once. A sweep point's job
  also takes its sweep's stop requests as its own signals (:mod:`runner.launcher.sweep_stop`).
- **A job that does not end after its summary.** Rank 0 writes ``summary.json`` last; an ``mpirun`` still
  running ``SUMMARY_GRACE_S`` later is waiting for something that will not come (a daemon on a node it
  cannot reach since a cut link) and is ended; the job counts as ended by its summary's status.
- **Stalls.** With ``train.stall_timeout`` set, the ranks' heartbeats (``logs/rank<r>.beat``) are read
  every second; :func:`~runner.launcher.watchdog.stall_check` decides, from them alone, whether and which
  ranks are stuck.

Each of these is a watch of :mod:`runner.launcher.watches`, with its clock and its times (``GRACE_S``,
``SUMMARY_GRACE_S``...); the job's output goes through :mod:`runner.launcher.job_output`. Ending a job is
SIGTERM to its process group, then SIGKILL to its whole session after :data:`TERM_TIMEOUT_S`.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.folder_files import is_regular
from runner.launcher import sweep_stop
from runner.launcher.job_output import JobOutput
from runner.launcher.session_dir import session_dir
from runner.launcher.watchdog import Stall, outliving
from runner.launcher.watches import Ending, StopRequests, Watches
from runner.run_folder import MPIRUN_LOG

#: Seconds between SIGTERM and SIGKILL when the launcher ends a job.
TERM_TIMEOUT_S = 5.0
#: Seconds the launcher waits, after mpirun ended, for ranks that outlived it (a rank on a node the runtime
#: did not lose can go on writing checkpoints) before it reads what the job left; those on this machine
#: are then killed.
OUTLIVED_WAIT_S = 5.0
STOP_SIGNALS = sweep_stop.STOP_SIGNALS


@dataclass
class Outcome:
    """How a job ended.

    ``signal``: the first stop signal the launcher got; ``interrupted``: why the launcher killed the job after
    one (a second signal, the grace period); ``stall``: the watchdog ended it."""

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


class Supervisor:
    """Starts ``argv`` and watches it to the end (:meth:`run`).

    Call from the main thread to handle signals (elsewhere, e.g. in a sweep launcher's thread, signals are
    left alone)."""

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
        self.env = {**os.environ, **(env or {})}  # hardware.env: mpirun's -x KEY reads them here
        self.output = JobOutput(run_dir, label)
        self.stops = StopRequests(run_dir, self.output.say)
        self.watches: Watches | None = None  # made at the launch, which their clocks start from
        self.ending: Ending | None = None  # why the launcher ends the job, once it does
        self.ending_since: float | None = None
        self.killed = False  # SIGKILL sent, TERM_TIMEOUT_S after SIGTERM
        self.proc: subprocess.Popen | None = None

    def run(self) -> Outcome:
        """Run the job to its end and say how it ended.

        Any exception here ends the job first. mpirun's session files go to a folder of this job's, removed
        after it (:mod:`runner.launcher.session_dir`)."""
        with session_dir(self.env) as env:
            return self._run(env)

    def _run(self, env: dict[str, str]) -> Outcome:
        previous = self._install_handlers()
        log = self.run_dir / MPIRUN_LOG
        log_start = log.stat().st_size if is_regular(log) else 0
        try:
            launched = time.time()
            self.watches = Watches(
                self.run_dir,
                self.ranks,
                launched,
                self.stall_timeout,
                self.servers,
                _is_rank,
                self.output.say,
            )
            self.proc = subprocess.Popen(
                self.argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
            assert self.proc.stdout is not None
            reader = threading.Thread(
                target=self.output.copy, args=(self.proc.stdout.fileno(),), name="job-output", daemon=True
            )
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
                await_outliving(self.watches, self.output.say)
        except BaseException:
            self._signal_group(signal.SIGKILL)
            raise
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        return self._outcome(status, log_start)

    def _outcome(self, status: int, log_start: int) -> Outcome:
        if status == 0 and self.output.filter.tracebacks:
            self.output.say(
                f"the job printed {self.output.filter.tracebacks} Python traceback(s): see mpirun.log"
            )
        e, signals = self.ending or Ending(""), self.stops.signals
        if e.after_summary:
            status = 0  # the job's own end is its summary's; mpirun's is the launcher's SIGTERM
        return Outcome(
            status,
            signals[0] if signals else None,
            e.reason if e.interrupted else None,
            e.stall,
            log_start,
            self.stops.time,
            tuple(self.output.filter.failures),
            e.after_summary,
            e.lost,
        )

    def _install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        return {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}

    def _on_signal(self, signum: int, frame: Any) -> None:
        if ending := self.stops.signal(signal.Signals(signum).name):
            self._end(ending)

    def _tick(self, now: float) -> None:
        if self.ending_since is not None:
            if not self.killed and now - self.ending_since > TERM_TIMEOUT_S:
                self._signal_group(signal.SIGKILL)
                self.killed = True
            return
        assert self.watches is not None
        if ending := self.stops.tick(now) or self.watches.tick(now):
            self._end(ending)

    def _end(self, ending: Ending) -> None:
        if self.ending_since is not None:
            return
        self.ending, self.stops.closed = ending, True
        self.output.say(f"ending the job: {ending.reason}")
        self.ending_since = time.time()
        self._signal_group(signal.SIGTERM)

    def _signal_group(self, signum: int) -> None:
        """Signal mpirun's process group.

        SIGKILL also reaches the rest of its session: the launch agents (ssh) it put in groups of their own,
        which would hold the job's output open (and linger) after it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass
        if signum == signal.SIGKILL:
            for pid in session_members(self.proc.pid):
                _kill(pid)


def await_outliving(watches: Watches, say: Callable[[str], None]) -> None:
    """Wait up to :data:`OUTLIVED_WAIT_S` for the ranks that outlived mpirun.

    This way what the job left (its last checkpoint) is read after its last write. Kill those on this
    machine that go on, and name those elsewhere (``say``)."""
    host, deadline = socket.gethostname(), time.time() + OUTLIVED_WAIT_S
    while True:
        running = outliving(watches.read_beats(), time.time(), host, _is_rank)
        if not running or time.time() >= deadline:
            break
        time.sleep(0.1)
    for rank, beat in running.items():
        where = f"rank {rank} (host {beat.get('host')}, pid {beat.get('pid')})"
        if beat.get("host") == host:
            _kill(int(beat["pid"]))
            say(f"{where} outlived mpirun by {OUTLIVED_WAIT_S:.0f} s: killed")
        else:
            say(f"{where} still runs {OUTLIVED_WAIT_S:.0f} s after mpirun ended: end it there")


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
