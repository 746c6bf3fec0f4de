"""The ``logger`` group (runner/schema/logger/, runner/rank/records/tracking/): every logger's records read
back through the tool that shows them. TensorBoard's HParams table as its own backend computes it, MLflow's
runs through ``MlflowClient``, an offline W&B run from its transaction log."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT, compose_config

SHORT = ["model=mlp", "train.epochs=1", "train.max_steps=4", "train.log_every=2"]


def needs(*packages: str) -> pytest.MarkDecorator:
    """Skip where a package of an extra of the same name is not installed (each is in ``.[test]``)."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    hint = f'{", ".join(missing)} not installed: pip install -e ".[{",".join(missing)}]"'
    return pytest.mark.skipif(bool(missing), reason=hint)


# -- reading the records back --------------------------------------------------------------------------------
def hparams_backend(logdir: Path):
    """TensorBoard's hparams backend over ``logdir``, as ``tensorboard --logdir LOGDIR`` serves it: its
    context and the request context to call its handlers with."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import backend_context

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(logdir))
    backend = backend_context.Context(base_plugin.TBContext(data_provider=provider, logdir=str(logdir)))
    return backend, context.RequestContext()


def hparams_table(logdir: Path) -> tuple[list[str], dict[str, dict]]:
    """What ``tensorboard --logdir LOGDIR`` shows in its HParams table: the columns (hparams) and each run's
    values, by run name, as TensorBoard's hparams backend computes them from the event files."""
    from tensorboard.plugins.hparams import api_pb2, get_experiment, metadata

    backend, ctx = hparams_backend(logdir)
    experiment = get_experiment.Handler(ctx, backend, "", api_pb2.GetExperimentRequest()).run()
    runs = {}
    for run, tags in backend.hparams_metadata(ctx, "").items():
        if metadata.SESSION_START_INFO_TAG in tags:
            info = metadata.parse_session_start_info_plugin_data(tags[metadata.SESSION_START_INFO_TAG])
            runs[run] = {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}
    return [h.name for h in experiment.hparam_infos], runs


def hparams_trials(logdir: Path) -> tuple[list[str], list[str], dict[str, dict]]:
    """The HParams table as TensorBoard's page first shows it: the metric columns ticked (the first five
    of the experiment's, as its query pane ticks them), every hparam column, and each trial's (session
    group's, by its name) hparams and metric values, from the plugin's own ``session_groups`` request."""
    from tensorboard.plugins.hparams import api_pb2, get_experiment, list_session_groups

    backend, ctx = hparams_backend(logdir)
    experiment = get_experiment.Handler(ctx, backend, "", api_pb2.GetExperimentRequest()).run()
    ticked = [m.name.tag for m in experiment.metric_infos][:5]
    request = api_pb2.ListSessionGroupsRequest(
        col_params=[api_pb2.ColParams(hparam=h.name) for h in experiment.hparam_infos]
        + [api_pb2.ColParams(metric=m.name) for m in experiment.metric_infos],
        start_index=0,
        slice_size=1000,
        allowed_statuses=[
            api_pb2.STATUS_UNKNOWN,
            api_pb2.STATUS_SUCCESS,
            api_pb2.STATUS_FAILURE,
            api_pb2.STATUS_RUNNING,
        ],
    )
    groups = list_session_groups.Handler(ctx, backend, "", request).run().session_groups
    trials = {}
    for group in groups:
        values = {k: getattr(v, v.WhichOneof("kind")) for k, v in group.hparams.items()}
        values.update({m.name.tag: m.value for m in group.metric_values})
        trials[group.name] = {**values, "status": api_pb2.Status.Name(group.sessions[0].status)}
    return ticked, [h.name for h in experiment.hparam_infos], trials


def mlflow_runs(uri: str, experiment: str = "mpitrain") -> dict[str, object]:
    """The MLflow runs of ``experiment`` at ``uri``, by run name."""
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    found = client.get_experiment_by_name(experiment)
    return {r.info.run_name: r for r in client.search_runs([found.experiment_id])} if found else {}


