"""The stall watchdog's view of the ranks' heartbeats, and its decision.

Every rank rewrites ``RUN_DIR/logs/rank<r>.beat`` once a second (JSON: ``rank``, ``pid``, ``host``, ``role``,
``step``, ``progress_time``: when it last got somewhere, ``alive_time``: when it wrote this). A stopped or
killed rank stops writing; a rank blocked in MPI keeps writing while its ``progress_time`` stands still.
:func:`stall_check` is a pure function of what was read, so it is tested on beats made up by hand.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from runner.folder_files import read_text
from runner.run_folder import LOST, STACKS_SIGNAL, parse_number, rank_file_name

#: A rank whose heartbeat thread has not written for this long is stopped or dead, not merely waiting.
NOT_RESPONDING_S = 10.0
#: After mpirun ended, a rank elsewhere whose heartbeat (written once a second) is this old has ended too.
ENDED_SILENCE_S = 2.0
#: ``logs/lost.json``: ``{"lost": [ranks]}``, workers the survivors went on without (fault tolerance).


@dataclass
class Stall:
    """Ranks found stuck, and the line that says so."""

    ranks: list[int]
    message: str


def _describe(rank: int, beat: Mapping[str, Any] | None) -> str:
    if beat is None:
        return f"rank {rank}"
    role = "server rank" if beat.get("role") == "server" else "rank"
    return f"{role} {rank} (host {beat.get('host', '?')}, pid {beat.get('pid', '?')})"


def _silent(beat: Mapping[str, Any], now: float) -> str:
    """How long a rank's heartbeat has been silent, and the step it last told.

    A beat is written once a second, so a rank stopped early may have trained a few steps past it."""
    step = beat.get("step", -1)
    told = f"step {step}" if step >= 0 else "no step yet"
    return f"for {now - beat['alive_time']:.0f} s (its last heartbeat: {told})"


def stall_check(
    beats: Mapping[int, Mapping[str, Any] | None], now: float, launch_time: float, timeout: float
) -> Stall | None:
    """The stuck ranks, or None.

    ``beats`` has every rank still running: its latest heartbeat, or None if it never wrote one.

    A rank has stalled when it made no progress for ``timeout`` seconds (with no heartbeat, since
    ``launch_time``). Of the stalled ranks, those whose heartbeat thread stopped writing
    (:data:`NOT_RESPONDING_S`) or never wrote are named; when every one still writes (blocked, e.g. in MPI),
    those at the lowest step are: the others are waiting for them.
    """
    last = {r: (b["progress_time"] if b else launch_time) for r, b in beats.items()}
    stale = sorted(r for r, t in last.items() if now - t >= timeout)
    if not stale:
        return None
    silent = [r for r in stale if beats[r] is None or now - beats[r]["alive_time"] > NOT_RESPONDING_S]
    parts = []
    if silent:
        for r in silent:
            beat = beats[r]
            if beat is None:
                parts.append(f"rank {r} sent no heartbeat since the launch")
            else:
                parts.append(f"{_describe(r, beat)} not responding {_silent(beat, now)}")
        named = silent
    else:
        low = min(beats[r].get("step", -1) for r in stale)
        named = [r for r in stale if beats[r].get("step", -1) == low]
        for r in named:
            beat = beats[r]
            where = "" if beat.get("role") == "server" else f" at step {low}"
            parts.append(f"{_describe(r, beat)} stuck{where}")
    idle = now - max(last[r] for r in stale)
    if len(stale) == len(beats):
        parts.append(f"no rank made progress for {idle:.0f} s")
    else:
        who = ", ".join(map(str, stale))
        parts.append(f"rank{'s' if len(stale) > 1 else ''} {who} made no progress for {idle:.0f} s")
    return Stall(named, "; ".join(parts))


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` of this machine has ended (a zombie not yet reaped counts as ended)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def ask_stacks(beats: Mapping[int, Mapping[str, Any] | None], host: str) -> list[int]:
    """Signal the ranks of ``host`` (this machine) still running to write their threads' stacks.

    The stacks go to ``logs/rank<r>.stacks`` (:mod:`runner.rank.records.heartbeat`). Returns the ranks
    asked."""
    asked = []
    for r, beat in sorted(beats.items()):
        if beat is not None and beat.get("host") == host and not process_gone(beat["pid"]):
            with contextlib.suppress(OSError):
                os.kill(beat["pid"], STACKS_SIGNAL)
                asked.append(r)
    return asked


def lost_servers(
    beats: Mapping[int, Mapping[str, Any] | None], servers: Iterable[int], host: str | None = None
) -> Stall | None:
    """The server ranks whose process on this machine has ended while the job runs, or None.

    With them, the line that says so. A server's state is kept nowhere else, so its loss ends the job; the
    workers usually say it first (their error names the server), but one blocked where MPI does not report the
    loss would wait for the stall watchdog. Ranks on other hosts are left to the watchdog (their processes are
    not here)."""
    host, servers = (socket.gethostname() if host is None else host), set(servers)
    lost = [
        r
        for r in sorted(servers)
        if (beat := beats.get(r)) is not None and beat.get("host") == host and process_gone(beat["pid"])
    ]
    if not lost:
        return None
    steps = [b.get("step", -1) for r, b in beats.items() if b is not None and r not in servers]
    step = max(steps, default=-1)
    parts = [f"server rank {r} (host {host}, pid {beats[r]['pid']})" for r in lost]  # type: ignore[index]
    verb = "was" if len(lost) == 1 else "were"
    return Stall(
        lost,
        f"{' and '.join(parts)} {verb} lost at step {step}: its process ended, and a server's state is "
        "kept nowhere else",
    )


def read_lost(logs: Path) -> set[int]:
    """The ranks the others went on without (``logs/lost.json``; empty if none)."""
    try:
        return set(json.loads(read_text(logs / LOST))["lost"])
    except (OSError, ValueError, KeyError):
        return set()


def spawned_ids(logs: Path, ranks: int) -> list[int]:
    """The ids of workers spawned into the job (heartbeat files ``rank<id>.beat`` with ``id >= ranks``)."""
    ids = []
    for path in logs.glob(rank_file_name(0, "beat").replace("0", "*", 1)):
        number = parse_number(path.name.removeprefix("rank").split(".")[0])
        if number is not None and number >= ranks:
            ids.append(number)
    return sorted(ids)


def read_beats(
    logs: Path, ranks: int, launch_time: float, previous: dict[int, dict]
) -> dict[int, dict | None]:
    """Every running rank's heartbeat (None: none yet).

    A beat written before ``launch_time`` (a previous job in this folder) counts as none; a rank whose beat
    says ``"done": true``, or whose beat file is gone after it was seen, has finished and is left out, as are
    the ranks in ``lost.json``, which the others went on without, and idle spares (``hardware.spares``).
    Workers spawned into the job (ids from ``ranks`` on, :mod:`runner.rank.resilience.elastic`) are watched
    from their first beat. ``previous`` keeps the last good beats between calls."""
    beats: dict[int, dict | None] = {}
    lost = read_lost(logs)
    for r in [*range(ranks), *spawned_ids(logs, ranks)]:
        if r in lost:
            continue
        try:
            beat = json.loads(read_text(logs / rank_file_name(r, "beat")))
        except FileNotFoundError:
            if r not in previous and r < ranks:
                beats[r] = None
            continue
        except (OSError, ValueError):
            beat = previous.get(r)
        if beat is None or beat.get("alive_time", 0) < launch_time:
            if r < ranks:  # (a spawned worker's beat of an earlier job in this folder: not this job's)
                beats[r] = None
            continue
        previous[r] = beat
        if not beat.get("done") and beat.get("role") != "spare":  # (a spare waits by design)
            beats[r] = beat
    return beats


def outliving(
    beats: Mapping[int, Mapping[str, Any] | None], now: float, host: str, alive: Callable[[int], bool]
) -> dict[int, Mapping[str, Any]]:
    """The ranks still running after mpirun ended.

    ``beats``: :func:`read_beats`'s, done ones left out. On ``host`` (this machine), those whose process is
    ``alive``; elsewhere, those whose heartbeat is younger than :data:`ENDED_SILENCE_S`. A rank can outlive a
    runtime that lost a node, and go on writing."""
    running = {}
    for rank, beat in beats.items():
        if beat is None:
            continue
        if beat.get("host") == host:
            if alive(int(beat.get("pid", 0))):
                running[rank] = beat
        elif now - beat.get("alive_time", 0.0) < ENDED_SILENCE_S:
            running[rank] = beat
    return running
