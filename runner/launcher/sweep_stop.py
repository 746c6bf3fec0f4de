"""Stopping a sweep: one Ctrl-C checkpoints and stops its running points and starts no further one.

The first stop signal (SIGINT, SIGTERM, SIGUSR1) stops each running point as a single run's does (a
checkpoint, then ``preempted``); a second ends those points at once. The sweeping process
(:class:`runner.launcher.sweeper.MpitrainSweeper`) takes the stop signals while its points run
(:func:`taking_signals`) and records each, a line per signal, in ``SWEEP_DIR/sweep.stop``. Every point's
process follows that sweep (:func:`follow`): its supervisor (:class:`runner.launcher.supervise.Supervisor`)
stops its job as on a signal of its own (the first: checkpoint and stop; the second: end it at once), and
a point about to start does not start (:func:`not_started`). So a point that runs in another process is
stopped whether the signal reached it (a terminal's Ctrl-C reaches its whole process group: the joblib
launcher's workers) or only the sweeping process (``kill PID``; Slurm's points, on other nodes, read the
file in the shared sweep folder). A point's own signal (Slurm's SIGUSR1 before its time limit) stops that
point alone: only the sweeping process writes the file. The sweep then writes its report over what ended
and exits 130, its last line the ``resume=SWEEP_DIR`` command that finishes it (:func:`last_line`).
"""

from __future__ import annotations

import logging
import signal
import threading
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from pathlib import Path
from typing import Any

from runner.folder_files import read_text
from runner.launcher.sweep_resume import read_manifest, record_point
from runner.run_folder import CONFIG, EXIT, HYDRA_CONFIG, HYDRA_OVERRIDES, write_atomic
from runner.schema.identity import identity

log = logging.getLogger("runner")

#: The sweep folder's record of the stop signals its sweeping process had, one name a line.
STOP_FILE = "sweep.stop"
#: The signals that stop a sweep, and a single run (:mod:`runner.launcher.supervise`).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
#: How the last line names each state of a point in the manifest.
SAID = {"running": "cut off", "pending": "not started"}


@dataclass
class _Sweep:
    """The sweep this process serves (``folder``; None: none).

    ``owner``: this process runs the sweep (and writes the stop file); ``heard``: the stop signals it had;
    ``total``: the sweep's count of points."""

    folder: Path | None = None
    owner: bool = False
    heard: list[str] = field(default_factory=list)
    total: int = 0


_SWEEP = _Sweep()


def reset() -> None:
    """Forget the sweep (before a process serves another one: tests)."""
    global _SWEEP
    _SWEEP = _Sweep()


@contextmanager
def taking_signals(sweep_dir: Path, total: int) -> Iterator[None]:
    """In the sweeping process, while its ``total`` points are launched: a stop signal stops the sweep.

    The signal is recorded (:func:`heard`) instead of ending this process. A stop of an earlier run of the
    sweep is forgotten first (ValueError when its file cannot be removed: every point would refuse to
    start). After a stop, a further signal ends the process at once (while its report is written, exit 130);
    otherwise the handlers are restored when the block ends."""
    try:
        (sweep_dir / STOP_FILE).unlink(missing_ok=True)
    except OSError as err:
        raise ValueError(
            f"cannot remove {sweep_dir / STOP_FILE} (the stop of an earlier run of this sweep): "
            f"{err.strerror or err}; remove it, or give another folder"
        ) from None
    reset()
    _SWEEP.folder, _SWEEP.owner, _SWEEP.total = sweep_dir, True, total
    main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _on_signal) for s in STOP_SIGNALS} if main else {}
    try:
        yield
    finally:
        if _SWEEP.heard and main:
            for signum in STOP_SIGNALS:
                signal.signal(signum, _end_now)
        else:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            if not _SWEEP.heard:
                reset()


@contextmanager
def held_from_new_processes(spawns: bool) -> Iterator[None]:
    """While a launcher starts processes of its own for the points, they start with the stop signals blocked.

    ``spawns``: whether it does (joblib's workers). The signals are held for them until their point follows
    the sweep (:func:`follow`).

    Otherwise a Ctrl-C while a worker still imports would end it, and its pool with it (the pattern of
    bpo-33613, which loky's resource tracker uses for itself). This process still hears the signals: a thread
    started before they are blocked takes them, and Python runs their handlers in the main thread."""
    if not spawns or threading.current_thread() is not threading.main_thread():
        yield
        return
    # (multiprocessing's resource tracker, once started by the launcher, would unblock them in this thread:
    # started first, it is not started again)
    resource_tracker.ensure_running()
    done = threading.Event()
    threading.Thread(target=done.wait, name="stop-signals", daemon=True).start()
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # (inherited by the threads and
    try:  # processes started from here on)
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)
        done.set()


def count_points(total: int) -> None:
    """The sweep taking the signals has ``total`` points (known once its grid is made and checked)."""
    _SWEEP.total = total


def follow(sweep_dir: Path, elsewhere: bool) -> None:
    """In a point's process: follow the stop of the sweep in ``sweep_dir``.

    ``elsewhere``: the point runs in a process of its own (a joblib worker, a Slurm job), whose stop
    signals outside its job are recorded, for the points it would start next, where nothing else handles
    them: a joblib worker that a Ctrl-C ended between two points would break its pool, which then kills
    the points that run in the others."""
    if _SWEEP.owner and _SWEEP.folder == sweep_dir:
        return  # (the sweeping process itself: the basic launcher)
    if _SWEEP.folder != sweep_dir:
        reset()
        _SWEEP.folder = sweep_dir
    if elsewhere and threading.current_thread() is threading.main_thread():
        for signum in STOP_SIGNALS:
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
                signal.signal(signum, _on_signal)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)  # (held since it started: taken now)


