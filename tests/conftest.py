"""Shared helpers: run the real command line (launcher + mpirun) in a temporary run folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


class Run:
    def __init__(self, proc: subprocess.CompletedProcess, run_dir: Path):
        self.proc, self.dir = proc, run_dir
        self.returncode, self.output = proc.returncode, proc.stdout + proc.stderr

    @property
    def summary(self) -> dict:
        return json.loads((self.dir / "summary.json").read_text())

    def records(self, kind: str) -> list[dict]:
        lines = (self.dir / "metrics.jsonl").read_text().splitlines()
        return [r for r in map(json.loads, lines) if r["kind"] == kind]


def run_cli(run_dir: Path, *overrides: str, timeout: float = 180, multirun: bool = False) -> Run:
    """``python -m runner OVERRIDES`` with the run folder at ``run_dir``; a hang fails after ``timeout``."""
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    argv = [
        sys.executable,
        "-m",
        "runner",
        *(["-m"] if multirun else []),
        f"{key}={run_dir}",
        "train.progress=false",
        *overrides,
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
    return Run(proc, run_dir)


@pytest.fixture
def cli(tmp_path):
    """Call as ``cli(*overrides)``; each call gets a fresh run folder under tmp_path."""
    count = iter(range(1000))

    def call(*overrides: str, **kwargs) -> Run:
        return run_cli(tmp_path / f"run{next(count)}", *overrides, **kwargs)

    return call


def mpirun_argv(n: int, *args: str) -> list[str]:
    """An mpirun command line for ``n`` ranks on this machine (oversubscribed, root allowed)."""
    from runner.launch import find_mpirun

    argv = [find_mpirun(None), "-n", str(n), "--oversubscribe", "--bind-to", "none"]
    if os.geteuid() == 0:
        argv.append("--allow-run-as-root")
    return argv + list(args)
