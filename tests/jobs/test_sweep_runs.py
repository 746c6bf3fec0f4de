"""What a run records of itself (overrides, swept values, a name, TensorBoard hparams), and how the points
of a sweep that run at once share the machine."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from runner.schema.identity import identity


def test_a_sweep_point_names_only_what_the_sweep_varies():
    ident = identity(
        ["rule=easgd", "rule.alpha=0.5", "optim.lr=0.05", "train.progress=false", "hydra.sweep.dir=/x"],
        ["rule=easgd", "rule.alpha=0.1,0.5", "optim.lr=0.01,0.05"],
    )
    assert ident == {
        "overrides": ["rule=easgd", "rule.alpha=0.5", "optim.lr=0.05"],
        "swept": {"rule.alpha": 0.5, "optim.lr": 0.05},
        "name": "rule.alpha=0.5,optim.lr=0.05",
    }


def test_a_single_run_is_named_by_its_overrides_and_optuna_ranges_count_as_swept():
    assert identity(["model=mlp", "+train.seed=3"])["name"] == "model=mlp,train.seed=3"
    assert identity([])["name"] == "defaults"
    ident = identity(["optim.lr=0.0314", "model=mlp"], ["optim.lr=interval(0.01,0.1)", "model=mlp"])
    assert ident["swept"] == {"optim.lr": 0.0314}
    drawn = identity(["optim.lr=0.012345678901234567"], ["optim.lr=interval(0.001,0.1)"])
    assert drawn["name"] == "optim.lr=0.01235" and drawn["swept"] == {"optim.lr": 0.012345678901234567}


def hparams_in(event_dir: Path) -> list[str]:
    """The plugin names of the summaries in a TensorBoard event folder (TFRecord framing read by hand)."""
    from tensorboardX.proto.event_pb2 import Event

    names = []
    for path in event_dir.rglob("events.out.tfevents.*"):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i : i + 8])
            event = Event()
            event.ParseFromString(data[i + 12 : i + 12 + length])
            i += 12 + length + 4
            names += [v.metadata.plugin_data.plugin_name for v in event.summary.value]
    return names


@pytest.mark.slow
@pytest.mark.mpi
def test_sweep_points_record_their_values_label_their_lines_and_write_hparams(cli):
    import json

    run = cli("optim.lr=0.01,0.05", "train.epochs=1", "model=mlp", multirun=True, timeout=240)
    assert run.returncode == 0, run.output
    for point, lr in (("0", 0.01), ("1", 0.05)):
        summary = json.loads((run.dir / point / "summary.json").read_text())
        assert summary["swept"] == {"optim.lr": lr} and summary["name"] == f"optim.lr={lr}"
        assert "model=mlp" in summary["overrides"]
        assert hparams_in(run.dir / point / "tb").count("hparams") == 2
        assert f"[optim.lr={lr}] epoch 0: val_loss" in run.output
        assert f"[optim.lr={lr}] run folder: " in run.output and f"[optim.lr={lr}] done in " in run.output


def test_concurrent_points_follow_the_launcher_and_the_sweep_size():
    from omegaconf import OmegaConf

    from runner.schema.identity import concurrent_points

    joblib = OmegaConf.create(
        {"_target_": "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher"}
    )
    local = OmegaConf.create(
        {"_target_": "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher"}
    )
    basic = OmegaConf.create({"_target_": "hydra._internal.core_plugins.basic_launcher.BasicLauncher"})
    grid = ["rule.alpha=0.1,0.5", "optim.lr=0.01,0.05,0.1", "model=mlp"]
    assert concurrent_points(basic, grid) == 1
    assert concurrent_points(local, grid) == 6
    assert concurrent_points(OmegaConf.merge(joblib, {"n_jobs": 4}), grid) == 4
    assert concurrent_points(OmegaConf.merge(joblib, {"n_jobs": 8}), ["optim.lr=0.01,0.05"]) == 2


def test_jobs_on_one_machine_hold_disjoint_cores(tmp_path, monkeypatch):
    from pathlib import Path

    from runner.hardware import cores
    from runner.hardware.cpu import CPUConfig

    monkeypatch.setattr(cores, "LOCK_DIR", tmp_path / "locks")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})  # a 2-core machine, whatever this is
    first = cores.reserve(1, [0, 1])
    assert first.cores == [0]
    launch = CPUConfig(flavor="openmpi").plan_launch(1, Path("/run"), reserve=True, share=2)
    assert launch.lease.cores == [1] and "pe-list=1:ordered" in launch.argv and launch.threads == 1
    crowded = CPUConfig(flavor="openmpi").plan_launch(1, Path("/run"), reserve=True, share=2)
    assert crowded.lease is None and "--bind-to" in crowded.argv and "none" in crowded.argv
    assert "held by other mpitrain jobs" in crowded.warning
    first.release()
    launch.lease.release()
    again = CPUConfig(flavor="openmpi").plan_launch(1, Path("/run"), reserve=True, share=2)
    assert again.lease.cores == [0] and not any("pe-list" in a for a in again.argv)
    again.lease.release()


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("launcher", ["hydra/launcher=submitit_local", "hydra/launcher=joblib"])
def test_points_run_at_once_bind_to_different_cores(cli, launcher):
    """submitit's local launcher and joblib's (n_jobs=2) run both points at once: each gets its own core
    (the machine has 2)."""
    import json

    plugin, needs = ("joblib", "joblib") if "joblib" in launcher else ("submitit", "slurm")
    hint = f'hydra-{plugin}-launcher is not installed: pip install -e ".[{needs}]"'
    pytest.importorskip(f"hydra_plugins.hydra_{plugin}_launcher", reason=hint)

    extra = ["hydra.launcher.n_jobs=2"] if "joblib" in launcher else []
    run = cli(
        launcher,
        *extra,
        "optim.lr=0.01,0.05",
        "devices=1",
        "model=mlp",
        "train.epochs=3",
        multirun=True,
        timeout=240,
    )
    assert run.returncode == 0, run.output
    cores = [json.loads((run.dir / p / "bindings.json").read_text())["ranks"][0]["cores"] for p in "01"]
    assert all(len(c) == 1 for c in cores) and cores[0] != cores[1], cores
