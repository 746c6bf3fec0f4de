"""MLflow's tracker: params, metrics and artifacts of an MLflow run (found again by its run folder's tag)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from runner.folder_files import is_regular
from runner.rank.records.tracking.base import Tracker
from runner.rank.records.tracking.run_info import (
    NAMED,
    PARAM_CHARS,
    RunInfo,
    compared,
    flat,
    summary_numbers,
    text,
)
from runner.run_folder import CONFIG, SUMMARY
from runner.schema.logger.mlflow import MLflowConfig

#: MLflow's tag of the run folder (absolute), by which a resumed run finds its MLflow run.
RUN_DIR_TAG = "mpitrain.run_dir"

#: The MLflow store, in the sweep folder (a single run: its run folder), when no tracking URI is given.
STORE = "mlflow.db"

#: The MLflow artifacts' folder beside :data:`STORE`.
ARTIFACTS = "mlartifacts"


def default_store(run: RunInfo) -> str:
    """MLflow's store when no tracking URI is given.

    :data:`STORE` in the sweep folder, so that one ``mlflow ui`` shows a sweep's runs together, or in a single
    run's folder; never the working folder (MLflow's own default), which a run does not own."""
    return f"sqlite:///{(run.sweep if run.sweep is not None else run.dir).resolve() / STORE}"


def sqlite_file(uri: str) -> Path | None:
    """The file of a local SQLite store's URI (``sqlite:///path``), else None.

    A new experiment there keeps its artifacts beside it (:data:`ARTIFACTS`), not in MLflow's default
    ``./mlruns``."""
    if not uri.startswith("sqlite:///") or uri.startswith("sqlite:///:memory:"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0]).resolve()


@contextmanager
def store_lock(store: Path | None) -> Iterator[None]:
    """Hold a lock beside the SQLite file ``store`` (None.

    No lock): sweep points starting at once would each make its tables, and all but one fail (``duplicate
    column name``)."""
    if store is None:
        yield
        return
    import fcntl

    with open(f"{store}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class MLflowTracker(Tracker):
    """An MLflow run, through ``MlflowClient`` (no global state): params, metrics, artifacts."""

    def __init__(self, cfg: MLflowConfig, run: RunInfo):
        uri = cfg.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or default_store(run)
        if uri.startswith("file:"):  # chosen: MLflow 3 asks for it to be allowed
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        # MLflow's usage telemetry (a file in the home folder, messages out) only where the user asks for it
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
        from mlflow.tracking import MlflowClient

        self.cfg, self.run = cfg, run
        self.compared = {k: text(v) for k, v in compared(run).items()}
        store = sqlite_file(uri)
        self.artifacts = None if store is None else (store.parent / ARTIFACTS).as_uri()
        with store_lock(store):
            self.client = MlflowClient(tracking_uri=uri)  # makes a new store's tables
            experiment = self._experiment()
        found = self._earlier_run(experiment) if run.continued else None
        tags = {
            **{k: self.compared[k] for k in NAMED},
            **cfg.tags,
            RUN_DIR_TAG: run.key,
            "mpitrain.name": run.name,
        }
        if run.sweep is not None:
            tags["mpitrain.sweep"] = str(run.sweep.resolve())
        if found is not None:
            self.run_id = found.info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
            self._tags({k: v for k, v in tags.items() if k not in found.data.tags})
        else:
            start = None if run.started is None else int(run.started * 1000)  # the job's, not rank 0's
            made = self.client.create_run(
                experiment, start_time=start, run_name=cfg.run_name or run.name, tags=tags
            )
            self.run_id = made.info.run_id
        self._params(set() if found is None else set(found.data.params))
        if is_regular(run.dir / CONFIG):  # (a link's target is not the run's to upload)
            self.client.log_artifact(self.run_id, str(run.dir / CONFIG))

    def _experiment(self) -> str:
        """The experiment's id; made when it does not exist (by another sweep point at the same time, too)."""
        for _ in range(3):
            found = self.client.get_experiment_by_name(self.cfg.experiment)
            if found is not None:
                return found.experiment_id
            try:
                return self.client.create_experiment(self.cfg.experiment, self.artifacts)
            except Exception:  # made meanwhile by a concurrent run: look it up again
                time.sleep(0.2)
        raise RuntimeError(f"cannot find or create the MLflow experiment {self.cfg.experiment!r}")

    def _earlier_run(self, experiment: str) -> Any:
        """This run folder's MLflow run, recorded by an earlier job or rank, or None."""
        query = f"tags.`{RUN_DIR_TAG}` = '{self.run.key}'"
        runs = self.client.search_runs([experiment], filter_string=query, max_results=1)
        return runs[0] if runs else None

    def _tags(self, tags: dict[str, str]) -> None:
        """Set ``tags`` on the run (a continued run: those it lacks, from a version before them)."""
        from mlflow.entities import RunTag

        if tags:
            self.client.log_batch(self.run_id, tags=[RunTag(k, v[:PARAM_CHARS]) for k, v in tags.items()])

    def _params(self, logged: set[str]) -> None:
        """The config flattened, the compared keys and the swept values (a group's option too.

        ``rule=easgd``) as params; a continued run logs only those it lacks (MLflow refuses to change a
        param)."""
        from mlflow.entities import Param

        swept = {k: text(v) for k, v in self.run.swept.items()}
        params = {**flat(self.run.config), **self.compared, **swept}
        batch = [Param(k, v[:PARAM_CHARS]) for k, v in params.items() if k not in logged]
        for start in range(0, len(batch), 100):  # MLflow takes at most 100 params a call
            self.client.log_batch(self.run_id, params=batch[start : start + 100])

    def write(self, kind: str, step: int, values: list[tuple[str, float]]) -> None:
        self._metrics({f"{kind}/{k}": v for k, v in values}, step)

    def _metrics(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in values.items()]
        for start in range(0, len(metrics), 1000):  # MLflow takes at most 1000 metrics a call
            self.client.log_batch(self.run_id, metrics=metrics[start : start + 1000])

    def finish(self, summary: dict[str, Any], model: Path | None) -> None:
        self._metrics(summary_numbers(summary), int(summary.get("steps") or 0))
        if is_regular(self.run.dir / SUMMARY):
            self.client.log_artifact(self.run_id, str(self.run.dir / SUMMARY))
        if model is not None and self.cfg.log_model:
            self.client.log_artifact(self.run_id, str(model))
        status = summary.get("status", "ok")
        ended = {"ok": "FINISHED", "preempted": "KILLED", "interrupted": "KILLED"}.get(status, "FAILED")
        self.client.set_terminated(self.run_id, ended)

    def fail(self, cause: str) -> None:
        self.client.set_tag(self.run_id, "mpitrain.failure", cause[:PARAM_CHARS])
        self.client.set_terminated(self.run_id, "FAILED")
