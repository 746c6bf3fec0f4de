"""MLflow tracking: the config as params, the records as metrics, the model file as an artifact.

The compared keys are params too, the rule, model, data and optimizer tags;
runner/rank/records/tracking/mlflow_tracker.py writes them (``pip install "mpitrain[mlflow]"``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runner.schema.logger import LoggerConfig


@dataclass
class MLflowConfig(LoggerConfig):
    """Where and how a run is recorded in MLflow.

    ``tracking_uri``: where runs go (``sqlite:////abs/mlflow.db``, ``http://host:5000``, ``file:/abs/mlruns``;
    null: ``MLFLOW_TRACKING_URI`` when set, else ``mlflow.db`` in the sweep folder, or in a single run's
    folder; never the working folder). ``experiment``: the experiment's name.
    ``run_name``: null names the run as the sweep point (``rule.alpha=0.5,optim.lr=0.1``). ``tags``: added
    to every run. ``log_model``: upload ``model.pt`` as an artifact (the config and summary always are).
    """

    package = "mlflow"

    tracking_uri: str | None = None
    experiment: str = "mpitrain"
    run_name: str | None = None
    tags: dict[str, str] = field(default_factory=dict)
    log_model: bool = True

    def __post_init__(self) -> None:
        self.require(
            bool(self.experiment), "experiment", self.experiment, "an MLflow experiment name (e.g. mpitrain)"
        )
