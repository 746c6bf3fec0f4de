"""Why a job failed, from what it left.

The ranks' ``logs/rank<r>.error`` files (each one's first line is its root cause) and Open MPI's own reports
in ``mpirun.log`` (a rank killed by a signal, one that exited with a non-zero status or called MPI_Abort)."""

from __future__ import annotations

import re
import signal
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import NamedTuple

from runner.folder_files import open_in_folder, read_text
from runner.launcher.watchdog import read_lost
from runner.run_folder import (
    BINDINGS,
    LOGS,
    MPIRUN_LOG,
    parse_number,
    rank_file,
    read_checkpoint_index,
    read_json,
)

#: Open MPI's report of a rank ended by a signal (the line is wrapped before "signal").
KILLED = re.compile(r"noticed that process rank (\d+) with PID (\d+) on node (\S+) exited on\s+signal (\d+)")
#: Open MPI's report of a rank that exited with a non-zero status without MPI_Abort.
EXITED = re.compile(r"Process name:\s*\[.*?,(\d+)\]\s+Exit code:\s*(\d+)")
#: Open MPI's own signal handler's report of a rank that crashed (SIGSEGV, SIGBUS, SIGABRT...): under ULFM it
#: is the only trace of it, as mpirun then prints no "noticed that process rank" line.
CRASHED = re.compile(
    r"^\[(\S+):(\d+)\] \*\*\* Process received signal \*\*\*\n\[\1:\2\] Signal: ([^\n]*)", re.M
)
ABORTED = re.compile(r"MPI_ABORT was invoked on rank (\d+)[^\n]*\n(?:.*\n)*?\s*Errorcode:\s*(\d+)")
#: PRRTE's reports of a lost node: its daemon (``prted``) is gone or unreachable, and the job is ended (the
#: second when the daemon's launch agent, ssh, ended with it).
LOST_DAEMON = re.compile(
    r"PRTE has lost communication with a remote daemon\.(?:.*\n)*?\s*Remote daemon:.*? on node (\S+)"
    r"|A daemon failed to report back after being spawned\.(?:.*\n)*?\s*Remote host:\s*(\S+)"
)
#: Open MPI's own message (its show-help text), between two lines of dashes.
HELP_TEXT = re.compile(r"^-{40,}\n(.+?)\n-{40,}$", re.M | re.S)
#: Hints for Open MPI's messages that name no fix, by a phrase of theirs.
HINTS = {
    "listener thread failed to start": (
        "a killed mpirun's session files are in the way of this one's (its pid's ompi.<pid> folder, under "
        "the PRTE_MCA_prte_tmpdir_base or PRTE_MCA_prte_local_tmpdir_base you set): remove that folder, or "
        "unset them and the launcher gives each job a folder of its own"
    ),
}
#: A worker's error for a lost ASGD server (runner.rank.resilience.recovery.ServerLost): the server is the
#: failed rank.
SERVER_LOST = re.compile(r"ServerLost: server rank (\d+)")


def lost_node(run_dir: Path, node: str) -> Failure:
    """A node lost with its Open MPI daemon.

    The failure says which ranks ran there, why no fault tolerance survives it, and the checkpoint a
    ``resume=`` continues from."""
    hosts = {r.get("rank"): r.get("host") for r in read_json(run_dir / BINDINGS).get("ranks", [])}
    on_node = [r for r, host in hosts.items() if host == node]
    ranks = (
        f" with rank{'s' if len(on_node) > 1 else ''} {', '.join(map(str, on_node))} on it" if on_node else ""
    )
    try:
        latest = read_checkpoint_index(run_dir)[-1]["dir"]
    except Exception:  # no index, or a damaged one
        latest = None
    then = (
        f"python -m runner resume={run_dir} continues from its checkpoint {latest}"
        if latest
        else "no checkpoint was written: run it again"
    )
    cause = f"node {node} lost (its Open MPI daemon too)"
    message = (
        f"{cause}{ranks}: Open MPI 5's runtime (PRRTE) ends the whole job when it loses a node's daemon, so "
        f"hardware.fault_tolerance=continue|heal survive lost ranks but not a lost node; {then}"
    )
    return Failure(message, on_node[0] if on_node else None, cause)


def unexplained(status: int, output: str = "", ranks_said: frozenset[str] = frozenset()) -> str:
    """The cause of a job that left nothing but mpirun's exit ``status`` and its ``output``.

    It is Open MPI's first message in the output, if any (why it did not start), with a hint where the message
    names no fix; else the output's last lines that no rank wrote to its log (``ranks_said``), which are
    Open MPI's own."""
    if status < 0:
        return f"mpirun was killed by signal {-status} ({_signal_name(-status)})"
    if status > 0 and (said := HELP_TEXT.search(output)):
        text = " ".join(said.group(1).split())
        hints = [hint for phrase, hint in HINTS.items() if phrase in text]
        return f"mpirun exited with status {status}: {text[:400]}" + "".join(f" ({h})" for h in hints)
    cause = f"the mpirun job exited with status {status} and no rank reported a cause (failed to start?)"
    own = [line.strip() for line in output.splitlines() if line.strip() and line.strip() not in ranks_said]
    if own and status != 0:
        cause += "; Open MPI's last lines: " + " | ".join(own[-3:])[-400:]
    return cause


def _ranks_said(logs: Path) -> frozenset[str]:
    """Every line the ranks wrote to their own logs (``logs/rank<r>.log``)."""
    said: set[str] = set()
    for path in logs.glob("rank*.log"):
        try:
            said.update(line.strip() for line in read_text(path, errors="replace").splitlines())
        except OSError:
            continue
    return frozenset(said)


