"""The light install (issue 38): ``pip install -e .`` runs the default job with the core dependencies only.

The trackers (mlflow, wandb), the TensorBoard viewer (``tensorboard``; the events are written by
tensorboardX), the docs tooling (mkdocs-material) and Hydra's launcher plugins are extras in
``pyproject.toml``; the ``test`` extra holds what the suite needs, so CI runs every test. The default job's
path is checked here in a subprocess, as a fresh ``python -m runner`` imports it: with every extra hidden
(as in a core install), and without the slow optional packages in ``sys.modules`` (as with them installed).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

#: Importable only from an extra: the core install has none of them.
OPTIONAL = (
    *("mlflow", "wandb", "tensorboard", "mkdocs", "material", "submitit", "optuna"),
    *("hydra_plugins.hydra_submitit_launcher", "hydra_plugins.hydra_joblib_launcher"),
    "hydra_plugins.hydra_optuna_sweeper",
)
#: Slow to import and never needed by the default job, even where installed.
NEVER_IMPORTED = ("mlflow", "wandb", "tensorboard", "mkdocs", "material")
#: An extra the ``test`` extra leaves out, with why (no test needs it).
UNTESTED_EXTRAS = {"optuna": "no test runs Hydra's Optuna sweeper; the swept ranges are read without it"}

#: Hides OPTIONAL from imports, as a core install lacks them (a guarded import takes its fallback).
HIDE = """
import importlib.abc, sys
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == h or name.startswith(h + ".") for h in {hidden!r}):
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden: core install)", name=name)
sys.meta_path.insert(0, Hide())
"""
#: The default job's path in one process: the launcher's check and run folder, the rank's modules, the
#: default model, and the records with the default logger (TensorBoard events).
DEFAULT_JOB = """
import json, sys; from pathlib import Path
from tests.conftest import compose_config
import runner.launcher.cli, runner.rank.worker, runner.rank.loop
from runner.launcher.launch import prepare
from runner.schema.config import validate
from runner.rank.records.metrics import MetricsLog
run_dir = Path(sys.argv[1])
prepare(compose_config(), run_dir)
validate(compose_config()).model.build()
log = MetricsLog(run_dir, enabled=True); log.write("step", 1, loss=0.5); log.close()
assert list((run_dir / "tb").glob("*/events.out.tfevents.*")), "no TensorBoard events written"
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules}} & set({never!r}))))
"""


def _default_job(tmp_path, hide: tuple[str, ...] = ()) -> list[str]:
    """Run the default job's path in a fresh interpreter (OPTIONAL hidden when ``hide``); the slow optional
    packages it imported."""
    code = (HIDE.format(hidden=hide) if hide else "") + DEFAULT_JOB.format(never=NEVER_IMPORTED)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "run")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_default_job_runs_its_path_with_every_extra_hidden(tmp_path):
    """As in ``pip install -e .``: no tracker, viewer, docs tool or Hydra plugin importable, and the
    launcher still checks the default config, writes its run folder, and the rank builds and records."""
    assert _default_job(tmp_path, OPTIONAL) == []


@pytest.mark.slow  # a second fresh interpreter importing torch: seconds on a loaded machine
def test_the_default_job_imports_no_tracker_viewer_or_docs_tool_where_installed(tmp_path):
    """With the extras installed (``.[test]``), the default job still imports none of the slow ones."""
    assert _default_job(tmp_path) == []


def _name(requirement: str) -> str:
    """A requirement's package name, normalized (``hydra-core>=1.3,<1.4`` -> ``hydra-core``)."""
    return re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_core_dependencies_hold_no_extra_and_the_test_extra_holds_every_tested_one():
    """pyproject.toml: no extra's package is a core dependency (the tracker, viewer and docs packages are
    not), and the ``test`` extra installs every other extra's packages, so CI's ``.[test]`` skips nothing."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    core = {_name(r) for r in project["dependencies"]}
    extras = {k: {_name(r) for r in v} for k, v in project["optional-dependencies"].items()}
    tested = extras.pop("test")
    assert {"mlflow", "wandb", "tensorboard", "mkdocs-material"} <= set().union(*extras.values())
    for extra, packages in extras.items():
        assert not packages & core, f"[{extra}]'s {sorted(packages & core)} are core dependencies too"
        if extra not in UNTESTED_EXTRAS:
            assert packages <= tested, f"[{extra}]'s {sorted(packages - tested)} are not in [test]"
