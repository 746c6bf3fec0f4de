"""The ``logger`` group (runner/schema/logger/, runner/rank/records/tracking.py): every logger's records read
back through the tool that shows them. TensorBoard's HParams table as its own backend computes it, MLflow's
runs through ``MlflowClient``, an offline W&B run from its transaction log."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, compose_config

SHORT = ["model=mlp", "train.epochs=1", "train.max_steps=4", "train.log_every=2"]


# -- reading the records back --------------------------------------------------------------------------------
def hparams_table(logdir: Path) -> tuple[list[str], dict[str, dict]]:
    """What ``tensorboard --logdir LOGDIR`` shows in its HParams table: the columns (hparams) and each run's
    values, by run name, as TensorBoard's hparams backend computes them from the event files."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.hparams import api_pb2, backend_context, get_experiment, metadata

    mux = plugin_event_multiplexer.EventMultiplexer()
    mux.AddRunsFromDirectory(str(logdir))
    mux.Reload()
    provider = data_provider.MultiplexerDataProvider(mux, str(logdir))
    backend = backend_context.Context(base_plugin.TBContext(data_provider=provider, logdir=str(logdir)))
    ctx = context.RequestContext()
    experiment = get_experiment.Handler(ctx, backend, "", api_pb2.GetExperimentRequest()).run()
    runs = {}
    for run, tags in backend.hparams_metadata(ctx, "").items():
        if metadata.SESSION_START_INFO_TAG in tags:
            info = metadata.parse_session_start_info_plugin_data(tags[metadata.SESSION_START_INFO_TAG])
            runs[run] = {k: getattr(v, v.WhichOneof("kind")) for k, v in info.hparams.items()}
    return [h.name for h in experiment.hparam_infos], runs


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

    from runner.schema.identity import identity

    run_dir.mkdir(parents=True)
    texts = overrides or [f"{k}={v}" for k, v in swept.items()]
    ident = identity(texts, [f"{k}=1,2" for k in swept] if sweep else None)
    if sweep:
        (run_dir.parent / "multirun.yaml").write_text("hydra: {overrides: {task: []}}\n")
    (run_dir / "run.json").write_text(json.dumps(ident))
    cfg = OmegaConf.to_container(compose_config(texts), resolve=False)
    OmegaConf.save({k: cfg[k] for k in ("devices", "train", "optim", "rule")}, run_dir / "config.yaml")
    return run_dir


def record_run(run_dir: Path, loggers: dict | None, acc: float = 0.5, **kwargs):
    """What rank 0 records of a short run: steps, a validation, the hparams, the summary and the model."""
    from runner.rank.records.metrics import MetricsLog
    from runner.run_folder import read_json

    log = MetricsLog(run_dir, enabled=True, loggers=loggers, **kwargs)
    for step in (2, 4):
        log.write("step", step, epoch=0, loss=1.0 / step, lr=0.1)
    log.write("val", 4, epoch=0, val_loss=0.7, val_acc=acc)
    log.hparams(read_json(run_dir / "run.json")["swept"], {"hparam/final_val_acc": acc})
    log.close()
    (run_dir / "summary.json").write_text(json.dumps({"status": "ok", "final_val_acc": acc, "steps": 4}))
    (run_dir / "model.pt").write_bytes(b"weights")
    log.finish()
    return log


def test_tensorboard_hparams_show_every_swept_key_of_every_run_named_by_its_point(tmp_path):
    """``tensorboard --logdir outputs`` over an earlier single run (``train.epochs``) and a 2-point sweep of
    ``rule.alpha`` and ``optim.lr``: the HParams table has all three columns (TensorBoard took them from one
    arbitrary run's experiment summary when every run wrote one), each sweep run holds both swept values,
    and the runs are named by their points, not ``0/tb``."""
    outputs = tmp_path / "outputs"
    record_run(fake_run(outputs / "2026-01-01" / "10-00-00", {"train.epochs": 3}, sweep=False), None)
    sweep = outputs / "multirun" / "2026-01-01" / "11-00-00"
    points = [{"rule.alpha": 0.1, "optim.lr": 0.05}, {"rule.alpha": 0.5, "optim.lr": 0.1}]
    for n, swept in enumerate(points):
        record_run(
            fake_run(sweep / str(n), swept, ["rule=easgd", *[f"{k}={v}" for k, v in swept.items()]]), None
        )
    columns, runs = hparams_table(outputs)
    assert {"train.epochs", "rule.alpha", "optim.lr"} <= set(columns), columns
    for n, swept in enumerate(points):
        name = f"rule.alpha={swept['rule.alpha']},optim.lr={swept['optim.lr']}"
        run = f"multirun/2026-01-01/11-00-00/{n}/tb/{name}"
        assert runs[run] == pytest.approx(swept), runs
    _, in_sweep = hparams_table(sweep)
    assert sorted(in_sweep) == ["0/tb/rule.alpha=0.1,optim.lr=0.05", "1/tb/rule.alpha=0.5,optim.lr=0.1"]


