"""examples/my_project, a user's project with its own ``data`` and ``models`` packages and ``conf/`` folder,
trained from its own folder as its README says: the runner's own packages (``runner.data``, ``runner.models``)
and the project's top-level ``data`` and ``models`` do not collide, on the launcher's side nor the ranks'."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, Run, cli_argv
from tests.helpers.rules import variants

PROJECT = ROOT / "examples" / "my_project"
SEARCH = "hydra.searchpath=[file://conf]"
BLOBS = [SEARCH, "model=blob_mlp", "data=blobs", "train.epochs=2"]
WAVE = [SEARCH, "model=wave_mlp", "data=wave"]
#: The README's numbers: the blobs are classified almost perfectly (chance: 0.25), the wave is fitted close
#: to its noise (variance 0.01; predicting the mean: about 0.83).
ACCURACY, MSE = 0.9, 0.03
#: The project's classes in every rank, a server's too: BSP (workers only) and ASGD (a server rank, a third
#: rank on 2 cores). A rule does not care whose class the model is (every rule trains in
#: tests/rules/test_rules_train.py): these two are enough.
RULES = variants({"asgd": {"": ["hardware.oversubscribe=true"]}}, default=[], only=("bsp", "asgd"))


def run_example(run_dir: Path, *overrides: str, timeout: float = 120) -> Run:
    """``python -m runner OVERRIDES`` in the example's folder, as its user would run it."""
    proc = subprocess.run(
        cli_argv(run_dir, *overrides),
        cwd=PROJECT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    return Run(proc, run_dir)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rule, extra", RULES)
def test_classification_example_trains_on_every_rank(tmp_path, rule, extra):
    run = run_example(tmp_path / "run", *BLOBS, f"rule={rule}", *extra)
    assert run.returncode == 0, run.output
    summary = run.summary
    assert summary["model"] == "models.nets.MLP"  # the project's class, imported by every rank
    assert summary["final_val_acc"] >= ACCURACY, run.output


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_regression_example_fits_the_wave(tmp_path):
    run = run_example(tmp_path / "run", SEARCH, "+experiment=wave")
    assert run.returncode == 0, run.output
    summary = run.summary
    assert summary["monitor"] == "val_loss"
    assert summary["final_val_loss"] < MSE, run.output


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(120)
def test_float_targets_are_refused_by_classification(tmp_path):
    run = run_example(tmp_path / "run", *WAVE, "task=classification", "train.epochs=1")
    assert run.returncode == 1, run.output
    summary = run.summary
    assert summary["status"] == "failed" and summary["validations"] == []
    assert "task=classification needs integer class labels" in summary["cause"]
    assert "use task=regression" in summary["cause"] and "use task=regression" in run.output


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_console_script_finds_the_project_packages(tmp_path):
    """``mpitrain`` (whose script's folder, not the working folder, starts ``sys.path``) finds the project's
    ``data.toy`` and ``models.nets`` like ``python -m runner`` does: the launcher checks both, then refuses
    ``devices=0``, which it checks after them, and starts nothing."""
    script = Path(sys.executable).with_name("mpitrain")
    if not script.exists():
        pytest.skip("the console script mpitrain is not installed next to this Python")
    argv = [str(script), f"hydra.run.dir={tmp_path / 'run'}", *BLOBS, "devices=0"]
    proc = subprocess.run(argv, cwd=PROJECT, capture_output=True, text=True, timeout=50)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert "devices=0 is invalid" in output and "_target_" not in output, output
