"""What a run records of itself: its overrides, the swept keys and values, a name; TensorBoard hparams."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from runner.identity import identity


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


def hparams_in(event_dir: Path) -> list[str]:
    """The plugin names of the summaries in a TensorBoard event folder (TFRecord framing read by hand)."""
    from tensorboardX.proto.event_pb2 import Event

    names = []
    for path in event_dir.glob("events.out.tfevents.*"):
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
        assert hparams_in(run.dir / point / "tb").count("hparams") == 3
        assert f"[optim.lr={lr}] epoch 0: val_loss" in run.output
