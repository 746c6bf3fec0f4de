"""A sweep's points and their states (the manifest ``sweep.json``), and ``resume=SWEEP_DIR``.

``resume=SWEEP_DIR`` finishes a sweep point by point.

**The manifest.** ``SWEEP_DIR/sweep.json`` lists the sweep's points by number: overrides, name, folder and
state (``running``, then how the point ended: ``ok``, ``failed``, ``invalid``, ``preempted``; ``pending`` for
a point a resumed sweep has yet to run). Each point writes its own entry as it starts and as it ends,
read-modify-write under a lock (``.sweep.json.lock``), since the points of a parallel launcher end at once. It
is a record for people and tools: what a point *is* is read from its folder (:func:`point_state`), which also
tells a point whose launcher was killed (a ``config.yaml`` and no summary of that job).

**Resuming.** ``resume=SWEEP_DIR`` (a folder with Hydra's ``multirun.yaml``) is turned into the sweep's own
command line (:func:`resumed_argv`: its overrides, its launcher, ``hydra.sweep.dir=SWEEP_DIR``), whose sweeper
(:class:`runner.launcher.sweeper.MpitrainSweeper`) expands the same grid in the same order (so point ``N`` is
folder ``N`` again) and launches what :func:`plan` decides for each point (:func:`decide`): an ``ok`` point is
kept (no job, not a file touched), an interrupted one (preempted, or its launcher killed) with a checkpoint is
resumed in its folder (``resume=SWEEP_DIR/N``), a failed one is run again (its folder set aside as
``.attempts/N.K``) or, with ``sweep.retry=false``, kept as it ended, and a point never started is run. A point
kept or resumed must still hold in its ``config.yaml`` the config its overrides compose to
(:func:`check_points`: not edited since it ran, not another sweep's run), else the resume is refused before
anything is decided. The report is then written over every point, as at the end of any sweep.
"""

from __future__ import annotations

import fcntl
import logging
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from runner.folder_files import open_in_folder, read_text
from runner.launcher import outcomes
from runner.run_folder import (
    CHECKPOINTS,
    CONFIG,
    EXIT,
    IDENTITY,
    SUMMARY,
    SWEEP_CONFIG,
    DamagedIndex,
    dumps,
    read_checkpoint_index,
    read_json,
    rebuild_checkpoint_index,
    write_atomic,
)
from runner.schema import provenance
from runner.schema.identity import identity, override_key
from runner.schema.provenance import flat
from runner.schema.secrets import restored_override

log = logging.getLogger("runner")

MANIFEST = "sweep.json"
#: Where a failed point's folder is set aside before it runs again: ``SWEEP_DIR/.attempts/N.K``.
ATTEMPTS = ".attempts"


def is_sweep_folder(path: Path) -> bool:
    """Whether ``path`` is a sweep's folder (Hydra's ``multirun.yaml``), not a run's (``config.yaml``)."""
    return (path / SWEEP_CONFIG).is_file() and not (path / CONFIG).is_file()


def point_state(point_dir: Path) -> tuple[str, str | None, bool]:
    """``(state, status, checkpointed)`` of a sweep point's folder.

    The state is ``pending`` (no job wrote its config), ``running`` (its last job has no summary: running, or
    its launcher was killed), ``ok``, ``invalid``, ``preempted`` (summary ``preempted`` or ``interrupted``, a
    point whose Slurm job ended without a result: cancelled, time limit, lost node, or one that failed once
    stopped: :func:`stopped`) or ``failed`` (any other status); ``status`` is its summary's, and
    ``checkpointed`` whether a checkpoint was indexed or can be found."""
    config = point_dir / CONFIG
    if not config.is_file():
        return "pending", None, False
    summary = point_dir / SUMMARY
    try:
        current = summary.stat().st_mtime >= config.stat().st_mtime  # not an earlier job's
    except OSError:
        current = False
    result = read_json(summary) if current else {}
    status = result.get("status")
    if status is None:
        state = "running"
    elif status in ("preempted", "interrupted") or result.get("slurm_job") or stopped(result):
        state = "preempted"
    elif status in ("ok", "invalid"):
        state = status
    else:
        state = "failed"
    return state, status, checkpointed(point_dir)


