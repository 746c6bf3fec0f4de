"""The supervisor's watches: each keeps its own clock and, at every tick, returns an ending or nothing.

- :class:`StopRequests`: the launcher's stop signals and its sweep's stop requests (a second one, or
  :data:`GRACE_S` without the job ending, ends it);
- :class:`ErrorFiles`: a rank failed with an error (``logs/rank<r>.error``) and the others did not stop;
- :class:`SummaryWatch`: mpirun outlives the job's final ``summary.json``;
- :class:`ServerWatch`: a server rank's process ended and no rank said so;
- :class:`StallWatch`: a rank made no progress for ``train.stall_timeout`` (:func:`stall_check` decides);
- :class:`Watches`: the four, every :data:`WATCH_INTERVAL_S`, sharing one reading of the heartbeats.

Their times are module constants, so a test sets them shorter (``monkeypatch.setattr``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.launcher import sweep_stop
from runner.launcher.watchdog import Stall, ask_stacks, lost_servers, outliving, read_beats, stall_check
from runner.run_folder import LOGS, STACKS, STOP, SUMMARY, rank_file_name, write_atomic

#: Seconds the ranks get, after the first stop signal, to checkpoint and exit before the job is killed.
GRACE_S = 120.0
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
#: Seconds the ranks are given to write their stacks (a signal handler's few writes) before the job is ended.
STACKS_WAIT_S = 0.5

Beats = Mapping[int, Mapping[str, Any] | None]


@dataclass
class Ending:
    """Why the launcher ends a job, and what the outcome records of it."""

    reason: str
    interrupted: bool = False  # after a stop request: the job did not stop by itself
    stall: Stall | None = None
    lost: Stall | None = None  # server ranks whose process ended, no rank said so
    after_summary: bool = False  # mpirun outlived the job's final summary.json


class StopRequests:
    """The stop requests, this launcher's signals or its sweep's (:mod:`runner.launcher.sweep_stop`).

    The first writes ``RUN_DIR/STOP`` (the ranks checkpoint and stop after their step); a second, or
    :data:`GRACE_S` without the job ending, ends it. ``closed``: the job is being ended (nothing written)."""

    def __init__(self, run_dir: Path, say: Callable[[str], None]):
        self.stop_file, self.say = run_dir / STOP, say
        self.signals: list[str] = []  # the requests, in order
        self.heard = 0  # the stop signals this launcher had
        self.time: float | None = None  # when the first came
        self.closed = False

    def signal(self, name: str) -> Ending | None:
        """This launcher got stop signal ``name``."""
        self.heard += 1
        ending = self.request(name) if self.heard > len(self.signals) else None  # (else: the sweep's)
        if (said := sweep_stop.heard(name)) is not None:  # the sweep this job is a point of stops too
            self.say(said)
        return ending

    def request(self, name: str) -> Ending | None:
        self.signals.append(name)
        if len(self.signals) > 1 or self.closed:
            return None
        self.time = time.time()
        try:
            write_atomic(self.stop_file, name + "\n")
        except OSError as err:
            return Ending(f"{name}, and the ranks could not be told to stop ({err})", interrupted=True)
        self.say(
            f"{name}: the ranks will checkpoint and stop after their current step; a second signal, or "
            f"{GRACE_S:.0f} s without the job ending, ends it at once"
        )
        return None

    def tick(self, now: float) -> Ending | None:
        for name in sweep_stop.requested()[len(self.signals) :]:  # its sweep's (its sweeping process's)
            if ending := self.request(name):
                return ending
        if len(self.signals) > 1:
            return Ending(f"a second signal ({self.signals[1]})", interrupted=True)
        if self.time is not None and now - self.time > GRACE_S:
            return Ending(
                f"the job did not stop within {GRACE_S:.0f} s of {self.signals[0]}", interrupted=True
            )
        return None


class ErrorFiles:
    """A rank's error file: the job is ended :data:`FAILED_RANK_GRACE_S` after it appeared."""

    def __init__(self, logs: Path, launch_time: float):
        self.logs, self.launch_time = logs, launch_time
        self.since: float | None = None  # when the first error file of this job was seen

    def tick(self, now: float) -> Ending | None:
        if self.since is None:
            if any(e.stat().st_mtime >= self.launch_time for e in self.logs.glob("rank*.error")):
                self.since = now
        elif now - self.since > FAILED_RANK_GRACE_S:
            return Ending("a rank failed with an error and the others did not stop")
        return None


