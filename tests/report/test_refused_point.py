"""A sweep point refused before its job started (an invalid config for that point: exit 2) is listed in the
sweep report as refused, with its one-line reason, not as a run still running or whose launcher was killed:
its folder has no summary.json, and the sweep's manifest has its reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runner.launcher import sweep_resume
from runner.launcher.sweep_resume import end_point, read_manifest, start_point
from runner.report import runs
from runner.report.runs import load_runs
from tests.conftest import ROOT
from tests.report.test_report import make_run

REASON = "devices=0 is invalid: the number of worker ranks must be >= 1 (e.g. devices=2)"


def refused_point(sweep: Path, num: int, overrides: list[str], reason: str | None = REASON) -> Path:
    """Point ``num`` as a refused one leaves it: Hydra's records only, and the manifest's entry."""
    point = sweep / str(num)
    (point / ".hydra").mkdir(parents=True)
    (point / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    ident = {"overrides": overrides, "name": overrides[0]}
    assert start_point(sweep, num, ident)
    end_point(sweep, num, "invalid", reason)
    return point


def test_the_manifest_keeps_a_refused_points_reason_while_it_is_invalid(tmp_path):
    refused_point(tmp_path, 0, ["devices=0"])
    assert read_manifest(tmp_path)["0"]["error"] == REASON
    end_point(tmp_path, 1, "failed")
    assert "error" not in read_manifest(tmp_path)["1"]
    assert start_point(tmp_path, 0, {"overrides": ["devices=0"], "name": "devices=0"})  # run again
    assert "error" not in read_manifest(tmp_path)["0"]


def test_a_refused_point_is_listed_as_refused_with_its_reason(tmp_path):
    make_run(tmp_path / "0", ["devices=2"], [0.5, 0.9])
    refused_point(tmp_path, 1, ["devices=0"])
    (tmp_path / "2" / ".hydra").mkdir(parents=True)  # a point whose launcher was killed: as before
    (tmp_path / "2" / ".hydra" / "overrides.yaml").write_text("- devices=3\n")
    found, _ = load_runs([tmp_path])
    by_dir = {run.dir.name: run for run in found}
    assert (by_dir["1"].status, by_dir["1"].cause) == ("invalid", f"refused before it started: {REASON}")
    assert by_dir["2"].status == "unfinished" and "launcher was killed" in by_dir["2"].cause
    assert runs.MANIFEST == sweep_resume.MANIFEST


@pytest.mark.slow
def test_a_sweep_reports_its_refused_point(tmp_path):
    """A real sweep whose one point is refused as it starts (no such mpirun; no job starts; a bad value is
    refused before any point, by the sweep): exit 2, and the report names the point as refused, with the
    launcher's reason."""
    argv = [
        sys.executable,
        "-m",
        "runner",
        "-m",
        f"hydra.sweep.dir={tmp_path}",
        "hardware.mpirun=/nonexistent/mpirun",
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    reason = json.loads((tmp_path / "sweep.json").read_text())["points"]["0"]["error"]
    assert reason.startswith("hardware.mpirun='/nonexistent/mpirun' was not found"), reason
    assert (
        f"(invalid, `{tmp_path / '0'}`): refused before it started: {reason}"
        in (tmp_path / "report.md").read_text()
    )