def stopped(summary: dict[str, Any]) -> bool:
    """Whether a job that failed had been told to stop first: cut off rather than failed on its own.

    Told to stop: its launcher got SIGTERM, SIGUSR1 or SIGINT (the summary's ``signal``). Slurm's ``scancel``,
    time limit or preemption sends SIGTERM to every process of the job at once: mpirun and the ranks end
    before they can checkpoint. The launcher now writes such a job ``interrupted``; a summary written before
    it did says ``failed``, with the signal."""
    return summary.get("status") == "failed" and bool(summary.get("signal"))


def checkpointed(run_dir: Path) -> bool:
    """Whether ``run_dir`` has a checkpoint to resume from (indexed, or in a folder the index missed)."""
    if not (run_dir / CHECKPOINTS).is_dir():
        return False
    try:
        if read_checkpoint_index(run_dir):
            return True
    except DamagedIndex:
        pass
    return bool(rebuild_checkpoint_index(run_dir)[0])


def decide(state: str, has_checkpoint: bool, retry: bool) -> str:
    """What resuming does with a point in ``state`` (:func:`point_state`).

    ``keep`` an ok one, ``resume`` an interrupted one from its checkpoint (without one: ``run`` it again),
    ``run`` a failed one again (``skip``: keep it as it ended, with ``sweep.retry=false``) and one never
    started."""
    if state == "ok":
        return "keep"
    if state in ("preempted", "running"):
        return "resume" if has_checkpoint else "run"
    if state in ("failed", "invalid"):
        return "run" if retry else "skip"
    assert state == "pending", state
    return "run"


def record_point(sweep_dir: Path, num: int, **fields: Any) -> None:
    """Update point ``num``'s entry of ``SWEEP_DIR/sweep.json`` with ``fields``.

    The update is made under the manifest's lock and written atomically; the entry's ``error`` (why it was
    refused) is kept while it stays ``invalid``. A manifest that cannot be written is logged: it is a record,
    not the sweep."""
    try:
        with open_in_folder(sweep_dir / f".{MANIFEST}.lock", "a") as lock:  # (never through a link)
            fcntl.flock(lock, fcntl.LOCK_EX)
            manifest = read_json(sweep_dir / MANIFEST)
            points = manifest.setdefault("points", {})
            if not isinstance(points, dict):
                manifest["points"] = points = {}
            entry = {**points.get(str(num), {}), "dir": str(num), **fields, "time": time.time()}
            if entry.get("state") != "invalid" or entry.get("error") is None:  # (a reason outlives no state)
                entry.pop("error", None)
            points[str(num)] = entry
            ordered = dict(sorted(points.items(), key=lambda kv: int(kv[0]) if kv[0].isdigit() else -1))
            write_atomic(sweep_dir / MANIFEST, dumps({**manifest, "points": ordered}, indent=1))
    except OSError as err:
        log.warning("%s: cannot record point %s: %s", sweep_dir / MANIFEST, num, err.strerror or err)


def read_manifest(sweep_dir: Path) -> dict[str, dict[str, Any]]:
    """The points of ``SWEEP_DIR/sweep.json`` by number ({} when there is none)."""
    points = read_json(sweep_dir / MANIFEST).get("points")
    return points if isinstance(points, dict) else {}


def failed_point(sweep_dir: Path, me: int) -> str | None:
    """A point of the sweep other than ``me`` that ended not ok, named; None when there is none.

    Named as ``point 1 (optim.lr=10) failed``, as ``sweep.fail_fast`` asks."""
    for num, point in read_manifest(sweep_dir).items():
        state = point.get("state")
        if num != str(me) and state not in ("ok", "running", "pending", None):
            return f"point {num} ({point.get('name', '?')}) {point.get('status') or state}"
    for name, status, _ in outcomes.NOT_OK:  # this process's points (a manifest may be unwritable)
        return f"{name} {status}"
    return None


def start_point(sweep_dir: Path, num: int, ident: dict[str, Any], fail_fast: bool = False) -> bool:
    """Record sweep point ``num`` as running, and say whether it should run.

    It should not with ``fail_fast`` once another point ended not ok (it is then said in one line and left
    ``pending``, for a resume to run)."""
    if fail_fast and (why := failed_point(sweep_dir, num)) is not None:
        log.warning("[%s] not started: sweep.fail_fast, and %s", ident["name"], why)
        record_point(sweep_dir, num, overrides=ident["overrides"], name=ident["name"], state="pending")
        return False
    record_point(
        sweep_dir, num, overrides=ident["overrides"], name=ident["name"], state="running", status=None
    )
    return True