def test_a_run_name_becomes_one_folder_name():
    from runner.rank.records.tracking import NAME_BYTES, folder_name

    assert folder_name("rule.alpha=0.5,optim.lr=0.1") == "rule.alpha=0.5,optim.lr=0.1"
    assert folder_name("data.root=/data/set") == "data.root=_data_set"
    long_a, long_b = "x=" + "a" * 300, "x=" + "a" * 299 + "b"
    assert len(folder_name(long_a).encode()) <= NAME_BYTES and folder_name(long_a) != folder_name(long_b)


# -- the group: composing, checking, refusing ----------------------------------------------------------------
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
def test_mlflow_records_params_metrics_summary_and_model_and_a_resume_continues_the_run(tmp_path):
    from runner.rank.records.metrics import MetricsLog
    from runner.schema.logger.mlflow import MLflowConfig

    uri = f"file:{tmp_path / 'mlruns'}"
    run_dir = fake_run(tmp_path / "sweep" / "0", {"optim.lr": 0.05}, ["rule=easgd", "optim.lr=0.05"])
    record_run(run_dir, {"mlflow": MLflowConfig(tracking_uri=uri)}, acc=0.75)
    (run,) = mlflow_runs(uri).values()
    assert run.info.run_name == "optim.lr=0.05" and run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.05" and run.data.params["rule.alpha"] == "null"
    assert run.data.metrics["val/val_acc"] == 0.75 and run.data.metrics["final_val_acc"] == 0.75
    assert run.data.metrics["step/loss"] == 0.25 and run.data.tags["mpitrain.sweep"] == str(run_dir.parent)
    from mlflow.tracking import MlflowClient

    artifacts = {a.path for a in MlflowClient(uri).list_artifacts(run.info.run_id)}
    assert artifacts == {"config.yaml", "summary.json", "model.pt"}
    assert not (run_dir / "tb").exists(), "logger=[mlflow] alone writes no TensorBoard events"

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
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3

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
def test_a_sweep_to_tensorboard_and_mlflow_reads_back_in_both(cli, tmp_path):
    uri = f"file:{tmp_path / 'mlruns'}"
    run = cli(
        *SHORT,
        "optim.lr=0.05,0.1",
        "logger=[tensorboard,mlflow]",
        f"logger.mlflow.tracking_uri={uri}",
        multirun=True,
        timeout=300,
    )
    assert run.returncode == 0, run.output
    columns, runs = hparams_table(run.dir)
    assert "optim.lr" in columns
    assert runs == {"0/tb/optim.lr=0.05": {"optim.lr": 0.05}, "1/tb/optim.lr=0.1": {"optim.lr": 0.1}}
    found = mlflow_runs(uri)
    assert sorted(found) == ["optim.lr=0.05", "optim.lr=0.1"]
    for name, lr in (("optim.lr=0.05", 0.05), ("optim.lr=0.1", 0.1)):
        data, summary = (
            found[name].data,
            json.loads((run.dir / str(int(lr == 0.1)) / "summary.json").read_text()),
        )
        assert found[name].info.status == "FINISHED" and data.params["optim.lr"] == str(lr)
        assert data.params["train.max_steps"] == "4" and data.params["devices"] == "2"
        assert data.metrics["final_val_acc"] == pytest.approx(summary["final_val_acc"])
        assert {"step/loss", "val/val_acc", "epoch/train_loss"} <= data.metrics.keys(), sorted(data.metrics)


@pytest.mark.slow
@pytest.mark.mpi
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
