"""Weights & Biases: the config, the records, the summary and the model file as an artifact.

runner/rank/records/tracking/wandb_tracker.py writes them (``pip install "mpitrain[wandb]"``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.schema.logger import LoggerConfig

#: ``mode``: online syncs as it goes, offline writes the run's files locally (``wandb sync DIR`` uploads them
#: later), disabled writes nothing.
MODES = ("online", "offline", "disabled")


@dataclass
class WandbConfig(LoggerConfig):
    """Where and how a run is recorded in Weights & Biases.

    ``project`` and ``entity`` (null: your default entity) name where runs go. ``mode``: online, offline or
    disabled (null: ``WANDB_MODE``, else online). ``dir``: where wandb keeps its files (null: ``WANDB_DIR``,
    else the run folder). ``group``: null groups a sweep's runs under the sweep folder's path. ``name``:
    null names the run as the sweep point. ``tags``: added to every run. ``log_model``: upload ``model.pt``
    as a model artifact.
    """

    package = "wandb"

    project: str = "mpitrain"
    entity: str | None = None
    mode: str | None = None
    dir: str | None = None
    group: str | None = None
    name: str | None = None
    tags: list[str] = field(default_factory=list)
    log_model: bool = True

    def __post_init__(self) -> None:
        self.require(
            self.mode is None or self.mode in MODES,
            "mode",
            self.mode,
            f"choose one of {', '.join(MODES)}, or null (WANDB_MODE, else online)",
        )