def end_point(sweep_dir: Path, num: int, status: str, reason: str | None = None) -> None:
    """Record how sweep point ``num`` ended (its status: ``ok``, ``failed``, ``preempted``, ...).

    Also recorded: the one-line ``reason`` of a point refused before its job started (``invalid``: its folder
    has no summary, so the report reads the reason here)."""
    state = {"ok": "ok", "invalid": "invalid", "preempted": "preempted", "interrupted": "preempted"}
    record_point(sweep_dir, num, state=state.get(status, "failed"), status=status, error=reason)


def changed_overrides(run_dir: Path, overrides: list[str]) -> list[str]:
    """A resumed sweep point's overrides less those it started with (``run.json``) and the sweep's own keys.

    They are what resuming would change, for :func:`runner.launcher.resume.resume_config` to check."""
    started = set(read_json(run_dir / IDENTITY).get("overrides") or ())
    return [o for o in overrides if o not in started and not override_key(o).startswith("sweep.")]


#: How each decision is said on the terminal, after the point's name and state.
SAID = {
    "keep": "kept as it is",
    "resume": "resumed from its checkpoint",
    "run": "run",
    "skip": "kept as it ended (sweep.retry=false)",
}


def plan(
    sweep_dir: Path,
    grid: list[list[str]],
    sweep: list[str],
    retry: bool,
    composed: Callable[[list[str]], DictConfig] | None = None,
) -> list[tuple[int, list[str]]]:
    """The points of ``grid`` to launch, as ``(number, overrides)``.

    ``grid`` is each point's overrides, in the sweep's order. Each point's decision is said in one line and
    recorded in the manifest. A failed point to run again has its folder set aside; one kept as it failed
    counts as not ok for the exit status. ``composed``: the config a point's overrides compose to; each point
    kept or resumed must still hold it (:func:`check_points`), else nothing is decided and ValueError is
    raised."""
    points = []
    for num, overrides in enumerate(grid):
        state, status, has_checkpoint = point_state(sweep_dir / str(num))
        points.append((num, overrides, state, status, decide(state, has_checkpoint, retry)))
    if composed is not None:  # (a point run again is set aside: its folder's config no longer counts)
        check_points(sweep_dir, [(n, o) for n, o, _, _, decision in points if decision != "run"], composed)
    jobs = []
    for num, overrides, state, status, decision in points:
        point_dir = sweep_dir / str(num)
        ident = identity(list(overrides), sweep)
        log.info("[%s] point %d %s: %s", ident["name"], num, state, SAID[decision])
        entry = {"overrides": ident["overrides"], "name": ident["name"], "status": status}
        if decision == "resume":
            jobs.append((num, [*overrides, f"resume='{point_dir}'"]))
        elif decision == "run":
            if state != "pending":
                set_aside(point_dir)
            state, entry["status"] = "pending", None
            jobs.append((num, list(overrides)))
        elif decision == "skip":
            outcomes.NOT_OK.append(
                (ident["name"], status or state, EXIT.get(status or state, EXIT["failed"]))
            )
        record_point(sweep_dir, num, **entry, state=state)
    return jobs


def check_points(
    sweep_dir: Path, points: list[tuple[int, list[str]]], composed: Callable[[list[str]], DictConfig]
) -> None:
    """Refuse to resume a sweep whose points no longer hold the config their overrides compose to.

    ``points`` are ``(number, overrides)``; each point's config is read from its ``config.yaml``, and the one
    its overrides compose to is ``composed``'s. Such a point was edited since it ran, or is the run of another
    sweep. Names every such point's folder and its keys that differ."""
    found = []
    for num, overrides in points:
        if differ := edited_keys(sweep_dir / str(num), composed(overrides)):
            found.append(f"{sweep_dir / str(num)}: {', '.join(differ)}")
    if found:
        raise ValueError(
            f"resume={sweep_dir}: {len(found)} point(s) of the sweep no longer hold the config the sweep "
            f"gave them ({'; '.join(found)}); put the sweep's values back in the point's {CONFIG}, or move "
            "the point's folder out of the sweep folder (the point is then run again), or start a new sweep"
        )