class SummaryWatch:
    """An mpirun that outlives the job's final summary.json.

    It is ended :data:`SUMMARY_GRACE_S` after the summary, or :data:`ENDED_GRACE_S` once none of the job's
    ranks is running (``alive``: whether a pid of this machine is a running rank)."""

    def __init__(self, run_dir: Path, launch_time: float, alive: Callable[[int], bool]):
        self.path, self.launch_time, self.alive = run_dir / SUMMARY, launch_time, alive
        self.since: float | None = None  # when this job's summary.json was first seen
        self.ended_since: float | None = None  # since when, after it, no rank has been running

    def seen(self, now: float) -> bool:
        """Whether the job wrote its summary (noting when it was first seen)."""
        if self.since is None:
            try:
                if self.path.stat().st_mtime >= self.launch_time:
                    self.since = now
            except OSError:
                pass
        return self.since is not None

    def tick(self, now: float, beats: Beats) -> Ending | None:
        assert self.since is not None
        if outliving(beats, now, socket.gethostname(), self.alive):
            self.ended_since = None
        elif self.ended_since is None:
            self.ended_since = now
        ended = self.ended_since is not None and now - self.ended_since > ENDED_GRACE_S
        if not (ended or now - self.since > SUMMARY_GRACE_S):
            return None
        reason = (
            f"mpirun is still running {now - self.since:.0f} s after the job wrote its summary.json"
            + (" and its ranks ended" if ended else "")
            + " (waiting for a node it cannot reach?)"
        )
        return Ending(reason, after_summary=True)


class ServerWatch:
    """A server rank whose process ended, with no rank's error file within :data:`SERVER_LOSS_GRACE_S`.

    A worker blocked where MPI does not report the loss would otherwise wait for the stall watchdog."""

    def __init__(self, servers: Sequence[int]):
        self.servers = tuple(servers)
        self.gone_since: float | None = None

    def tick(self, now: float, beats: Beats) -> Ending | None:
        lost = lost_servers(beats, self.servers)
        if lost is None:
            self.gone_since = None
        elif self.gone_since is None:
            self.gone_since = now
        elif now - self.gone_since > SERVER_LOSS_GRACE_S:
            return Ending(lost.message, lost=lost)
        return None


class StallWatch:
    """Ranks without progress for ``timeout`` seconds.

    A warning at half of it, the ending at it, with the stacks of the ranks of this machine still running
    (where each waits)."""

    def __init__(self, timeout: float, launch_time: float, say: Callable[[str], None]):
        self.timeout, self.launch_time, self.say = timeout, launch_time, say
        self.warned: Stall | None = None

    def tick(self, now: float, beats: Beats) -> Ending | None:
        stall = stall_check(beats, now, self.launch_time, self.timeout)
        if stall is not None:
            return Ending(f"stalled: {stall.message}{self._stacks(beats)}", stall=stall)
        warning = stall_check(beats, now, self.launch_time, self.timeout / 2)
        if warning is not None and self.warned is None:
            self.say(
                f"{warning.message}; the job is ended after {self.timeout:.0f} s without progress "
                "(train.stall_timeout)"
            )
        self.warned = warning
        return None

    @staticmethod
    def _stacks(beats: Beats) -> str:
        asked = ask_stacks(beats, socket.gethostname())
        time.sleep(STACKS_WAIT_S if asked else 0)
        files = ", ".join(f"{LOGS}/{rank_file_name(r, STACKS)}" for r in asked)
        return f" (where the ranks still running wait: {files})" if asked else ""


class Watches:
    """The watches of one job, every :data:`WATCH_INTERVAL_S`.

    One reading of the heartbeats serves those that read them: the summary's after it; before it, the
    servers' (while no rank failed with an error); and the stall watchdog's (``stall_timeout`` None: none)."""

    def __init__(
        self,
        run_dir: Path,
        ranks: int,
        launch_time: float,
        stall_timeout: float | None,
        servers: Sequence[int],
        alive: Callable[[int], bool],
        say: Callable[[str], None],
    ):
        self.logs, self.ranks, self.launch_time = run_dir / LOGS, ranks, launch_time
        self.errors = ErrorFiles(self.logs, launch_time)
        self.summary = SummaryWatch(run_dir, launch_time, alive)
        self.servers = ServerWatch(servers) if servers else None
        self.stall = StallWatch(stall_timeout, launch_time, say) if stall_timeout else None
        self.beats: dict[int, dict] = {}  # the last good heartbeat of each rank, between readings
        self.next = 0.0

    def read_beats(self) -> dict[int, dict | None]:
        return read_beats(self.logs, self.ranks, self.launch_time, self.beats)

    def tick(self, now: float) -> Ending | None:
        if now < self.next:
            return None
        self.next = now + WATCH_INTERVAL_S
        if ending := self.errors.tick(now):
            return ending
        after_summary = self.summary.since is not None
        summary = self.summary.seen(now)
        servers = self.servers if self.errors.since is None and not summary else None
        if not (after_summary or servers or self.stall):
            return None
        beats = self.read_beats()
        for watch in (self.summary if after_summary else None, servers, self.stall):
            if watch is not None and (ending := watch.tick(now, beats)):
                return ending
        return None
