"""Tab completion as the shell runs it: the function ``mpitrain -sc install=bash`` installs, called with the
line typed so far, for the command lines the docs give (issue 38: the documented quoted search path printed
an error into the prompt)."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from runner.launcher.cli import completion_query, unquoted
from tests.conftest import ROOT

PROJECT = ROOT / "examples" / "my_project"
#: The search path as docs/own-model-data-task.md writes it (quoted: ``[...]`` is a shell glob).
DOCUMENTED = re.search(
    r"^mpitrain ('hydra\.searchpath=[^']+')", (ROOT / "docs/own-model-data-task.md").read_text(), re.M
)


def mpitrain(tmp_path: Path) -> Path:
    """The ``mpitrain`` command the shell finds: the installed console script, or one that runs the same."""
    installed = Path(sys.executable).with_name("mpitrain")
    if installed.exists():
        return installed.parent
    script = tmp_path / "bin" / "mpitrain"
    script.parent.mkdir()
    script.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m runner "$@"\n')
    script.chmod(0o755)
    return script.parent


def complete(tmp_path: Path, line: str) -> tuple[list[str], str]:
    """The candidates bash offers for ``line`` (the cursor at its end), and what it printed on the
    terminal (stderr: into the prompt)."""
    script = (
        'eval "$(mpitrain -sc install=bash)"\n'
        f"COMP_LINE={shlex.quote(line)}\n"
        "COMP_POINT=${#COMP_LINE}\n"
        "words=($COMP_LINE)\n"
        'COMP_CWORD=$(( ${#words[@]} - 1 )); [[ "$COMP_LINE" == *" " ]] && COMP_CWORD=${#words[@]}\n'
        "hydra_bash_completion\n"
        'printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    env = {**os.environ, "PATH": f"{mpitrain(tmp_path)}{os.pathsep}{os.environ['PATH']}"}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(
        ["bash", "-c", script], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split(), proc.stderr


def test_the_documented_search_path_completes_its_options_without_an_error(tmp_path):
    assert DOCUMENTED, "docs/own-model-data-task.md gives no quoted hydra.searchpath"
    offered, printed = complete(tmp_path, f"mpitrain {DOCUMENTED.group(1)} model=")
    assert printed == "", printed
    assert {"model=blob_mlp", "model=wave_mlp", "model=cnn"} <= set(offered), offered


def test_an_option_s_keys_complete_after_the_quoted_search_path(tmp_path):
    offered, printed = complete(tmp_path, f"mpitrain {DOCUMENTED.group(1)} model=blob_mlp model.hi")
    assert printed == "", printed
    assert "model.hidden=" in offered, offered


def test_a_line_that_does_not_parse_prints_nothing_into_the_prompt(tmp_path):
    offered, printed = complete(tmp_path, "mpitrain devices=[ model=")
    assert printed == "" and offered == [], (printed, offered)


@pytest.mark.parametrize(
    "line,read",
    [
        (
            "mpitrain 'hydra.searchpath=[file://conf]' model=",
            "mpitrain hydra.searchpath=[file://conf] model=",
        ),
        ("mpitrain 'hydra.searchpath=[file://conf]' ", "mpitrain hydra.searchpath=[file://conf] "),
        (
            'mpitrain "rule=easgd" \'hydra.searchpath=[file://co',
            "mpitrain rule=easgd hydra.searchpath=[file://co",
        ),
        ("mpitrain rule=", "mpitrain rule="),
    ],
)
def test_the_line_is_read_without_the_shell_s_quotes(line, read):
    assert unquoted(line) == read


def test_only_a_completion_query_is_one():
    assert completion_query(["-sc", "query=bash"]) and completion_query(["--shell-completion=query=zsh"])
    assert not completion_query(["-sc", "install=bash"]) and not completion_query(["rule=easgd"])


def test_flags_after_overrides_are_taken_as_if_given_first():
    """argparse refuses an override after a flag that follows another override (``a=1 -m b=2``)."""
    from runner.launcher.cli import flags_first

    assert flags_first(["optim.lr=0.1,0.2", "-m", "train.epochs=1"]) == [
        "-m",
        "optim.lr=0.1,0.2",
        "train.epochs=1",
    ]
    assert flags_first(["a=1", "--cfg", "job", "b=2"]) == ["--cfg", "job", "a=1", "b=2"]
    assert flags_first(["-sc", "query=bash", "a=1"]) == ["-sc", "query=bash", "a=1"]
    assert flags_first(["a=1", "-i", "b=2"]) == [
        "a=1",
        "-i",
        "b=2",
    ]  # (-i's value is optional: left as given)