def _crashed(
    run_dir: Path, output: str, tolerated: Collection[int], causes: dict[int, str]
) -> Failure | None:
    """The first rank that Open MPI's signal handler reported crashed and the job did not go on without.

    The rank is found by its pid in ``bindings.json``."""
    pids = {r.get("pid"): r.get("rank") for r in read_json(run_dir / BINDINGS).get("ranks", [])}
    for crash in CRASHED.finditer(output):
        host, pid, signal_line = crash.group(1), int(crash.group(2)), crash.group(3).strip()
        rank = pids.get(pid)
        if rank in tolerated:
            continue
        cause = f"crashed: {signal_line}"
        who = f"rank {rank}" if isinstance(rank, int) else "a rank"
        also = _after([r for r in causes if r != rank])
        return Failure(
            f"{who} {cause}, pid {pid} on {host}{also}; Open MPI's backtrace is in {run_dir / MPIRUN_LOG}",
            rank if isinstance(rank, int) else None,
            cause,
        )
    return None


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return "unknown"


class Failure(NamedTuple):
    """Why a job failed: the launcher's line, the rank (None: unknown), its cause, and the status."""

    message: str
    rank: int | None
    cause: str
    status: str = "failed"


def _after(ranks: list[int]) -> str:
    if not ranks:
        return ""
    return f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} failed after it)"


def job_output(run_dir: Path, log_start: int) -> str:
    """This job's part of ``mpirun.log`` (from ``log_start``; a resumed run appends to it), or ""."""
    try:
        with open_in_folder(run_dir / MPIRUN_LOG, "rb") as log:
            log.seek(log_start)
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def error_files(logs: Path) -> dict[int, str]:
    """The first line of each ``rank<r>.error`` in ``logs`` (the rank's root cause), the oldest first.

    A file not named by a rank's number, or not a regular file (a link), is not a rank's."""
    causes = {}
    try:
        errors = sorted(logs.glob("rank*.error"), key=lambda p: p.lstat().st_mtime)
    except OSError:
        return {}
    for path in errors:
        rank = parse_number(path.name[4:-6])
        try:
            text = read_text(path, errors="replace") if rank is not None else ""
        except OSError:
            continue
        if rank is not None:
            causes[rank] = (text.splitlines() or [""])[0]
    return causes


def failure_report(
    run_dir: Path, status: int, log_start: int = 0, said: Sequence[tuple[int, str]] = ()
) -> Failure:
    """Why the job ended with mpirun status ``status``.

    In order: a rank killed by a signal (Open MPI's report in ``mpirun.log``; that rank could not report
    it itself, and ranks that raised afterwards are listed), unless the others went on without it
    (``logs/lost.json``); the first ``logs/rank<r>.error`` (its first
    line is the root cause, ``Type: message (file:line)``; one starting ``Diverged:`` means status
    diverged); a rank that exited with a non-zero status or called MPI_Abort; else mpirun's status.
    Only the output from ``log_start`` on is this job's (a resumed run appends to ``mpirun.log``). ``said``:
    the ``rank N failed: cause`` lines the ranks printed, as (rank, cause), for the ranks whose error files
    could not be written (a read-only or full run folder).
    """
    logs = run_dir / LOGS
    causes = error_files(logs)
    for rank, cause in said:
        causes.setdefault(rank, cause)
    output = job_output(run_dir, log_start)
    if daemon := LOST_DAEMON.search(output):
        return lost_node(run_dir, daemon.group(1) or daemon.group(2))
    tolerated = read_lost(logs)
    kills = [k for k in KILLED.finditer(output) if int(k.group(1)) not in tolerated]
    if kills:
        rank, pid, node, number = kills[0].group(1, 2, 3, 4)
        cause = f"killed by signal {number} ({_signal_name(int(number))})"
        also = _after([r for r in causes if r != int(rank)])
        log = rank_file(run_dir, rank, "log")
        return Failure(
            f"rank {rank} {cause}, pid {pid} on {node}{also}; its output is in {log}", int(rank), cause
        )
    if crashed := _crashed(run_dir, output, tolerated, causes):
        return crashed
    if causes:
        rank, cause = next(iter(causes.items()))
        if lost := SERVER_LOST.match(cause):  # the worker only noticed it
            what = cause.removeprefix("ServerLost: ").replace("RUN_DIR", str(run_dir))
            what = re.sub(r" \([^()]*\.py:\d+\)$", "", what)  # where it was noticed is not the cause
            return Failure(f"{what} (rank {rank} noticed it)", int(lost.group(1)), what)
        log = rank_file(run_dir, rank, "log")
        message = f"rank {rank} failed: {cause}{_after(list(causes)[1:])}; traceback in {log}"
        return Failure(message, rank, cause, "diverged" if cause.startswith("Diverged:") else "failed")
    if exited := EXITED.search(output):
        cause = f"exited with status {exited.group(2)}"
        return Failure(f"rank {exited.group(1)} {cause}; see {logs}", int(exited.group(1)), cause)
    mpirun_log = run_dir / MPIRUN_LOG
    if aborted := ABORTED.search(output):
        cause = f"called MPI_Abort (error code {aborted.group(2)})"
        return Failure(f"rank {aborted.group(1)} {cause}; see {mpirun_log}", int(aborted.group(1)), cause)
    cause = unexplained(status, output, _ranks_said(logs))
    return Failure(f"{cause}; see {mpirun_log}", None, cause)