def wandb_records(run_dir: Path) -> dict[str, list]:
    """An offline W&B run's transaction log (``run-<id>.wandb``: W&B's LevelDB-style log of Record
    protobufs, in 32 KiB blocks of chunks), as ``record type -> its messages`` (``run``, ``history``...)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("run-*.wandb")
    data, pos, chunks, out = path.read_bytes(), 7, b"", {}
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a chunk header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunks, pos = chunks + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = pb.Record.FromString(chunks)
            kind = record.WhichOneof("record_type")
            out.setdefault(kind, []).append(getattr(record, kind))
            chunks = b""
    return out


def items(updates) -> dict[str, object]:
    """W&B's ``{key, value_json}`` items as a dict of values."""
    return {u.key or "/".join(u.nested_key): json.loads(u.value_json) for u in updates}


# -- a run's records as the worker writes them, in-process ---------------------------------------------------
def fake_run(run_dir: Path, swept: dict, overrides: list[str] | None = None, sweep: bool = True) -> Path:
    """A run folder as the launcher leaves it (config.yaml, run.json; multirun.yaml above for a sweep)."""
    from omegaconf import OmegaConf

    from runner.schema.config import schema_paths
    from runner.schema.identity import identity

    run_dir.mkdir(parents=True)
    texts = overrides or [f"{k}={v}" for k, v in swept.items()]
    ident = identity(texts, [f"{k}=1,2" for k in swept] if sweep else None)
    if sweep:
        (run_dir.parent / "multirun.yaml").write_text("hydra: {overrides: {task: []}}\n")
    (run_dir / "run.json").write_text(json.dumps(ident))
    composed = compose_config(texts)
    cfg = OmegaConf.to_container(composed, resolve=True)
    cfg["_schemas_"] = schema_paths(composed)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    return run_dir


def record_run(run_dir: Path, loggers: dict | None, acc: float = 0.5, **kwargs):
    """What rank 0 records of a short run: steps, a validation, the hparams, the summary and the model."""
    from runner.rank.records.metrics import MetricsLog
    from runner.run_folder import read_json

    log = MetricsLog(run_dir, enabled=True, loggers=loggers, **kwargs)
    for step in (2, 4):
        log.write("step", step, epoch=0, loss=1.0 / step, lr=0.1)
    log.write("val", 4, epoch=0, val_loss=0.7, val_acc=acc)
    log.write("epoch", 4, epoch=0, train_loss=0.6, epoch_time_s=1.0)
    log.write("final", 4, center_distance=0.1)  # sorts before the outcome but for its capital O
    log.hparams(read_json(run_dir / "run.json")["swept"], {"hparam/final_val_acc": acc})
    log.close()
    summary = {"status": "ok", "final_val_acc": acc, "best_val_acc": acc, "final_val_loss": 0.7, "steps": 4}
    (run_dir / "summary.json").write_text(json.dumps({**summary, "worker_wall_time_s": 1.5}))
    (run_dir / "model.pt").write_bytes(b"weights")
    log.finish()
    return log


def sweep(folder: Path, fixed: list[str], points: list[dict], loggers: dict | None = None) -> list[Path]:
    """A sweep's run folders as its points record them: ``fixed`` overrides and each point's values."""
    runs = []
    for n, swept in enumerate(points):
        texts = [*fixed, *[f"{k}={v}" for k, v in swept.items()]]
        runs.append(fake_run(folder / str(n), swept, texts))
        record_run(runs[-1], loggers, acc=0.5 + n / 10)
    return runs


#: The keys every run's hparams, params and config hold, varied or not (runner.rank.records.tracking).
EVERY_RUN = [
    *("rule", "model", "data", "optim", "optim.lr", "devices", "hardware.transport"),
    *("train.batch_size", "train.seed", "simulate.straggler_ms", "simulate.jitter_ms"),
]


@needs("tensorboard")
def test_tensorboard_hparams_show_every_swept_key_of_every_run_named_by_its_point(tmp_path):
    """``tensorboard --logdir outputs`` over an earlier single run (``train.epochs``) and a 2-point sweep of
    ``rule.alpha`` and ``optim.lr``: the HParams table has all three columns (TensorBoard took them from one
    arbitrary run's experiment summary when every run wrote one), each sweep run holds both swept values,
    and the runs are named by their points, not ``0/tb``."""
    outputs = tmp_path / "outputs"
    record_run(fake_run(outputs / "2026-01-01" / "10-00-00", {"train.epochs": 3}, sweep=False), None)
    folder = outputs / "multirun" / "2026-01-01" / "11-00-00"
    points = [{"rule.alpha": 0.1, "optim.lr": 0.05}, {"rule.alpha": 0.5, "optim.lr": 0.1}]
    sweep(folder, ["rule=easgd"], points)
    columns, runs = hparams_table(outputs)
    assert {"train.epochs", "rule.alpha", "optim.lr"} <= set(columns), columns
    for n, swept in enumerate(points):
        name = f"rule.alpha={swept['rule.alpha']},optim.lr={swept['optim.lr']}"
        run = runs[f"multirun/2026-01-01/11-00-00/{n}/tb/{name}"]
        assert run["rule.alpha"] == str(swept["rule.alpha"]), run  # EASGD's alone: text in every run
        assert run["optim.lr"] == pytest.approx(swept["optim.lr"]), run
    _, in_sweep = hparams_table(folder)
    assert sorted(in_sweep) == ["0/tb/rule.alpha=0.1,optim.lr=0.05", "1/tb/rule.alpha=0.5,optim.lr=0.1"]


