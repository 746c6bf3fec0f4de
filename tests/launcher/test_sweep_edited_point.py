"""``resume=SWEEP_DIR`` refuses a sweep whose point no longer holds, in its ``config.yaml``, the config its
overrides compose to (edited since it ran, or another sweep's run), naming the point's folder and the keys:
the comparison in-process over config.yaml files the launcher writes, and a real sweep edited, then
resumed."""

from __future__ import annotations

import copy
import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import DictConfig

from runner.launcher import outcomes
from runner.launcher.launch import prepare
from runner.launcher.sweep_resume import ATTEMPTS, MANIFEST, edited_keys, plan
from runner.launcher.sweeper import SWEEP_LOCK
from runner.run_folder import CHECKPOINT_INDEX, CHECKPOINTS, CONFIG, SUMMARY
from tests.conftest import ROOT, compose_config

POINTS = [
    ["optim.lr=0.1", "model=mlp", "devices=1"],
    ["rule=easgd", "schedule=cosine", "optim.lr=0.05", "train.seed=3"],
    ["rule=gosgd", "logger=[tensorboard,mlflow]", "simulate.jitter_ms=2"],
]


@functools.cache
def _composed(overrides: tuple[str, ...]) -> DictConfig:
    return compose_config(list(overrides))


def composed(overrides: list[str]) -> DictConfig:
    """The config ``overrides`` compose to (each composed once: the tests only read it)."""
    return _composed(tuple(overrides))


def written_point(folder: Path, overrides: list[str], status: str | None = "ok") -> Path:
    """A sweep point's folder as its launcher writes it (config.yaml and the rest), with a summary."""
    prepare(copy.deepcopy(composed(overrides)), folder)  # (the copy compared stays as composed)
    if status is not None:
        (folder / SUMMARY).write_text(json.dumps({"status": status}))
    return folder


def edit(folder: Path, old: str, new: str, keep_time: bool = False) -> None:
    """Replace ``old`` in the point's config.yaml (``keep_time``: and give it back its modification time,
    so that its summary stays the latest job's)."""
    config = folder / CONFIG
    text, times = config.read_text(), config.stat()
    assert old in text
    config.write_text(text.replace(old, new, 1))
    if keep_time:
        os.utime(config, ns=(times.st_atime_ns, times.st_mtime_ns))


def checkpointed(folder: Path) -> None:
    """Give the point an indexed checkpoint (of step 5)."""
    (folder / CHECKPOINTS).mkdir()
    entry = {"step": 5, "seq": 1, "dir": "00001-step5", "world_size": 1, "parts": [{"bytes": 1, "crc32": 0}]}
    (folder / CHECKPOINTS / CHECKPOINT_INDEX).write_text(json.dumps({"checkpoints": [entry]}))


@pytest.mark.parametrize("overrides", POINTS, ids=lambda o: o[0])
def test_a_point_as_its_launcher_wrote_it_holds_its_config(tmp_path, overrides):
    point = written_point(tmp_path / "0", overrides)
    assert edited_keys(point, composed(overrides)) == []


def test_each_edited_key_is_named_with_both_values(tmp_path):
    overrides = POINTS[0]
    point = written_point(tmp_path / "0", overrides)
    edit(point, "  lr: 0.1\n", "  lr: 0.01\n")
    edit(point, "  momentum: 0.9\n", "  momentum: 0.5\n")
    edit(point, "  max_steps: null\n", "  max_steps: 50\n")  # a key a resumed run may change: not named
    assert edited_keys(point, composed(overrides)) == [
        "optim.lr=0.01 (the sweep gives 0.1)",
        "optim.momentum=0.5 (the sweep gives 0.9)",
    ]
    edit(point, "devices: 1\n", "devices: 3\n")
    assert "devices=3 (the sweep gives 1)" in edited_keys(point, composed(overrides))
    edit(point, "\nresume: null\n", f"\nresume: {point}\n")  # a resume takes its checkpoint's workers
    assert not [k for k in edited_keys(point, composed(overrides)) if k.startswith("devices")]
    (point / CONFIG).write_text("- not a config\n")
    assert edited_keys(point, composed(overrides)) == [f"its {CONFIG} is not a config"]


