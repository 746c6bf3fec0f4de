"""Trackers: where the writing rank sends a run's records besides ``metrics.jsonl`` (the ``logger`` group).

Each logger of ``runner/schema/logger/`` has its tracker here, one module each (:data:`TRACKERS`), built on
the writing rank (rank 0, or the lowest survivor that takes the records over) by :class:`Trackers`. Every
tracker gets the same records under the same names, ``<kind>/<key>`` (``step/loss``, ``val/val_acc``), names
the run as ``run.json`` does (the sweep point, ``rule.alpha=0.5,optim.lr=0.1``), and records the same compared
keys (:func:`compared`: the rule and every rule's keys, model, data, optimizer and lr, devices, transport,
batch size, seed, ``simulate.*``, and every swept key), varied or not, so that a table over several sweeps has
none blank: a rule's key that another rule lacks reads :data:`NOT_APPLICABLE` on that rule's runs
(``rule.alpha`` of a BSP run), and each key is given one type in every run (:func:`hparam_kinds`):

- TensorBoard: event files in ``RUN_DIR/tb/<run name>/``; the compared keys as the run's hparams (session
  start info, its trial named by :func:`trial_name`), and at the end the outcome (:data:`OUTCOME`:
  ``Outcome/final_val_acc``, ``Outcome/best_val_acc``, final loss, steps, training time) as scalars whose tags
  sort before every record's, since TensorBoard's HParams table lists its metrics by tag and ticks the first
  five. No experiment summary: TensorBoard then takes the table's columns from every run it finds and marks
  those that differ (from an experiment summary it takes one arbitrary run's, and its types and values filter
  the others' rows).
- MLflow: the config (flattened, ``optim.lr``), the compared keys and the swept values as params, tags
  ``rule``, ``model``, ``data``, ``optim``; the records as metrics, the summary's numbers as metrics,
  config.yaml, summary.json and model.pt as artifacts. Without a tracking URI (the key or
  ``MLFLOW_TRACKING_URI``), the store is ``mlflow.db`` in the sweep folder (a single run: its run folder)
  with the artifacts beside it (:func:`default_store`), never the working folder.
- W&B: the config, the compared keys (``compared``) and the swept values (``swept``) as the run's config,
  the records, the summary's numbers as its summary, model.pt as a model artifact; a sweep's runs grouped
  by the sweep folder.

A resumed run, or a survivor taking the records over, continues the same MLflow run (found by its tag
``mpitrain.run_dir``) and W&B run (its id is made from the run folder's path). TensorBoard writes into the
run folder as metrics.jsonl does, and a failure to write there ends the run as theirs does; MLflow and W&B
are optional: a failure of theirs is named in one line on the rank's output, that tracker records nothing
more, and training goes on.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from runner.rank.records.output import root_cause
from runner.rank.records.tracking.base import Tracker
from runner.rank.records.tracking.mlflow_tracker import MLflowTracker
from runner.rank.records.tracking.run_info import (
    NAME_BYTES,
    RunInfo,
    folder_name,
    hparam_kinds,
    option_schemas,
    scalars,
)
from runner.rank.records.tracking.tensorboard_tracker import TensorBoardTracker
from runner.rank.records.tracking.wandb_tracker import WandbTracker
from runner.schema.logger import LoggerConfig, as_loggers

#: Logger name (``conf/logger/<name>.yaml``) -> its tracker.
TRACKERS: dict[str, Callable[[Any, RunInfo], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MLflowTracker,
    "wandb": WandbTracker,
}


class Trackers:
    """The trackers of the loggers chosen, on the writing rank.

    Each call goes to every tracker still recording. An optional tracker that fails (at its start too) is
    named in one line on this rank's output (its log, and the terminal for rank 0) with the cause, and
    records nothing more; training goes on. A failure of a tracker that is not optional (TensorBoard, in
    the run folder) is raised."""

    def __init__(self, loggers: dict[str, LoggerConfig | dict], run: RunInfo):
        self.live: dict[str, Tracker] = {}
        for name, cfg in as_loggers(loggers).items():
            try:
                self.live[name] = TRACKERS[name](cfg, run)
            except Exception as err:
                if not getattr(TRACKERS[name], "optional", True):
                    raise
                self._drop(name, "start", err)

    def call(self, method: str, *args: Any) -> None:
        """``tracker.<method>(*args)`` of every tracker still recording."""
        for name, tracker in list(self.live.items()):
            try:
                getattr(tracker, method)(*args)
            except Exception as err:
                if not tracker.optional:
                    raise
                self._drop(name, method, err)

    def _drop(self, name: str, action: str, err: BaseException) -> None:
        self.live.pop(name, None)
        print(
            f"logger={name}: {action} failed, so it records nothing more of this run (training goes on; "
            f"metrics.jsonl has every record): {root_cause(err)}",
            file=sys.stderr,
            flush=True,
        )


__all__ = [
    "NAME_BYTES",
    "TRACKERS",
    "MLflowTracker",
    "RunInfo",
    "TensorBoardTracker",
    "Tracker",
    "Trackers",
    "WandbTracker",
    "folder_name",
    "hparam_kinds",
    "option_schemas",
    "scalars",
]