@needs("tensorboard")
def test_the_hparams_table_ticks_the_outcome_and_names_each_trial_by_what_it_is(tmp_path):
    """A 4-point sweep of ``rule.alpha`` (``rule=easgd`` fixed): the five metric columns TensorBoard's
    HParams table ticks before any click are the outcome's, final accuracy among them, with each trial's
    value; trials are named by what they are (``rule=easgd,rule.alpha=0.1``), their place after; the
    sweep's runs ended SUCCESS."""
    folder = tmp_path / "multirun" / "2026-01-01" / "11-00-00"
    sweep(folder, ["rule=easgd"], [{"rule.alpha": a} for a in (0.1, 0.25, 0.5, 0.75)])
    ticked, columns, trials = hparams_trials(folder)
    assert ticked == [
        "Outcome/best_val_acc",
        "Outcome/final_val_acc",
        "Outcome/final_val_loss",
        "Outcome/steps",
        "Outcome/worker_wall_time_s",
    ], ticked
    assert set(EVERY_RUN) | {"rule.alpha", "rule.tau"} <= set(columns), columns
    names = sorted(trials)
    assert names == [
        f"rule=easgd,rule.alpha={a} (2026-01-01/11-00-00/{n})" for n, a in enumerate((0.1, 0.25, 0.5, 0.75))
    ]
    for n, name in enumerate(names):
        assert trials[name]["Outcome/final_val_acc"] == pytest.approx(0.5 + n / 10)
        assert trials[name]["rule"] == "easgd" and trials[name]["model"] == "cnn", trials[name]
        assert trials[name]["status"] == "STATUS_SUCCESS"


@needs("tensorboard")
def test_the_hparams_table_over_two_sweeps_has_no_blank_compared_key(tmp_path):
    """``--logdir outputs`` over a sweep of EASGD's alpha and a sweep of the learning rate of a DiLoCo MLP:
    every trial of both has every compared key (rule, model, data, optimizer, lr, devices, transport,
    simulate.*), though neither sweep varied the rule or the model."""
    outputs = tmp_path / "outputs" / "multirun" / "2026-01-01"
    sweep(outputs / "10-00-00", ["rule=easgd"], [{"rule.alpha": 0.1}, {"rule.alpha": 0.5}])
    sweep(outputs / "11-00-00", ["rule=diloco", "model=mlp"], [{"optim.lr": 0.05}, {"optim.lr": 0.1}])
    ticked, columns, trials = hparams_trials(tmp_path / "outputs")
    assert set(EVERY_RUN) <= set(columns) and "Outcome/final_val_acc" in ticked
    assert len(trials) == 4
    for name, values in trials.items():
        assert [k for k in EVERY_RUN if values.get(k) in (None, "")] == [], (name, values)
    rules = {name.split(",")[0]: values["model"] for name, values in trials.items()}
    assert rules == {"rule=easgd": "cnn", "rule=diloco": "mlp"}, rules


def hparam_types(logdir: Path) -> dict[str, set[str]]:
    """``hparam -> the kinds of value (number_value, string_value, bool_value) its runs recorded``."""
    from tensorboard.plugins.hparams import metadata

    backend, ctx = hparams_backend(logdir)
    kinds: dict[str, set[str]] = {}
    for tags in backend.hparams_metadata(ctx, "").values():
        if metadata.SESSION_START_INFO_TAG in tags:
            info = metadata.parse_session_start_info_plugin_data(tags[metadata.SESSION_START_INFO_TAG])
            for key, value in info.hparams.items():
                kinds.setdefault(key, set()).add(value.WhichOneof("kind"))
    return kinds