def test_resuming_refuses_before_any_point_is_touched(tmp_path, monkeypatch):
    """Point 0 (ok, kept) was edited as it was; point 2's edit made its summary an earlier job's (it would
    be resumed from its checkpoint); point 1 failed (run again from the start: its edit is moot), point 3
    never ran. Nothing is set aside, recorded or launched, and the message names both points and keys."""
    monkeypatch.setattr(outcomes, "NOT_OK", [])
    grid = [[f"optim.lr={lr}", "model=mlp", "devices=1"] for lr in ("0.1", "0.2", "0.3", "0.4")]
    sweep = ["optim.lr=0.1,0.2,0.3,0.4"]
    written_point(tmp_path / "0", grid[0])
    for num, status in ((1, "failed"), (2, "ok")):  # as their launcher writes them: with their own lr
        (tmp_path / str(num)).mkdir()
        config = (tmp_path / "0" / CONFIG).read_text().replace("  lr: 0.1\n", f"  lr: 0.{num + 1}\n")
        (tmp_path / str(num) / CONFIG).write_text(config)
        (tmp_path / str(num) / SUMMARY).write_text(json.dumps({"status": status}))
    checkpointed(tmp_path / "2")
    edit(tmp_path / "0", "  lr: 0.1\n", "  lr: 0.01\n", keep_time=True)
    edit(tmp_path / "1", "  lr: 0.2\n", "  lr: 0.02\n")
    edit(tmp_path / "2", "  momentum: 0.9\n", "  momentum: 0.5\n")
    with pytest.raises(ValueError) as refused:
        plan(tmp_path, grid, sweep, retry=True, composed=composed)
    said = str(refused.value)
    assert said.startswith(f"resume={tmp_path}: 2 point(s) of the sweep no longer hold"), said
    assert f"{tmp_path / '0'}: optim.lr=0.01 (the sweep gives 0.1); " in said
    assert f"{tmp_path / '2'}: optim.momentum=0.5 (the sweep gives 0.9))" in said
    assert "move the point's folder out of the sweep folder" in said
    assert not (tmp_path / ATTEMPTS).exists() and not (tmp_path / MANIFEST).exists()

    edit(tmp_path / "0", "  lr: 0.01\n", "  lr: 0.1\n", keep_time=True)  # put back: resumed as before
    edit(tmp_path / "2", "  momentum: 0.5\n", "  momentum: 0.9\n")
    jobs = plan(tmp_path, grid, sweep, retry=True, composed=composed)
    assert [num for num, _ in jobs] == [1, 2, 3]


@pytest.mark.slow
@pytest.mark.mpi
def test_a_real_sweep_with_an_edited_point_is_not_resumed(tmp_path):
    """A one-point sweep resumed as it ended keeps its point; with its config.yaml edited (optim.lr), its
    resume is refused (exit 2) naming the folder and the key, and no file of the sweep changes."""
    sweep = tmp_path / "sweep"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def cli(*args: str) -> tuple[int, str]:
        argv = [sys.executable, "-m", "runner", *args]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=240)
        return done.returncode, done.stdout + done.stderr

    grid = ["optim.lr=0.1", "model=mlp", "devices=1", "train.epochs=1", "train.max_steps=2"]
    code, out = cli("-m", f"hydra.sweep.dir={sweep}", "train.progress=false", *grid)
    assert code == 0, out
    code, out = cli(f"resume={sweep}")
    assert code == 0 and "point 0 ok: kept as it is" in out, out
    edit(sweep / "0", "  lr: 0.1\n", "  lr: 0.01\n")
    before = files(sweep)
    code, out = cli(f"resume={sweep}")
    assert code == 2, out
    assert f"{sweep / '0'}: optim.lr=0.01 (the sweep gives 0.1)" in out and "kept as it is" not in out
    assert files(sweep) == before


def files(folder: Path) -> dict[Path, int]:
    """Every file of a sweep folder but its lock (which names its last holder), with its mtime (ns)."""
    return {p: p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file() and p.name != SWEEP_LOCK}
