"""A sweep on a launcher whose extra is not installed (``hydra/launcher=joblib`` without ``.[joblib]``) is
refused before anything starts, naming the extra and its install command (issue 38: Hydra said only that it
could not find the option). The plugin is taken away as a core install lacks it: Hydra finds its plugins in
the ``hydra_plugins`` folders, here one that holds every installed plugin but joblib's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from runner.launcher.register import PLUGINS
from tests.conftest import ROOT

#: ``python -c``: hydra_plugins without the plugins named in argv[1] (comma-separated), then mpitrain.
WITHOUT = """
import sys
from pathlib import Path
import hydra_plugins
hidden, bare = sys.argv.pop(1).split(","), Path(sys.argv.pop(1))
bare.mkdir()
for folder in map(Path, list(hydra_plugins.__path__)):
    for plugin in folder.iterdir():
        if plugin.name not in hidden and not (bare / plugin.name).exists():
            (bare / plugin.name).symlink_to(plugin)
hydra_plugins.__path__ = [str(bare)]
from runner.launcher.cli import run
sys.argv[0] = "mpitrain"
run()
"""
INSTALL = 'pip install -e ".[joblib]"'


def mpitrain_without(tmp_path: Path, plugin: str, *args: str) -> subprocess.CompletedProcess:
    """``mpitrain ARGS`` (from the repository) in a Python where Hydra's ``plugin`` is not installed."""
    argv = [sys.executable, "-c", WITHOUT, plugin, str(tmp_path / "hydra_plugins"), *args]
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_the_joblib_launcher_without_its_extra_names_the_install_command(tmp_path):
    sweep = tmp_path / "sweep"
    proc = mpitrain_without(
        tmp_path,
        "hydra_joblib_launcher",
        "-m",
        "hydra/launcher=joblib",
        f"hydra.sweep.dir={sweep}",
        "seed=1,2",
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    assert (
        "hydra/launcher=joblib needs Hydra's hydra-joblib-launcher plugin, which is not installed" in output
    )
    assert INSTALL in output and "Traceback" not in output, output
    assert not (sweep / "0").exists() and "Launching" not in output, output


def test_the_launcher_chosen_by_a_yaml_names_the_install_command_too(tmp_path):
    """Chosen by an experiment's defaults instead of the command line: Hydra's own message is reworded."""
    (tmp_path / "conf" / "experiment").mkdir(parents=True)
    (tmp_path / "conf" / "experiment" / "par.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /hydra/launcher: joblib\n"
    )
    proc = mpitrain_without(
        tmp_path,
        "hydra_joblib_launcher",
        "-m",
        f"hydra.searchpath=[file://{tmp_path / 'conf'}]",
        "+experiment=par",
        f"hydra.sweep.dir={tmp_path / 'sweep'}",
        "seed=1,2",
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2 and INSTALL in output and "Traceback" not in output, output


def test_with_the_plugin_installed_nothing_is_refused():
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason='pip install -e ".[joblib]"')
    from runner.launcher.register import check_plugins, missing_plugin

    assert missing_plugin("hydra/launcher", "joblib") is None
    check_plugins(["-m", "hydra/launcher=joblib"])


def test_each_plugin_s_extra_installs_it():
    """The extra each line names is pyproject.toml's, and it installs the plugin's distribution."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for options in PLUGINS.values():
        for _module, distribution, extra in options.values():
            names = [re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0] for r in extras[extra]]
            assert distribution in names, (extra, extras[extra])