@needs("tensorboard")
def test_two_sweeps_of_different_rules_state_every_rule_key_with_one_type(tmp_path):
    """An EASGD sweep of alpha beside a BSP sweep: every trial has every compared key, every rule's keys
    included: ``rule.alpha`` reads ``n/a`` on BSP's rows and ``rule.mode`` on EASGD's (was blank), and each
    key has one type in every run (over two, TensorBoard makes the column text while runs keep numbers,
    and its filter of that column drops them)."""
    from tensorboard.plugins.hparams import api_pb2, get_experiment

    outputs = tmp_path / "outputs" / "multirun" / "2026-01-01"
    sweep(outputs / "10-00-00", ["rule=easgd"], [{"rule.alpha": a} for a in (0.1, 0.25, 0.5, 0.75)])
    sweep(outputs / "11-00-00", ["rule=bsp"], [{"optim.lr": 0.05}, {"optim.lr": 0.1}])
    _, columns, trials = hparams_trials(tmp_path / "outputs")
    assert len(trials) == 6
    assert {"rule.alpha", "rule.tau", "rule.mode", "rule.avg_freq", "rule.inner_steps"} <= set(columns)
    for name, values in trials.items():
        assert [k for k in columns if values.get(k) in (None, "")] == [], (name, values)
        easgd = name.startswith("rule=easgd")
        assert (values["rule.mode"] == "n/a") == easgd and (values["rule.alpha"] == "n/a") != easgd, values
        assert values["rule.inner_steps"] == "n/a", values
    alphas = sorted(v["rule.alpha"] for v in trials.values() if v["rule"] == "easgd")
    assert alphas == ["0.1", "0.25", "0.5", "0.75"]
    assert {k: v for k, v in hparam_types(tmp_path / "outputs").items() if len(v) > 1} == {}
    backend, ctx = hparams_backend(tmp_path / "outputs")
    infos = get_experiment.Handler(ctx, backend, "", api_pb2.GetExperimentRequest()).run().hparam_infos
    types = {h.name: api_pb2.DataType.Name(h.type) for h in infos}
    assert types["optim.lr"] == "DATA_TYPE_FLOAT64" and types["rule.alpha"] == "DATA_TYPE_STRING", types


def test_an_option_that_cannot_be_imported_is_left_out_of_the_compared_keys(monkeypatch):
    """Every rule's keys are found by importing every rule module; one that cannot be imported here (a
    package it needs is missing) is left out, not the cause of a run's failure (TensorBoard's tracker must
    start)."""
    from runner.rank.records.tracking import run_info as tracking

    real = tracking.schema_of

    def schema_of(group: str, name: str) -> type:
        if name == "gosgd":
            raise ModuleNotFoundError("No module named 'some_extra'")
        return real(group, name)

    monkeypatch.setattr(tracking, "schema_of", schema_of)
    for cached in (tracking.option_schemas, tracking.hparam_kinds):
        cached.cache_clear()
    try:
        kinds = tracking.hparam_kinds()
        assert "rule.alpha" in kinds and "rule.max_inflight" not in kinds, kinds  # gosgd's own key
    finally:
        for cached in (tracking.option_schemas, tracking.hparam_kinds):
            cached.cache_clear()


def test_a_run_name_becomes_one_folder_name():
    from runner.rank.records.tracking import NAME_BYTES, folder_name

    assert folder_name("rule.alpha=0.5,optim.lr=0.1") == "rule.alpha=0.5,optim.lr=0.1"
    assert folder_name("data.root=/data/set") == "data.root=_data_set"
    long_a, long_b = "x=" + "a" * 300, "x=" + "a" * 299 + "b"
    assert len(folder_name(long_a).encode()) <= NAME_BYTES and folder_name(long_a) != folder_name(long_b)


