"""The Weights & Biases tracker: a W&B run whose id comes from the run folder (a resumed run continues it)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from runner.rank.records.tracking.base import Tracker
from runner.rank.records.tracking.run_info import RunInfo, compared, summary_numbers
from runner.run_folder import EXIT
from runner.schema.logger.wandb import WandbConfig


class WandbTracker(Tracker):
    """A Weights & Biases run (its id made from the run folder, so a resumed run continues it)."""

    def __init__(self, cfg: WandbConfig, run: RunInfo):
        import wandb

        self.cfg = cfg
        self.run = wandb.init(
            project=cfg.project,
            entity=cfg.entity,
            mode=cfg.mode,
            dir=cfg.dir or (None if os.environ.get("WANDB_DIR") else str(run.dir)),
            group=cfg.group or (str(run.sweep.resolve())[-128:] if run.sweep is not None else None),
            name=cfg.name or run.name,
            tags=list(cfg.tags) or None,
            id=hashlib.sha1(run.key.encode()).hexdigest()[:16],
            resume="allow",
            config={**run.config, "compared": compared(run), "swept": run.swept},
            settings=wandb.Settings(console="off", silent=True),
        )

    def write(self, kind: str, step: int, values: list[tuple[str, float]]) -> None:
        if values:
            self.run.log({f"{kind}/{k}": v for k, v in values}, step=step)

    def finish(self, summary: dict[str, Any], model: Path | None) -> None:
        import wandb

        status = summary.get("status", "ok")
        self.run.summary.update({**summary_numbers(summary), "status": status})
        if model is not None and self.cfg.log_model:
            artifact = wandb.Artifact(f"model-{self.run.id}", type="model")
            artifact.add_file(str(model))
            self.run.log_artifact(artifact)
        self.run.finish(exit_code=EXIT.get(status, EXIT["failed"]))

    def fail(self, cause: str) -> None:
        self.run.summary.update({"status": "failed", "failure": cause})
        self.run.finish(exit_code=EXIT["failed"])