def edited_keys(point_dir: Path, expected: DictConfig) -> list[str]:
    """``key=value (the sweep gives value)`` for each key of ``point_dir``'s ``config.yaml`` that differs.

    Its value differs from ``expected``'s (the config its overrides compose to, resolved key by key). Left
    out: the keys a resumed run may change (:func:`changeable`), those ``expected`` cannot resolve here and
    those only one of them has (the launcher's ``_schemas_``; a key added to mpitrain since the point ran;
    ``devices`` of a point resumed, which takes its checkpoint's count of workers)."""
    try:
        saved = OmegaConf.to_container(OmegaConf.create(read_text(point_dir / CONFIG)))
    except OSError as err:  # (a link or a pipe in its place: ForeignFile, which names it)
        return [f"its {CONFIG} cannot be read: {err}"]
    except Exception as err:  # (yaml's and OmegaConf's errors: the file is not a config)
        return [f"its {CONFIG} is not a config ({type(err).__name__})"]
    if not isinstance(saved, dict):
        return [f"its {CONFIG} is not a config"]
    want = flat(OmegaConf.to_container(expected, resolve=False))
    if saved.get("resume"):  # written by a resume, which sets devices to its checkpoint's workers (elastic)
        want.pop("devices", None)
    differ = []
    for key, value in flat(saved).items():
        if key not in want or changeable(key):
            continue
        try:
            mine = OmegaConf.select(expected, key, throw_on_missing=True)
        except OmegaConfBaseException:  # (an interpolation of Hydra's runtime, a value left missing)
            continue
        if isinstance(mine, (DictConfig, ListConfig)):
            mine = OmegaConf.to_container(mine, resolve=True, enum_to_str=True)
        mine = mine.name if isinstance(mine, Enum) else mine
        if mine != value:
            differ.append(f"{key}={value!r} (the sweep gives {mine!r})")
    return differ


def changeable(key: str) -> bool:
    """Whether ``key`` may differ between a resumed sweep's points and its command line.

    Such keys are the sweep's own (``sweep.*``), Hydra's and those a resumed run may change."""
    from runner.launcher.resume import SAFE_TO_CHANGE

    return key.startswith(("hydra.", "hydra/", "sweep.")) or any(
        key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_TO_CHANGE
    )


def set_aside(point_dir: Path) -> Path:
    """Move a point's folder to ``SWEEP_DIR/.attempts/N.K`` (K: its first free attempt number)."""
    attempts = point_dir.parent / ATTEMPTS
    attempts.mkdir(exist_ok=True)
    k = 1
    while (attempts / f"{point_dir.name}.{k}").exists():
        k += 1
    aside = attempts / f"{point_dir.name}.{k}"
    point_dir.rename(aside)
    log.info("%s: the failed attempt is kept as %s", point_dir, aside)
    return aside


def batches(jobs: list[tuple[int, list[str]]], size: int | None) -> list[tuple[int, list[list[str]]]]:
    """``jobs`` as launches of consecutive point numbers: ``(first number, overrides of each)``.

    A launcher numbers its jobs from the first. Each launch has at most ``size`` points (None: no limit)."""
    out: list[tuple[int, list[list[str]]]] = []
    for num, overrides in jobs:
        if out and out[-1][0] + len(out[-1][1]) == num and (size is None or len(out[-1][1]) < size):
            out[-1][1].append(overrides)
        else:
            out.append((num, [overrides]))
    return out