# -- the group: composing, checking, refusing ----------------------------------------------------------------
@needs("mlflow", "wandb")
def test_loggers_compose_one_or_several_with_their_typed_keys():
    from runner.schema.config import validate
    from runner.schema.logger.mlflow import MLflowConfig
    from runner.schema.logger.tensorboard import TensorBoardConfig
    from runner.schema.logger.wandb import WandbConfig

    assert list(validate(compose_config()).logger) == ["tensorboard"]
    both = validate(compose_config(["logger=[tensorboard,mlflow]", "logger.mlflow.experiment=mine"]))
    assert (
        isinstance(both.logger["tensorboard"], TensorBoardConfig)
        and both.logger["mlflow"].experiment == "mine"
    )
    assert isinstance(both.logger["mlflow"], MLflowConfig)
    alone = validate(compose_config(["logger=wandb", "logger.wandb.mode=offline"])).logger
    assert (
        list(alone) == ["wandb"]
        and isinstance(alone["wandb"], WandbConfig)
        and alone["wandb"].mode == "offline"
    )
    assert validate(compose_config(["logger=[]"])).logger == {}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["logger=[wandb]", "logger.wandb.mode=sometimes"], "logger.wandb.mode='sometimes' is invalid"),
        (["logger=[wandb]", "+logger.wandb.mdoe=offline"], "did you mean logger.wandb.mode?"),
        (["+logger.comet={}"], "logger.comet: no such logger; choose among mlflow, tensorboard, wandb"),
    ],
)
def test_a_bad_logger_setting_names_its_key(overrides, message):
    from runner.schema.config import validate

    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("?", r"\?")):
        validate(compose_config(overrides))