def heard(name: str) -> str | None:
    """Record the stop signal ``name`` this process had; the line saying what it does to the sweep.

    The line is for the caller to say (None but in the sweeping process, which also records the signal in
    the stop file, for every point)."""
    if _SWEEP.folder is None:
        return None
    _SWEEP.heard.append(name)
    if not _SWEEP.owner:
        return None
    path = _SWEEP.folder / STOP_FILE
    try:
        write_atomic(path, "".join(f"{n}\n" for n in _SWEEP.heard))
    except OSError as err:
        log.warning("%s; points in other processes stop only where the signal reached them", err)
    if len(_SWEEP.heard) > 1:
        return f"{name} again: the sweep's points still running are ended at once"
    return (
        f"{name}: the sweep stops: its running points checkpoint and stop, no further point starts "
        f"(a second signal ends them at once); resume={_SWEEP.folder} finishes it later"
    )


def requested() -> list[str]:
    """The stop signals of the sweep this process serves ([] outside a sweep).

    Those it had, or those its sweeping process recorded (its stop file), whichever are more: a Ctrl-C
    that reached both is one request."""
    if _SWEEP.folder is None:
        return []
    if _SWEEP.owner:
        return list(_SWEEP.heard)
    try:
        recorded = read_text(_SWEEP.folder / STOP_FILE, errors="replace").split()
    except OSError:  # (none: not stopped)
        recorded = []
    return max(list(_SWEEP.heard), recorded, key=len)


def _on_signal(signum: int, frame: Any) -> None:
    """A stop signal no job's supervisor handles (between points, or while they run elsewhere)."""
    if (said := heard(signal.Signals(signum).name)) is not None:
        log.warning(said)


def _end_now(signum: int, frame: Any) -> None:
    """A signal after the sweep's stop, once its points ended: the sweep ends now, without its report."""
    _SWEEP.heard.append(signal.Signals(signum).name)
    log.warning("%s again: the sweep ends now, without its report", _SWEEP.heard[-1])
    if (line := last_line()) is not None:
        log.warning(line)
    raise SystemExit(EXIT["interrupted"])


class UntilStopped(list):
    """A launch's points (each one's overrides), of which a launcher gets none once the sweep stopped.

    The basic launcher takes them one after the other, joblib's as its workers free up: no further point
    is started, nor its folder made."""

    def __iter__(self) -> Iterator[Any]:
        for item in super().__iter__():
            if requested():
                return
            yield item


def not_started(point: tuple[Path, int], ident: dict[str, Any], run_dir: Path, records: Path | None) -> bool:
    """Whether sweep point ``point`` (folder, number) must not start: its sweep was stopped.

    Then it is said in one line, and what Hydra wrote for it removed (``records``: its ``.hydra/``); a new
    point (not a resumed one, whose ``run_dir`` holds its earlier job's files) is recorded ``pending`` and
    the folder Hydra made for it removed too."""
    asked = requested()
    if not asked:
        return False
    log.warning("[%s] not started: the sweep was stopped (%s)", ident["name"], asked[0])
    new = not (run_dir / CONFIG).exists()  # (no job of its own ever wrote there)
    if new:
        sweep_dir, num = point
        record_point(sweep_dir, num, overrides=ident["overrides"], name=ident["name"], state="pending")
    remove_unstarted(run_dir if new else None, records)
    return True


def remove_unstarted(run_dir: Path | None, records: Path | None) -> None:
    """Remove what Hydra made for a point that did not start.

    Its ``records`` (config, hydra and overrides) and, for a new point, this launcher's log file and the
    point's folder ``run_dir``; each only if it is there, a folder only if empty."""
    names = [] if records is None else [records / n for n in (CONFIG, HYDRA_CONFIG, HYDRA_OVERRIDES)]
    for path in [*names, *([] if run_dir is None else run_dir.glob("*.log"))]:
        try:
            if path.is_file() and not path.is_symlink():
                path.unlink()
        except OSError:
            pass
    for folder in [f for f in (records, run_dir) if f is not None]:
        try:
            folder.rmdir()
        except OSError:  # (not empty: something else wrote there, kept)
            pass


def record_unstarted(sweep_dir: Path, jobs: list[tuple[int, list[str]]], sweep: list[str]) -> None:
    """After a stop, record the points of ``jobs`` (number, overrides) never started as ``pending``.

    (A resumed sweep's plan recorded them all already.)"""
    points = read_manifest(sweep_dir)
    for num, overrides in jobs:
        if str(num) not in points:
            ident = identity(list(overrides), sweep)
            record_point(sweep_dir, num, overrides=ident["overrides"], name=ident["name"], state="pending")


def last_line() -> str | None:
    """The sweeping process's last line after a stop (None: not stopped).

    How its points stand, and the command that finishes the sweep."""
    if not (_SWEEP.owner and _SWEEP.heard and _SWEEP.folder is not None):
        return None
    states = Counter(str(p.get("state")) for p in read_manifest(_SWEEP.folder).values())
    states["pending"] += max(0, _SWEEP.total - sum(states.values()))
    ok = states.pop("ok", 0)
    ordered = sorted(states.items(), key=lambda kv: kv[0] == "pending")  # (not started: last)
    rest = "".join(f", {n} {SAID.get(state, state)}" for state, n in ordered if n)
    return (
        f"the sweep was stopped ({_SWEEP.heard[0]}): {ok} of {_SWEEP.total} points ok{rest}; finish it "
        f"with: python -m runner resume={_SWEEP.folder}"
    )