def resumed_argv(argv: list[str]) -> list[str] | None:
    """The command line that finishes the sweep ``argv``'s ``resume=SWEEP_DIR`` names.

    It has the sweep's own overrides (its ``multirun.yaml``), its launcher, ``argv``'s other arguments (which
    win over the sweep's for the same key), ``hydra.sweep.dir=SWEEP_DIR`` and ``hydra.sweeper.resume=true``
    (:class:`runner.launcher.sweeper.MpitrainSweeper`). None when ``argv`` does not resume a sweep folder.
    Raises ValueError for a sweep that cannot be resumed so."""
    given = [a for a in argv if a.startswith("resume=")]
    if not given:
        return None
    path = Path(given[-1].split("=", 1)[1].strip("'\"")).expanduser()
    if not is_sweep_folder(path):
        return None
    recorded = OmegaConf.load(path / SWEEP_CONFIG)
    sweeper = str(OmegaConf.select(recorded, "hydra.sweeper._target_", default=""))
    if not sweeper.endswith(("BasicSweeper", "MpitrainSweeper")):
        raise ValueError(
            f"resume={path}: the sweep was run by {sweeper}, whose points are drawn, not a grid: only a grid "
            "sweep (Hydra's basic sweeper) can be resumed point by point; resume its runs one by one "
            "(resume=SWEEP_DIR/N)"
        )
    subdir = OmegaConf.to_container(recorded.hydra.sweep, resolve=False).get("subdir")
    if subdir != "${hydra.job.num}":
        raise ValueError(
            f"resume={path}: its points' folders are named hydra.sweep.subdir={subdir}, not by their number "
            "(${hydra.job.num}, the default): resume its runs one by one (resume=SWEEP_DIR/POINT)"
        )
    rest = [a for a in argv if a not in given and a not in ("-m", "--multirun")]
    mine = {override_key(a) for a in rest if "=" in a}
    check_changes(path, mine, swept_keys(list(recorded.hydra.overrides.task)))
    own = ("resume", "hydra.mode", "hydra.sweep.dir", "hydra/sweeper", "hydra.sweeper.resume", *mine)
    check_foreign(path, recorded, rest, mine)
    task = [restored_override(o) for o in recorded.hydra.overrides.task if override_key(o) not in own]
    launcher = [o for o in recorded.hydra.overrides.hydra if override_key(o) not in own]
    return ["-m", *launcher, *task, *rest, f"hydra.sweep.dir={path}", "hydra.sweeper.resume=true"]


def check_foreign(path: Path, recorded: DictConfig, rest: list[str], mine: set[str]) -> None:
    """Refuse to finish, with overrides it records, a sweep folder that is not the user's own.

    Not the user's own: no mark of theirs over its recorded overrides (:mod:`runner.schema.provenance`). The
    overrides refused are those that run a program, set the ranks' environment or name a destination, unless
    the command line gives that key or ``trust_folder=true``."""
    trusted = any(
        override_key(a) == provenance.TRUST and a.split("=", 1)[1].strip().lower() in ("true", "1", "yes")
        for a in rest
        if "=" in a
    )
    overrides = recorded.hydra.overrides
    if trusted or provenance.is_own(path, text=provenance.sweep_text(overrides)):
        return
    found = provenance.foreign_overrides([*overrides.task, *overrides.hydra], mine)
    if found:
        raise ValueError(
            f"resume={path}: this sweep folder was not written by your runner (it has no mark of yours, or "
            f"its {SWEEP_CONFIG} was changed since), so its recorded overrides cannot set: "
            f"{'; '.join(found)}. Give your own value of each on the command line, or add "
            f"{provenance.TRUST}=true if you trust "
            'this folder (docs/reliability.md, "Run folders from elsewhere")'
        )


def swept_keys(task: list[str]) -> set[str]:
    """The keys a sweep's recorded overrides ``task`` vary (``optim.lr=0.1,0.2``, ``range(...)``)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    return {
        o.get_key_element().lstrip("+~")
        for o in OverridesParser.create().parse_overrides(task)
        if o.is_sweep_override()
    }


def check_changes(path: Path, keys: set[str], swept: set[str]) -> None:
    """Refuse overrides given with ``resume=SWEEP_DIR`` that would make its points differ.

    Only the sweep's own keys (``sweep.*``), Hydra's (the launcher's) and those a resumed run may change are
    taken, and none the sweep varies (each point's value is its own: a new one would be filed under the
    old)."""
    from runner.launcher.resume import SAFE_TO_CHANGE

    for key in sorted(keys & swept):
        raise ValueError(
            f"{key}: cannot change when resuming the sweep {path}: the sweep varies it (each point has its "
            "own value, and a point run with another would be kept as the one it was); drop it, or start a "
            "new sweep over the values you want"
        )
    for key in sorted(keys):
        if not changeable(key):
            raise ValueError(
                f"{key}: cannot change when resuming the sweep {path} (its points would differ); drop it, "
                "or start a new sweep. Safe to change: sweep.*, hydra.*, "
                + ", ".join(s.rstrip(".") + ("*" if s.endswith(".") else "") for s in SAFE_TO_CHANGE)
            )