def test_a_missing_tracking_package_is_refused_before_any_process_starts(tmp_path, monkeypatch):
    """``logger=[tensorboard,mlflow]`` without mlflow installed: the launcher's check names the key and the
    install command, and writes nothing (no config.yaml, no mpirun command)."""
    import importlib.util

    from runner.launcher.launch import prepare

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a)
    )
    with pytest.raises(
        ValueError, match=r'logger=mlflow needs the mlflow package.*pip install "mpitrain\[mlflow\]"'
    ):
        prepare(compose_config(["logger=[tensorboard,mlflow]"]), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_a_run_folder_written_before_the_logger_group_keeps_tensorboard(tmp_path):
    from omegaconf import OmegaConf

    from runner.schema.config import load, schema_paths
    from runner.schema.logger.tensorboard import TensorBoardConfig

    cfg = compose_config()
    old = OmegaConf.to_container(cfg, resolve=True)
    old["_schemas_"] = schema_paths(cfg)
    del old["logger"]
    OmegaConf.save(old, tmp_path / "config.yaml")
    assert load(tmp_path / "config.yaml").logger == {"tensorboard": TensorBoardConfig()}


@needs("mlflow", "wandb")
def test_the_launcher_and_the_default_logger_import_no_mlflow_or_wandb(tmp_path):
    """Checking ``logger=[tensorboard,mlflow,wandb]`` only looks for the packages, and a run with the
    default logger (TensorBoard) records without them: both are slow to import."""
    code = (
        "import sys; from pathlib import Path; from tests.conftest import checked_config\n"
        "checked_config(['logger=[tensorboard,mlflow,wandb]'])\n"
        "from runner.rank.records.metrics import MetricsLog\n"
        "log = MetricsLog(Path(sys.argv[1]), enabled=True); log.write('step', 1, loss=0.5); log.close()\n"
        "print(sorted(m for m in ('mlflow', 'wandb') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]" and list((tmp_path / "tb").glob("*/events.out.tfevents.*"))


# -- MLflow, in-process --------------------------------------------------------------------------------------
@needs("mlflow")
def test_mlflow_records_params_metrics_summary_and_model_and_a_resume_continues_the_run(
    tmp_path, monkeypatch
):
    from runner.rank.records.metrics import MetricsLog
    from runner.schema.logger.mlflow import MLflowConfig

    uri = f"file:{tmp_path / 'mlruns'}"
    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY", raising=False)
    run_dir = fake_run(tmp_path / "sweep" / "0", {"optim.lr": 0.05}, ["rule=easgd", "optim.lr=0.05"])
    launched = time.time() - 30.0  # the launcher wrote config.yaml 30 s before rank 0 recorded (start-up)
    os.utime(run_dir / "config.yaml", (launched, launched))
    record_run(run_dir, {"mlflow": MLflowConfig(tracking_uri=uri)}, acc=0.75)
    (run,) = mlflow_runs(uri).values()
    assert run.info.run_name == "optim.lr=0.05" and run.info.status == "FINISHED"
    assert run.info.start_time == int(launched * 1000), "the run's duration is the job's, start-up included"
    assert run.data.params["optim.lr"] == "0.05" and run.data.params["rule.alpha"] == "null"
    assert run.data.metrics["val/val_acc"] == 0.75 and run.data.metrics["final_val_acc"] == 0.75
    assert run.data.metrics["step/loss"] == 0.25 and run.data.tags["mpitrain.sweep"] == str(run_dir.parent)
    from mlflow.tracking import MlflowClient

    artifacts = {a.path for a in MlflowClient(uri).list_artifacts(run.info.run_id)}
    assert artifacts == {"config.yaml", "summary.json", "model.pt"}
    assert not (run_dir / "tb").exists(), "logger=[mlflow] alone writes no TensorBoard events"
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true", "MLflow's telemetry only where the user asks"

    log = MetricsLog(
        run_dir, enabled=True, loggers={"mlflow": MLflowConfig(tracking_uri=uri)}, resume=(3, 4, 1.0)
    )
    log.write("val", 6, epoch=1, val_loss=0.5, val_acc=0.8)
    with pytest.raises(RuntimeError):
        try:
            raise RuntimeError("a rank was lost")
        finally:
            log.close()  # as the worker's fit does: the run ends failed, with the cause
    (again,) = mlflow_runs(uri).values()
    assert again.info.run_id == run.info.run_id and again.data.metrics["val/val_acc"] == 0.8
    assert (
        again.info.status == "FAILED"
        and "RuntimeError: a rank was lost" in again.data.tags["mpitrain.failure"]
    )


def test_mlflow_finds_every_run_of_a_sweep_by_rule_and_model_tags_varied_or_not(tmp_path, monkeypatch):
    """Two sweeps into one store (``MLFLOW_TRACKING_URI``): EASGD's alpha (rule and model not varied) and
    the rule itself. ``mlflow.search_runs`` by the ``rule`` tag finds each EASGD run of both, by ``model``
    every run; every run has every compared key as a param."""
    mlflow = pytest.importorskip("mlflow", reason="mlflow is not installed: pip install -e '.[mlflow]'")
    from runner.schema.logger.mlflow import MLflowConfig

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"file:{tmp_path / 'mlruns'}")  # faster to make than SQLite's
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    loggers = {"mlflow": MLflowConfig()}
    fixed = sweep(tmp_path / "a", ["rule=easgd"], [{"rule.alpha": 0.1}, {"rule.alpha": 0.5}], loggers)
    varied = sweep(tmp_path / "b", ["model=mlp"], [{"rule": "easgd"}, {"rule": "bsp"}], loggers)
    found = mlflow.search_runs(experiment_names=["mpitrain"], filter_string="tags.rule = 'easgd'")
    dirs = sorted(found["tags.mpitrain.run_dir"])
    assert dirs == sorted(str(d.resolve()) for d in (*fixed, varied[0])), dirs
    mlp = mlflow.search_runs(experiment_names=["mpitrain"], filter_string="tags.model = 'mlp'")
    assert sorted(mlp["tags.rule"]) == ["bsp", "easgd"]
    every = mlflow.search_runs(experiment_names=["mpitrain"])
    assert len(every) == 4
    for key in EVERY_RUN:
        assert every[f"params.{key}"].notna().all(), key
    assert sorted(every["params.rule"]) == ["bsp", "easgd", "easgd", "easgd"]
    alpha = every.groupby("params.rule")["params.rule.alpha"]
    by_rule = {rule: sorted(set(values)) for rule, values in alpha}
    assert by_rule == {"bsp": ["n/a"], "easgd": ["0.1", "0.5", "null"]}, by_rule  # every rule's keys, stated
    assert every["params.rule.mode"].notna().all() and every["params.rule.tau"].notna().all()
    assert not (tmp_path / "a" / "mlflow.db").exists(), "a tracking URI given: no store of its own"


@pytest.mark.slow  # two SQLite stores: seconds each to make
def test_mlflow_without_a_tracking_uri_keeps_its_store_in_the_sweep_folder_not_the_working_folder(
    tmp_path, monkeypatch
):
    """No ``tracking_uri`` and no ``MLFLOW_TRACKING_URI``: a sweep's runs go to one store in the sweep
    folder (``mlflow.db``, artifacts in ``mlartifacts/``), a single run's to its run folder, and the
    working folder stays empty (MLflow's own default is ``./mlflow.db`` and ``./mlruns``)."""
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install -e '.[mlflow]'")
    from runner.schema.logger.mlflow import MLflowConfig

    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    folder = tmp_path / "multirun" / "11-00-00"
    runs = sweep(
        folder, ["rule=easgd"], [{"rule.alpha": 0.1}, {"rule.alpha": 0.5}], {"mlflow": MLflowConfig()}
    )
    single = fake_run(tmp_path / "single", {"optim.lr": 0.1}, sweep=False)
    record_run(single, {"mlflow": MLflowConfig()})
    assert sorted(p.name for p in cwd.iterdir()) == []
    found = mlflow_runs(f"sqlite:///{folder / 'mlflow.db'}")
    assert sorted(found) == ["rule.alpha=0.1", "rule.alpha=0.5"]
    assert all(r.info.artifact_uri.startswith((folder / "mlartifacts").as_uri()) for r in found.values())
    assert sorted(p.name for p in (folder / "mlartifacts").rglob("*") if p.is_file())[:1] == ["config.yaml"]
    assert not any((run / "mlflow.db").exists() for run in runs)
    assert list(mlflow_runs(f"sqlite:///{single / 'mlflow.db'}")) == ["optim.lr=0.1"]


@pytest.mark.slow  # three processes, each importing mlflow
def test_sweep_points_starting_at_once_share_one_new_mlflow_store(tmp_path):
    """Three points of one sweep start at once (joblib's launcher) with no tracking URI: each makes or
    finds the sweep folder's store and records its run (unlocked, all but one failed making the tables:
    ``duplicate column name``), and a store the user names keeps its artifacts beside it, not in the
    working folder."""
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install -e '.[mlflow]'")
    folder = tmp_path / "sweep"
    runs = [
        fake_run(folder / str(n), {"rule.alpha": a}, ["rule=easgd", f"rule.alpha={a}"])
        for n, a in enumerate((0.1, 0.5, 0.9))
    ]
    given = f"sqlite:///{tmp_path / 'given' / 'store.db'}"
    (tmp_path / "given").mkdir()
    code = (
        "import sys; from pathlib import Path; from tests.report.test_tracking import record_run\n"
        "from runner.schema.logger.mlflow import MLflowConfig\n"
        "record_run(Path(sys.argv[1]), {'mlflow': MLflowConfig(tracking_uri=sys.argv[2] or None)})\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    env["PYTHONPATH"] = str(ROOT)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    single = fake_run(tmp_path / "single", {"optim.lr": 0.1}, sweep=False)
    argvs = [[str(run), ""] for run in runs] + [[str(single), given]]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, *argv], cwd=cwd, env=env, stderr=subprocess.PIPE, text=True
        )
        for argv in argvs
    ]
    errors = [p.communicate(timeout=240)[1] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0], errors
    assert not [e for e in errors if "logger=mlflow" in e], errors
    assert sorted(mlflow_runs(f"sqlite:///{folder / 'mlflow.db'}")) == [
        "rule.alpha=0.1",
        "rule.alpha=0.5",
        "rule.alpha=0.9",
    ]
    (run,) = mlflow_runs(given).values()
    assert run.info.artifact_uri.startswith((tmp_path / "given" / "mlartifacts").as_uri())
    assert list(cwd.iterdir()) == []


