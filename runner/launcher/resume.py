"""``resume=RUN_DIR``: continue a run in its own folder from its latest intact checkpoint.

The run's saved ``config.yaml`` is the config; overrides given with ``resume=`` are refused unless they
cannot change what the checkpoint means (how long to train, logging, checkpoints, where the ranks run).

The checkpoint is chosen here, before any rank starts, so that every rank resumes from the same one: a
damaged ``checkpoint.json`` is rebuilt from the checkpoint folders, each part of the newest checkpoint is
checked against the size and CRC-32 written with it, and a damaged checkpoint is named, set aside
(``<folder>.damaged``) and dropped from the index for the newest intact one, in one line each. Read by the
launcher, so nothing here imports torch.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from runner.run_folder import (
    CHECKPOINT_INDEX,
    CHECKPOINTS,
    CONFIG,
    DAMAGED_SUFFIX,
    LOGS,
    SUMMARY,
    DamagedIndex,
    checkpoint_damage,
    dumps,
    read_checkpoint_index,
    read_json,
    rebuild_checkpoint_index,
    write_atomic,
)
from runner.schema import provenance
from runner.schema.config import load_structured
from runner.schema.identity import override_key
from runner.schema.secrets import fill_hidden
from runner.schema.trust import check_paths, targets

log = logging.getLogger("runner")
ENV = "hardware.env."

#: Keys (or key prefixes, ending in ".") that a resumed run may change.
SAFE_TO_CHANGE = (
    "train.epochs",
    "train.max_steps",
    "train.progress",
    "train.stall_timeout",
    "train.on_nonfinite",
    "train.log_every",
    "train.val_every",
    "train.val_samples",
    "train.save_model",
    "checkpoint.",
    "hardware.",
    "simulate.",
    "resume",
    "trust_folder",
    "logger",
    "logger.",
)


def _safe(key: str) -> bool:
    return key.startswith("hydra.") or any(
        key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_TO_CHANGE
    )


def resume_config(cfg: DictConfig, overrides: list[str]) -> tuple[DictConfig, Path]:
    """The config and run folder to resume ``cfg.resume`` with.

    The config is the run's own plus the command line's safe ``overrides`` (Hydra's ``key=value`` strings,
    whose values ``cfg`` holds parsed).

    Raises ValueError naming the key or file and the fix. Sets aside the previous attempt's error files, so
    they are not taken for this attempt's (the launcher removes its stop request, as for every job).
    """
    run_dir = Path(cfg.resume).expanduser()
    if not (run_dir / CONFIG).is_file():
        raise ValueError(
            f"resume={cfg.resume}: {run_dir / CONFIG} does not exist; give the folder of a run "
            "(e.g. resume=outputs/2026-01-31/12-00-00)"
        )
    for override in overrides:
        key = override_key(override)
        if not _safe(key):
            raise ValueError(
                f"{key}: cannot change when resuming (the checkpoint was trained with the run's own value); "
                f"drop {override!r}, or start a new run. Safe to change: "
                + ", ".join(s.rstrip(".") + ("*" if s.endswith(".") else "") for s in SAFE_TO_CHANGE)
            )
    resumed = load_structured(run_dir / CONFIG)  # its _schemas_ checked before any is imported
    check_targets(resumed, run_dir / CONFIG)
    if not cfg.get(provenance.TRUST) and not provenance.is_own(run_dir):
        refuse_foreign(cfg, overrides, run_dir)
    trained = (resumed.train.epochs, resumed.train.max_steps)
    for override in overrides:
        key = override_key(override)
        if not key.startswith("hydra.") and key not in ("resume", provenance.TRUST):
            # a map given whole replaces the folder's (hardware.env={} drops the folder's variables)
            whole = provenance.listed(key + ".") is not None
            OmegaConf.update(resumed, key, OmegaConf.select(cfg, key), merge=not whole, force_add=True)
    done = finished(run_dir, trained, (resumed.train.epochs, resumed.train.max_steps))
    if done is not None:
        raise Finished(f"resume={cfg.resume}: {done}")
    restore_env(resumed, overrides, run_dir / CONFIG)
    latest = resume_checkpoint(run_dir, cfg.resume)
    ranks = resumed.devices + OmegaConf.to_object(resumed.rule).extra_ranks()
    if latest["world_size"] != ranks:  # workers were lost (fault tolerance), or joined (elastic)
        change = latest["world_size"] - ranks
        resumed.devices += change
        log.info(
            "the run had %s %d worker(s) by its checkpoint %s: resuming with devices=%d",
            "lost" if change < 0 else "grown by",
            abs(change),
            latest["dir"],
            resumed.devices,
        )
    resumed.resume = str(run_dir)
    for error in (run_dir / LOGS).glob("rank*.error"):
        error.rename(error.with_name(error.name + ".before-resume"))
    return resumed, run_dir


def refuse_foreign(cfg: DictConfig, overrides: list[str], run_dir: Path) -> None:
    """Refuse to resume, with values the user did not give, a run folder that is not the user's own.

    Ownership is told by :mod:`runner.schema.provenance`. The values refused are those of a key that runs a
    program, sets the ranks' environment or names a destination, where it differs from the user's config and
    the command line does not give it; names them all, and the fixes."""
    folder = OmegaConf.to_container(OmegaConf.load(run_dir / CONFIG))
    given = {override_key(o) for o in overrides}
    found = provenance.foreign_values(folder, lambda key: OmegaConf.select(cfg, key, default=MISSING), given)
    if found:
        raise ValueError(
            f"resume={cfg.resume}: this run folder was not written by your runner (it has no mark of yours, "
            f"or its {CONFIG} was changed since), so its config cannot set: {'; '.join(found)}. Give your "
            "own value of each on the command line (hardware.mpirun=null, hardware.env={}, "
            f"hardware.extra_args=[], ...), or add {provenance.TRUST}=true if you trust this folder "
            '(docs/reliability.md, "Run folders from elsewhere")'
        )


def restore_env(resumed: DictConfig, overrides: list[str], config: Path) -> None:
    """Give the run's ``hardware.env`` its values back (``config.yaml`` keeps none, they are secrets).

    They come from the command line's ``hardware.env`` overrides, else the launcher's environment
    (:func:`fill_hidden`)."""
    keys = [override_key(o) for o in overrides]
    env = OmegaConf.to_container(resumed.hardware.env)
    given = set(env) if "hardware.env" in keys else {k.split(".", 2)[2] for k in keys if k.startswith(ENV)}
    fill_hidden(env, given, config)
    resumed.hardware.env = env


class Finished(Exception):
    """``resume=`` of a run that ended ok and would train no further: exit 0, nothing written."""


def finished(run_dir: Path, trained: tuple[Any, Any], asked: tuple[Any, Any]) -> str | None:
    """Why resuming ``run_dir`` has nothing to do, or None.

    Nothing is left to do when its last job ended ok (``summary.json`` newer than the ``config.yaml`` every
    job writes when it starts, so no later job was cut short) and the run's length (``trained``: its
    ``train.epochs``, ``train.max_steps``) is what is ``asked`` now."""
    summary_path = run_dir / SUMMARY
    result = read_json(summary_path)
    try:
        current = summary_path.stat().st_mtime >= (run_dir / CONFIG).stat().st_mtime
    except OSError:
        return None
    if result.get("status") != "ok" or not current or tuple(asked) != tuple(trained):
        return None
    monitor = result.get("monitor", "val_acc")
    final = result.get(f"final_{monitor}")
    shown = f", final {monitor} {final:.4f}" if isinstance(final, (int, float)) else ""
    epochs, max_steps = trained
    return (
        f"the run finished ({result.get('steps')} steps{shown}): nothing to resume, nothing was written. "
        f"To train it further, give it a longer run: resume={run_dir} train.epochs=N (now {epochs}"
        + (f", train.max_steps {max_steps})" if max_steps is not None else ")")
    )


def check_targets(resumed: DictConfig, config: Path) -> None:
    """Refuse a ``config.yaml`` whose ``_target_`` nodes are not the kind of object their keys build.

    The file is a run folder's; the check is :mod:`runner.schema.trust`'s: the standard library's targets
    here, without importing anything; the rest by ``python -m runner.schema.trust`` (which imports the
    targets' modules and torch, which this process does not), only when there is any. Raises ValueError with
    its reason."""
    found = targets(OmegaConf.to_container(resumed, resolve=True))
    if not found:
        return
    check_paths(found, str(config))
    argv = [sys.executable, "-m", "runner.schema.trust", str(config)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise ValueError(f"{config}: its targets could not be checked ({err})") from None
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines()
        if done.returncode == 2 and lines:
            raise ValueError(lines[-1])
        raise ValueError(
            f"{config}: its targets could not be checked (python -m runner.schema.trust, exit "
            f"{done.returncode}): {done.stderr.strip()}"
        )


def resume_checkpoint(run_dir: Path, given: str) -> dict[str, Any]:
    """The index entry of the checkpoint to resume ``run_dir`` from: the newest intact one.

    Newer damaged ones are named in one line, set aside and dropped from the index, so the ranks, which resume
    from the index's newest, all take this one. Raises ValueError (``given``: the ``resume=`` value) when none
    is left, naming the files and the fix."""
    entries = indexed_checkpoints(run_dir, given)
    damaged = []
    for entry in reversed(entries):
        found = checkpoint_damage(run_dir, entry)
        if found is None:
            break
        damaged.append((entry, *found))
    else:
        raise ValueError(
            f"resume={given}: no intact checkpoint is left: {_damage(run_dir, damaged)}; start the run again "
            "(without resume=), or put the damaged files back from a copy"
        )
    if damaged:
        index = run_dir / CHECKPOINTS / CHECKPOINT_INDEX
        write_atomic(index, dumps({"checkpoints": entries[: entries.index(entry) + 1]}, indent=1))
        for bad, _, _ in damaged:
            folder = run_dir / CHECKPOINTS / bad["dir"]
            aside = folder.with_name(folder.name + DAMAGED_SUFFIX)
            if folder.is_dir():
                shutil.rmtree(aside, ignore_errors=True)
                folder.rename(aside)
        if len(damaged) == 1:
            _, path, problem = damaged[0]
            what = f"checkpoint {path.relative_to(run_dir)} is damaged ({problem})"
        else:
            what = f"checkpoints {_damage(run_dir, damaged)} are damaged"
        aside = ", ".join(bad["dir"] + DAMAGED_SUFFIX for bad, _, _ in damaged)
        log.warning("%s: resuming from %s (set aside as %s)", what, entry["dir"], aside)
    return entry


def _damage(run_dir: Path, damaged: list[tuple[dict[str, Any], Path, str]]) -> str:
    """``checkpoints/00003-step60/rank0.pt (truncated: 10 of 20 bytes), ...``: each damaged file and why."""
    return ", ".join(f"{path.relative_to(run_dir)} ({problem})" for _, path, problem in damaged)


def indexed_checkpoints(run_dir: Path, given: str) -> list[dict[str, Any]]:
    """The run's indexed checkpoints, oldest first.

    A damaged or missing index is rebuilt from the checkpoint folders (and written again, said in one line).
    Raises ValueError when there is none."""
    index = run_dir / CHECKPOINTS / CHECKPOINT_INDEX
    try:
        entries = read_checkpoint_index(run_dir)
        damage = None if entries else ("is missing" if not index.exists() else "names no checkpoint")
    except DamagedIndex as err:
        entries, damage = [], f"is damaged ({err.problem})"
    if damage is None:
        return entries
    entries, skipped = rebuild_checkpoint_index(run_dir)
    left_out = f"; left out: {'; '.join(skipped)}" if skipped else ""
    if not entries:
        raise ValueError(
            f"resume={given}: the run has no complete checkpoint to resume from ({index} {damage}{left_out}):"
            " start the run again without resume= (checkpoint.every=N checkpoints every N steps)"
        )
    write_atomic(index, dumps({"checkpoints": entries}, indent=1))
    log.warning(
        "%s %s: rebuilt from the checkpoint folders (%s)%s",
        index.relative_to(run_dir),
        damage,
        ", ".join(e["dir"] for e in entries),
        left_out,
    )
    return entries
