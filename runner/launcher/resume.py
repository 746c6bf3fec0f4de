"""``resume=RUN_DIR``: continue a run in its own folder from its latest complete checkpoint.

The run's saved ``config.yaml`` is the config; overrides given with ``resume=`` are refused unless they
cannot change what the checkpoint means (how long to train, logging, checkpoints, where the ranks run).
Read by the launcher, so nothing here imports torch.
"""

from __future__ import annotations

import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from runner.run_folder import CHECKPOINT_INDEX, CHECKPOINTS, CONFIG, LOGS, read_checkpoint_index
from runner.schema.config import load_structured
from runner.schema.identity import override_key

#: Keys (or key prefixes, ending in ".") that a resumed run may change.
SAFE_TO_CHANGE = (
    "train.epochs",
    "train.max_steps",
    "train.progress",
    "train.stall_timeout",
    "train.on_nonfinite",
    "train.log_every",
    "train.val_every",
    "train.save_model",
    "checkpoint.",
    "hardware.",
    "simulate.",
    "resume",
)


def _safe(key: str) -> bool:
    return key.startswith("hydra.") or any(
        key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_TO_CHANGE
    )


def resume_config(cfg: DictConfig, overrides: list[str]) -> tuple[DictConfig, Path]:
    """The config and run folder to resume ``cfg.resume`` with: the run's own config plus the command
    line's safe ``overrides`` (Hydra's ``key=value`` strings, whose values ``cfg`` holds parsed).

    Raises ValueError naming the key or file and the fix. Sets aside the previous attempt's error files, so
    they are not taken for this attempt's (the launcher removes its stop request, as for every job).
    """
    run_dir = Path(cfg.resume).expanduser()
    if not (run_dir / CONFIG).is_file():
        raise ValueError(
            f"resume={cfg.resume}: {run_dir / CONFIG} does not exist; give the folder of a run "
            "(e.g. resume=outputs/2026-01-31/12-00-00)"
        )
    if not read_checkpoint_index(run_dir):
        index = run_dir / CHECKPOINTS / CHECKPOINT_INDEX
        raise ValueError(
            f"resume={cfg.resume}: the run has no complete checkpoint ({index} is missing): it stopped "
            "before its first one, so start it again (checkpoint.every=N checkpoints every N steps)"
        )
    for override in overrides:
        key = override_key(override)
        if not _safe(key):
            raise ValueError(
                f"{key}: cannot change when resuming (the checkpoint was trained with the run's own value); "
                f"drop {override!r}, or start a new run. Safe to change: "
                + ", ".join(s.rstrip(".") + ("*" if s.endswith(".") else "") for s in SAFE_TO_CHANGE)
            )
    resumed = load_structured(run_dir / CONFIG)
    for override in overrides:
        key = override_key(override)
        if not key.startswith("hydra.") and key != "resume":
            OmegaConf.update(resumed, key, OmegaConf.select(cfg, key), force_add=True)
    latest = read_checkpoint_index(run_dir)[-1]
    ranks = resumed.devices + OmegaConf.to_object(resumed.rule).extra_ranks()
    if latest["world_size"] < ranks:  # the run went on without lost workers (fault tolerance)
        resumed.devices -= ranks - latest["world_size"]
        logging.getLogger("runner").info(
            "the run had lost %d worker(s) by its checkpoint %s: resuming with devices=%d",
            ranks - latest["world_size"],
            latest["dir"],
            resumed.devices,
        )
    resumed.resume = str(run_dir)
    for error in (run_dir / LOGS).glob("rank*.error"):
        error.rename(error.with_name(error.name + ".before-resume"))
    return resumed, run_dir