@needs("mlflow")
def test_a_failing_optional_logger_is_named_in_one_line_and_training_goes_on(tmp_path, capsys, monkeypatch):
    """MLflow's store cannot be written (its folder is a file): the start fails, one line names the logger
    and the cause, and the other records are all written; a failure later on does the same."""
    from runner.rank.records.metrics import MetricsLog
    from runner.rank.records.tracking import MLflowTracker
    from runner.schema.logger.mlflow import MLflowConfig
    from runner.schema.logger.tensorboard import TensorBoardConfig

    (tmp_path / "blocked").write_text("not a folder")
    run_dir = fake_run(tmp_path / "run", {"optim.lr": 0.05}, sweep=False)
    bad = {
        "tensorboard": TensorBoardConfig(),
        "mlflow": MLflowConfig(tracking_uri=f"file:{tmp_path}/blocked/m"),
    }
    record_run(run_dir, bad)
    lines = [line for line in capsys.readouterr().err.splitlines() if "logger=mlflow" in line]
    assert len(lines) == 1 and "logger=mlflow: start failed" in lines[0] and "training goes on" in lines[0], (
        lines
    )
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 5

    def broken(self, *args):
        raise ConnectionError("tracking server unreachable")

    good = {"mlflow": MLflowConfig(tracking_uri=f"file:{tmp_path}/mlruns")}
    log = MetricsLog(fake_run(tmp_path / "later", {"optim.lr": 0.1}, sweep=False), enabled=True, loggers=good)
    monkeypatch.setattr(MLflowTracker, "write", broken)
    log.write("step", 1, loss=1.0)
    log.write("step", 2, loss=0.5)
    err = capsys.readouterr().err
    assert err.count("logger=mlflow") == 1 and "write failed" in err and "ConnectionError" in err, err
    assert log.trackers.live == {}


