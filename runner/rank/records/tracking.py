"""Trackers: where the writing rank sends a run's records besides ``metrics.jsonl`` (the ``logger`` group).

Each logger of ``runner/schema/logger/`` has its tracker here (:data:`TRACKERS`), built on the writing rank
(rank 0, or the lowest survivor that takes the records over) by :class:`Trackers`. Every tracker gets the
same records under the same names, ``<kind>/<key>`` (``step/loss``, ``val/val_acc``), names the run as
``run.json`` does (the sweep point, ``rule.alpha=0.5,optim.lr=0.1``), and records the same compared keys
(:func:`compared`: the rule and every rule's keys, model, data, optimizer and lr, devices, transport, batch
size, seed, ``simulate.*``, and every swept key), varied or not, so that a table over several sweeps has none
blank: a rule's key that another rule lacks reads :data:`NOT_APPLICABLE` on that rule's runs
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

import dataclasses
import functools
import hashlib
import json
import math
import os
import sys
import time
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.folder_files import is_regular, open_in_folder
from runner.rank.records.output import root_cause
from runner.run_folder import CONFIG, EXIT, IDENTITY, SUMMARY, SWEEP_CONFIG, TENSORBOARD, read_json
from runner.schema import GROUPS, option_modules, schema_of
from runner.schema.config import TARGET_NODE, Config
from runner.schema.logger import LoggerConfig, as_loggers
from runner.schema.logger.mlflow import MLflowConfig
from runner.schema.logger.tensorboard import TensorBoardConfig
from runner.schema.logger.wandb import WandbConfig

#: The longest folder name TensorBoard's run gets (file systems allow 255 bytes).
NAME_BYTES = 200
#: MLflow's tag of the run folder (absolute), by which a resumed run finds its MLflow run.
RUN_DIR_TAG = "mpitrain.run_dir"
#: The longest param value MLflow takes everywhere (newer servers take 6000 characters).
PARAM_CHARS = 500
#: The groups a run is compared by, as the option chosen (``rule=easgd``): hparams, params and MLflow tags.
NAMED = ("rule", "model", "data", "optim")
#: The keys every run records for comparison, varied or not, after the named groups and the rule's own keys
#: (``rule.alpha``); a group's keys (``simulate``) all of them.
COMPARED = ("optim.lr", "devices", "hardware.transport", "train.batch_size", "train.seed", "simulate")
#: What a compared key reads on a run it does not apply to: another rule's key (``rule.alpha`` of a BSP run).
NOT_APPLICABLE = "n/a"
#: The prefix of the outcome's TensorBoard tags: upper case sorts before every record's (``center/``,
#: ``epoch/``), so TensorBoard's HParams table, which lists metrics by tag and ticks the first five,
#: shows these.
OUTCOME = "Outcome/"
#: The summary's numbers that make the outcome, beside ``final_`` and ``best_`` of the monitored metric, as
#: the writing rank has them (the launcher adds ``wall_time_s``, start-up included, after the ranks end).
OUTCOME_KEYS = ("final_val_loss", "steps", "steps_to_target", "time_to_target_s", "worker_wall_time_s")
#: The MLflow store, in the sweep folder (a single run: its run folder), when no tracking URI is given.
STORE = "mlflow.db"
#: The MLflow artifacts' folder beside :data:`STORE`.
ARTIFACTS = "mlartifacts"


@dataclass
class RunInfo:
    """What every tracker knows of the run: its folder, name and swept values (``run.json``), its config
    (``config.yaml``, resolved), its sweep folder (None for a single run), and ``resume_step``: the
    checkpoint's step a resumed run continues after (None when it starts); ``continued``: earlier records
    of this run exist (a resume, or a survivor taking the records over); ``schemas``: the config's
    ``_schemas_`` (``group -> module.Class``), which name the options chosen."""

    dir: Path
    name: str
    swept: dict[str, Any]
    config: dict[str, Any]
    sweep: Path | None
    resume_step: int | None
    continued: bool
    schemas: dict[str, str] = field(default_factory=dict)
    started: float | None = None  # when the launcher wrote config.yaml: the job's start, start-up included

    @classmethod
    def read(cls, run_dir: Path, resume_step: int | None = None, continued: bool = False) -> RunInfo:
        """The run of ``run_dir``, from what the launcher wrote there (without it: the folder's name)."""
        from omegaconf import OmegaConf

        ident = read_json(run_dir / IDENTITY)
        config = {}
        if (run_dir / CONFIG).is_file():
            with open_in_folder(run_dir / CONFIG) as file:  # (never through a link)
                config = OmegaConf.to_container(OmegaConf.load(file))
        schemas = config.pop("_schemas_", None) or {}
        sweep = run_dir.parent if (run_dir.parent / SWEEP_CONFIG).is_file() else None
        name = str(ident.get("name") or run_dir.name)
        swept = dict(ident.get("swept") or {})
        continued = continued or resume_step is not None
        try:
            started = (run_dir / CONFIG).stat().st_mtime
        except OSError:
            started = None
        return cls(run_dir, name, swept, config, sweep, resume_step, continued, dict(schemas), started)

    @property
    def key(self) -> str:
        """The run folder's absolute path: what identifies the run to MLflow and W&B across jobs."""
        return str(self.dir.resolve())


def option(run: RunInfo, group: str) -> str:
    """The option ``group`` is set to, as users select it (``easgd``; a class of the user's: its
    ``_target_``); from the swept value, else ``_schemas_``; ``?`` when neither says."""
    path = run.schemas.get(group)
    if path == TARGET_NODE:
        return str((run.config.get(group) or {}).get("_target_", "?"))
    if group in run.swept:
        return str(run.swept[group])
    return path.rsplit(".", 2)[-2] if path and path.count(".") >= 2 else "?"


def leaves(node: Any, prefix: str) -> dict[str, Any]:
    """``dotted.key -> value`` of a config node's leaves (a value that is no mapping: ``{prefix: node}``)."""
    if not isinstance(node, dict) or not node:
        return {prefix: node}
    out = {}
    for key, value in node.items():
        out.update(leaves(value, f"{prefix}.{key}"))
    return out


def compared(run: RunInfo) -> dict[str, Any]:
    """The keys every run records for comparison, varied or not, in order: the named groups' options
    (:data:`NAMED`), the rule's keys, :data:`COMPARED`, every other swept key, then every other rule's keys
    as :data:`NOT_APPLICABLE` (so a table over runs of several rules has no blank). A key the config
    lacks is None."""
    out: dict[str, Any] = {group: option(run, group) for group in NAMED}
    rule = run.config.get("rule")
    if isinstance(rule, dict):
        out.update({k: v for k, v in leaves(rule, "rule").items() if k != "rule._target_"})
    for key in COMPARED:
        head, _, rest = key.partition(".")
        node = run.config.get(head)
        if rest:
            node = node.get(rest) if isinstance(node, dict) else None
        out.update(leaves(node, key))
    out.update({k: v for k, v in run.swept.items() if k not in out})
    out.update({k: NOT_APPLICABLE for k in hparam_kinds() if k.startswith("rule.") and k not in out})
    return out


def kind(hint: Any) -> str:
    """How a field of this type is recorded as an hparam: ``bool``, ``number`` (int or float), else ``text``
    (a string, a list, or a type that admits None: one run's None would make the column text anyway)."""
    return "bool" if hint is bool else "number" if hint in (int, float) else "text"


def schema_kinds(classes: list[type], prefix: str) -> dict[str, str]:
    """``prefix.key -> kind`` over the fields of the schema dataclasses ``classes`` (a group's options): a key
    that every one declares as a bool, or every one as a number, keeps that kind; any other is text (a
    key some option lacks reads :data:`NOT_APPLICABLE` there, which is text)."""
    seen: dict[str, list[str]] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            seen.setdefault(f"{prefix}.{f.name}", []).append(kind(hints[f.name]))
    whole = len(classes)
    return {k: v[0] if len(v) == whole and len(set(v)) == 1 else "text" for k, v in seen.items()}


@functools.cache
def option_schemas(group: str) -> tuple[type, ...]:
    """The schema dataclasses of a group's options (its package's modules that define one; one that cannot
    be imported here, for want of a package it needs, is left out rather than fail the run's records)."""
    found = []
    for name in option_modules(group):
        try:
            cls = schema_of(group, name)
        except (ValueError, ImportError):  # a helper module (rules/base.py), or an option not usable here
            continue
        if cls not in found:
            found.append(cls)
    return tuple(found)


@functools.cache
def hparam_kinds() -> dict[str, str]:
    """``compared key -> kind`` (:func:`kind`) of every compared key a schema declares: the named groups'
    options (text), every rule's keys, and :data:`COMPARED`. TensorBoard types an hparam from all the runs
    it finds and, over two types, makes it text while each run keeps its own: a filter of that column then
    drops the runs whose value is a number, and sorting by it fails. So each key is recorded with one type
    in every run, whichever rule, hardware or optimizer the run chose: ``rule.alpha`` (``float | None``,
    EASGD's alone) as text (``0.5``, ``n/a``), ``optim.lr`` as a number."""
    kinds = {group: "text" for group in NAMED}
    kinds.update(schema_kinds(list(option_schemas("rule")), "rule"))
    hints = typing.get_type_hints(Config)
    for key in COMPARED:
        head, _, rest = key.partition(".")
        if head in GROUPS:
            classes = list(option_schemas(head))
        elif dataclasses.is_dataclass(hints[head]):
            classes = [hints[head]]
        else:
            kinds[key] = kind(hints[head])
            continue
        found = schema_kinds(classes, head)
        kinds.update({k: v for k, v in found.items() if k == key or k.startswith(f"{key}.")})
    return kinds


def trial_name(run: RunInfo) -> str:
    """The run as TensorBoard's HParams table names its trial: what it is first (its name, after the
    rule when the sweep did not vary it: ``rule=easgd,rule.alpha=0.5``), then where it is (the sweep
    folder's date, time and point: ``2026-01-01/11-00-00/0``), so runs of two sweeps never merge."""
    label = [] if run.name == "defaults" else [run.name]
    if "rule" not in run.swept:
        label.insert(0, f"rule={option(run, 'rule')}")
    where = "/".join(run.dir.resolve().parts[-3 if run.sweep is not None else -2 :])
    return f"{','.join(label)} ({where})"


def folder_name(name: str) -> str:
    """``name`` as one folder name: no ``/``, at most :data:`NAME_BYTES` bytes (a longer one is cut and
    ends with a hash of the whole, so names stay distinct)."""
    safe = name.replace("/", "_").replace("\0", "_").lstrip(".") or "run"
    if len(safe.encode()) <= NAME_BYTES:
        return safe
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return safe.encode()[: NAME_BYTES - 12].decode(errors="ignore") + f"~{digest}"


def scalars(values: dict[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    """The finite numbers among ``values``; nested dicts (histograms) become ``key/subkey``."""
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append((f"{prefix}{key}", float(value)))
    return out


def summary_numbers(summary: dict[str, Any]) -> dict[str, float]:
    """The top-level finite numbers of ``summary.json`` (``final_val_acc``, ``steps``)."""
    return dict(scalars({k: v for k, v in summary.items() if not isinstance(v, dict)}))


def text(value: Any) -> str:
    """A value as a param's text: a string as it is, the rest as JSON (``null``, ``true``, ``[1, 8]``)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``dotted.key -> value as text`` of a nested config."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = text(value)
    return out


class Tracker:
    """One logger's records of the run, on the writing rank. ``optional``: a failure of this tracker is
    named and leaves it out, rather than ending the run (:class:`Trackers`)."""

    optional = True

    def write(self, kind: str, step: int, values: list[tuple[str, float]]) -> None:
        """A record's numbers (``values``: ``(key, value)``), at optimizer step ``step``."""

    def hparams(self, values: dict[str, Any], metrics: dict[str, float]) -> None:
        """The run's swept values and final metrics, when training is done."""

    def flush(self) -> None:
        """Everything written so far to its store."""

    def close(self) -> None:
        """No more records (the metrics file is closed); the run's end comes with :meth:`finish`."""

    def finish(self, summary: dict[str, Any], model: Path | None) -> None:
        """The run ended: its ``summary.json`` and its saved model (None: none was saved)."""

    def fail(self, cause: str) -> None:
        """The run failed with ``cause`` (one line)."""


class EventFile:
    """TensorBoard events, written synchronously through tensorboardX's event writer and flushed every
    ``flush_secs``. (tensorboardX's ``SummaryWriter`` writes from a thread which, when the disk is full,
    dies and leaves the training process blocked on its queue; here the error reaches the rank.)
    ``purge_step`` makes TensorBoard drop the earlier events of this folder from that step on (a resume).
    """

    def __init__(self, logdir: Path, purge_step: int | None = None, flush_secs: float = 10.0):
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        logdir.mkdir(parents=True, exist_ok=True)
        self.writer, self.event = EventsWriter(str(logdir / "events")), Event
        self.flush_secs, self.flushed = flush_secs, time.time()
        if purge_step is not None:
            self.writer.write_event(Event(step=purge_step, file_version="brain.Event:2"))
            self.writer.write_event(Event(step=purge_step, session_log=SessionLog(status=SessionLog.START)))

    def scalar(self, tag: str, value: float, step: int) -> None:
        from tensorboardX.summary import scalar

        self.writer.write_event(self.event(wall_time=time.time(), step=step, summary=scalar(tag, value)))
        if time.time() - self.flushed > self.flush_secs:
            self.flush()

    def session(self, **info: Any) -> None:
        """One of the HParams plugin's records (``HParamsPluginData``), given as its one field:
        ``session_start_info=`` or ``session_end_info=``."""
        from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData
        from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata

        (which,) = info
        data = HParamsPluginData(version=0, **info)
        plugin = SummaryMetadata.PluginData(plugin_name="hparams", content=data.SerializeToString())
        value = Summary.Value(tag=f"_hparams_/{which}", metadata=SummaryMetadata(plugin_data=plugin))
        self.writer.write_event(self.event(wall_time=time.time(), summary=Summary(value=[value])))
        self.flush()

    def flush(self) -> None:
        self.writer.flush()
        self.flushed = time.time()

    def close(self) -> None:
        self.writer.close()


def tensorboard_dir(run_dir: Path, name: str) -> Path:
    """Where the run's event files go: ``tb/<run name>/`` (TensorBoard shows the folder as the run's name),
    or ``tb/`` itself for a run folder whose events are there already (written before run names)."""
    tb = run_dir / TENSORBOARD
    if any(tb.glob("events.out.tfevents.*")):
        return tb
    return tb / folder_name(name)


def session_start(values: dict[str, Any], group: str) -> Any:
    """The HParams plugin's session start: ``values`` as its hparams, each of the kind its key is given in
    every run (:func:`hparam_kinds`; a text key's value as text: ``0.5``, ``n/a``, ``null``); a key no
    schema declares (a swept ``+model.width``) as its value is (a value neither bool, number nor string as
    JSON text: ``null``, ``[1]``); ``group`` as its trial's name."""
    from tensorboardX.proto.plugin_hparams_pb2 import SessionStartInfo

    info = SessionStartInfo(group_name=group, start_time_secs=time.time())
    kinds = hparam_kinds()
    for key, value in values.items():
        if kinds.get(key) == "text":
            info.hparams[key].string_value = text(value)
        elif isinstance(value, bool):
            info.hparams[key].bool_value = value
        elif isinstance(value, (int, float)) and math.isfinite(value):
            info.hparams[key].number_value = float(value)
        else:
            info.hparams[key].string_value = text(value)
    return info


def session_end(status: str) -> Any:
    """The HParams plugin's session end, for ``summary.json``'s status."""
    from tensorboardX.proto.api_pb2 import Status
    from tensorboardX.proto.plugin_hparams_pb2 import SessionEndInfo

    ended = {"ok": "STATUS_SUCCESS", "preempted": "STATUS_RUNNING", "interrupted": "STATUS_RUNNING"}
    return SessionEndInfo(status=Status.Value(ended.get(status, "STATUS_FAILURE")), end_time_secs=time.time())


def outcome(summary: dict[str, Any], monitor: str | None) -> dict[str, float]:
    """The run's outcome from ``summary.json`` as :data:`OUTCOME` tags: final and best of the monitored
    metric (``monitor``; None: the summary's, else val_acc when recorded, else val_loss), then
    :data:`OUTCOME_KEYS` recorded."""
    monitor = monitor or summary.get("monitor")
    if not monitor:
        monitor = "val_acc" if summary.get("final_val_acc") is not None else "val_loss"
    keys = (f"final_{monitor}", f"best_{monitor}", *OUTCOME_KEYS)
    numbers = summary_numbers(summary)
    return {f"{OUTCOME}{k}": numbers[k] for k in dict.fromkeys(keys) if k in numbers}


class TensorBoardTracker(Tracker):
    """Every record's numbers as scalars (tag ``<kind>/<key>``), the compared keys as the run's hparams,
    and the outcome (:func:`outcome`) with the session's end when the run ends."""

    optional = False

    def __init__(self, cfg: TensorBoardConfig, run: RunInfo):
        purge = None if run.resume_step is None else run.resume_step + 1
        self.events = EventFile(tensorboard_dir(run.dir, run.name), purge, cfg.flush_secs)
        self.monitor = (run.config.get("train") or {}).get("monitor")
        self.events.session(session_start_info=session_start(compared(run), trial_name(run)))

    def write(self, kind: str, step: int, values: list[tuple[str, float]]) -> None:
        for key, value in values:
            self.events.scalar(f"{kind}/{key}", value, step)

    def hparams(self, values: dict[str, Any], metrics: dict[str, float]) -> None:
        """Learn the monitored metric (``hparam/final_<monitor>``); the outcome comes with the summary."""
        for key in metrics:
            if key.startswith("hparam/final_"):
                self.monitor = key.removeprefix("hparam/final_")

    def flush(self) -> None:
        self.events.flush()

    def close(self) -> None:
        """Flushed: the outcome and the session's end follow with :meth:`finish` or :meth:`fail`."""
        self.events.flush()

    def finish(self, summary: dict[str, Any], model: Path | None) -> None:
        step = int(summary.get("steps") or 0)
        for tag, value in outcome(summary, self.monitor).items():
            self.events.scalar(tag, value, step)
        self.events.session(session_end_info=session_end(str(summary.get("status", "ok"))))
        self.events.close()

    def fail(self, cause: str) -> None:
        self.events.session(session_end_info=session_end("failed"))
        self.events.close()


def default_store(run: RunInfo) -> str:
    """MLflow's store when no tracking URI is given: :data:`STORE` in the sweep folder, so that one
    ``mlflow ui`` shows a sweep's runs together, or in a single run's folder; never the working folder
    (MLflow's own default), which a run does not own."""
    return f"sqlite:///{(run.sweep if run.sweep is not None else run.dir).resolve() / STORE}"


def sqlite_file(uri: str) -> Path | None:
    """The file of a local SQLite store's URI (``sqlite:///path``), else None. A new experiment there
    keeps its artifacts beside it (:data:`ARTIFACTS`), not in MLflow's default ``./mlruns``."""
    if not uri.startswith("sqlite:///") or uri.startswith("sqlite:///:memory:"):
        return None
    return Path(uri.removeprefix("sqlite:///").split("?", 1)[0]).resolve()


@contextmanager
def store_lock(store: Path | None) -> Iterator[None]:
    """Hold a lock beside the SQLite file ``store`` (None: no lock): sweep points starting at once would
    each make its tables, and all but one fail (``duplicate column name``)."""
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
        """The config flattened, the compared keys and the swept values (a group's option too:
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


#: Logger name (``conf/logger/<name>.yaml``) -> its tracker.
TRACKERS: dict[str, Callable[[Any, RunInfo], Tracker]] = {
    "tensorboard": TensorBoardTracker,
    "mlflow": MLflowTracker,
    "wandb": WandbTracker,
}


class Trackers:
    """The trackers of the loggers chosen, on the writing rank: each call goes to every tracker still
    recording. An optional tracker that fails (at its start too) is named in one line on this rank's
    output (its log, and the terminal for rank 0) with the cause, and records nothing more; training goes
    on. A failure of a tracker that is not optional (TensorBoard, in the run folder) is raised."""

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