# -- real jobs -----------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.mpi
@needs("tensorboard", "mlflow")
def test_a_sweep_to_tensorboard_and_mlflow_reads_back_in_both(cli):
    """A real 2-point sweep, MLflow without a tracking URI: TensorBoard's table and MLflow's store (in the
    sweep folder, none in the working folder) hold both runs with every compared key and the outcome."""
    before = {p for p in ("mlflow.db", "mlruns", "mlartifacts") if (ROOT / p).exists()}
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
    run = cli(*SHORT, "optim.lr=0.05,0.1", "logger=[tensorboard,mlflow]", multirun=True, timeout=300, env=env)
    assert run.returncode == 0, run.output
    assert {p for p in ("mlflow.db", "mlruns", "mlartifacts") if (ROOT / p).exists()} == before
    ticked, columns, trials = hparams_trials(run.dir)
    assert set(EVERY_RUN) <= set(columns) and "Outcome/final_val_acc" in ticked, (ticked, columns)
    names = {f"rule=bsp,optim.lr={lr}": f"/{run.dir.name}/{n})" for n, lr in enumerate((0.05, 0.1))}
    trial = {
        name: t
        for t in trials
        for name, end in names.items()
        if t.startswith(f"{name} (") and t.endswith(end)
    }
    assert sorted(trial) == sorted(names), sorted(trials)
    found = mlflow_runs(f"sqlite:///{run.dir / 'mlflow.db'}")
    assert sorted(found) == ["optim.lr=0.05", "optim.lr=0.1"]
    for name, lr in (("optim.lr=0.05", 0.05), ("optim.lr=0.1", 0.1)):
        data, summary = (
            found[name].data,
            json.loads((run.dir / str(int(lr == 0.1)) / "summary.json").read_text()),
        )
        assert found[name].info.status == "FINISHED" and data.params["optim.lr"] == str(lr)
        assert data.params["train.max_steps"] == "4" and data.params["devices"] == "2"
        assert data.tags["rule"] == "bsp" and data.tags["model"] == "mlp" and data.tags["data"] == "digits"
        assert data.metrics["final_val_acc"] == pytest.approx(summary["final_val_acc"])
        assert {"step/loss", "val/val_acc", "epoch/train_loss"} <= data.metrics.keys(), sorted(data.metrics)
        outcome = trials[trial[f"rule=bsp,{name}"]]["Outcome/final_val_acc"]
        assert outcome == pytest.approx(summary["final_val_acc"])


@pytest.mark.slow
@pytest.mark.mpi
@needs("wandb")
def test_wandb_offline_records_config_metrics_summary_and_model(cli, tmp_path):
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "WANDB_DIR": str(tmp_path / "wandb"),
        "WANDB_SILENT": "true",
    }
    (tmp_path / "wandb").mkdir()
    run = cli(*SHORT, "optim.lr=0.07", "logger=wandb", "logger.wandb.project=tests", env=env, timeout=240)
    assert run.returncode == 0, run.output
    assert not (run.dir / "tb").exists(), "logger=wandb alone writes no TensorBoard events"
    (offline,) = (tmp_path / "wandb" / "wandb").glob("offline-run-*")
    records = wandb_records(offline)
    (start,) = records["run"]
    config = items(start.config.update)
    assert start.display_name == run.summary["name"] and "optim.lr=0.07" in start.display_name
    assert start.project == "tests"
    assert config["optim"]["lr"] == 0.07 and config["swept"] == run.summary["swept"]
    assert config["compared"]["rule"] == "bsp" and config["compared"]["model"] == "mlp"
    assert set(EVERY_RUN) <= set(config["compared"]), config["compared"]
    history = [items(r.item) for r in records["history"]]
    assert any("step/loss" in h for h in history) and any("val/val_acc" in h for h in history)
    summary = {}
    for r in records["summary"]:
        summary.update(items(r.update))
    assert summary["status"] == "ok" and summary["final_val_acc"] == pytest.approx(
        run.summary["final_val_acc"]
    )
    (artifact,) = records["artifact"]
    assert artifact.type == "model" and [m.path for m in artifact.manifest.contents] == ["model.pt"]
    assert [e.exit_code for e in records["exit"]] == [0]
