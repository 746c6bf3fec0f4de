"""``hardware.env``'s values are secrets: the ranks get them through mpirun's (or srun's) environment, and no
file, name or command line holds them; the run folder is private to the user unless ``hardware.folder_mode``
says otherwise; ``resume=`` takes them again from the command line or the environment."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from runner.hardware.cpu import CPUConfig
from runner.hardware.mpirun import build_argv
from runner.launcher.resume import restore_env
from runner.schema.identity import identity
from runner.schema.secrets import HIDDEN, fill_hidden, hidden, hide_file
from tests.conftest import checked_config, run_cli

SECRET = "s3cret-value-7f2a"


def test_config_trees_records_and_override_strings_are_masked():
    config = {"hardware": {"env": {"TOKEN": SECRET, "N": 1}, "mca": {"btl": "^ofi"}}, "rule": {"alpha": 0.5}}
    masked = hidden(config)
    assert masked["hardware"]["env"] == {"TOKEN": HIDDEN, "N": HIDDEN}
    assert masked["hardware"]["mca"] == {"btl": "^ofi"} and masked["rule"] == {"alpha": 0.5}
    assert hidden(["+hardware.env.TOKEN=abc", "rule.alpha=0.5"]) == [
        f"+hardware.env.TOKEN={HIDDEN}",
        "rule.alpha=0.5",
    ]
    assert hidden("rule=bsp,hardware.env.TOKEN=abc,seed=1") == f"rule=bsp,hardware.env.TOKEN={HIDDEN},seed=1"
    assert config["hardware"]["env"]["TOKEN"] == SECRET, "a copy: the config itself is unchanged"


def test_a_runs_identity_and_name_hold_no_value():
    ident = identity([f"hardware.env.TOKEN={SECRET}", "rule.alpha=0.5"])
    assert SECRET not in str(ident)
    assert ident["swept"]["hardware.env.TOKEN"] == HIDDEN and ident["swept"]["rule.alpha"] == 0.5


def test_hydra_files_are_rewritten_without_the_values(tmp_path):
    path = tmp_path / "overrides.yaml"
    path.write_text(yaml.safe_dump([f"+hardware.env.TOKEN={SECRET}", "devices=2"]))
    hide_file(path)
    assert yaml.safe_load(path.read_text()) == [f"+hardware.env.TOKEN={HIDDEN}", "devices=2"]
    clean = tmp_path / "clean.yaml"
    clean.write_text("a: 1  # kept as written\n")
    hide_file(clean)
    assert clean.read_text() == "a: 1  # kept as written\n", "a file with no secret is not rewritten"


def test_mpirun_names_the_variables_and_takes_their_values_from_its_environment():
    hw = CPUConfig(env={"TOKEN": SECRET, "NCCL_DEBUG": "INFO"})
    argv = build_argv(hw, 2, Path("/run"), mpirun="mpirun", flavor="openmpi", cores=2, as_root=False)
    assert SECRET not in " ".join(argv) and "INFO" not in argv
    assert ["-x", "TOKEN"] == argv[argv.index("TOKEN") - 1 : argv.index("TOKEN") + 1]
    assert "-x" in argv and "OMP_NUM_THREADS=1" in argv, "the launcher's own settings stay on the line"
    mpich = build_argv(hw, 2, Path("/run"), mpirun="mpiexec", flavor="mpich", cores=2, as_root=False)
    assert SECRET not in " ".join(mpich)
    assert mpich[mpich.index("-genvlist") + 1].startswith("TOKEN,NCCL_DEBUG,")


def test_the_planned_launch_carries_them_for_the_launchers_environment(tmp_path):
    planned = checked_config([f"+hardware.env.TOKEN={SECRET}"]).hardware.plan_launch(2, tmp_path)
    assert planned.env == {"TOKEN": SECRET} and SECRET not in " ".join(planned.argv)


def test_resume_takes_hidden_values_from_the_command_line_then_the_environment(monkeypatch, tmp_path):
    """``config.yaml`` kept ``A``, ``B`` hidden; the command line gave ``A`` again (resume applied it), the
    launcher's environment has ``B``."""
    resumed = OmegaConf.create({"hardware": {"env": {"A": "typed", "B": HIDDEN}}})
    monkeypatch.setenv("A", "not this one")
    monkeypatch.setenv("B", "from-env")
    restore_env(resumed, ["hardware.env.A=typed"], tmp_path / "config.yaml")
    assert OmegaConf.to_container(resumed.hardware.env) == {"A": "typed", "B": "from-env"}


def test_a_hidden_value_given_nowhere_is_refused_naming_the_key(monkeypatch, tmp_path):
    monkeypatch.delenv("TOKEN", raising=False)
    with pytest.raises(ValueError, match=r"hardware\.env\.TOKEN: .* give it again .*export TOKEN"):
        fill_hidden({"TOKEN": HIDDEN}, set(), tmp_path / "config.yaml", environ={})


def test_folder_mode_is_an_octal_string():
    with pytest.raises(ValueError, match="folder_mode"):
        CPUConfig(folder_mode="rwx")
    assert CPUConfig(folder_mode="0750").folder_mode == "0750"


@pytest.mark.slow
@pytest.mark.mpi
def test_a_job_gets_its_secret_and_no_file_of_its_folder_holds_it(tmp_path):
    """The ranks build a model that checks the variable's SHA-256 (tests/helpers/needs_secret.py): the job
    ends ok, and no file of the run folder (config, Hydra's records, run.json, TensorBoard, mpirun.txt,
    logs) holds the value; the folder is the user's alone."""
    digest = hashlib.sha256(SECRET.encode()).hexdigest()
    run = run_cli(
        tmp_path / "run",
        "hydra.searchpath=[file://tests/conf]",
        "model=needs_secret",
        f"model.secret_sha256={digest}",
        f"+hardware.env.MPITRAIN_TEST_SECRET={SECRET}",
        "train.max_steps=5",
        "hardware.bind=none",
        timeout=120,
    )
    assert run.returncode == 0, run.output
    holding = [str(p) for p in run.dir.rglob("*") if p.is_file() and SECRET.encode() in p.read_bytes()]
    assert not holding, holding
    assert stat.S_IMODE(run.dir.stat().st_mode) == 0o700
    assert "-x MPITRAIN_TEST_SECRET " in (run.dir / "mpirun.txt").read_text()


def test_a_sweep_resumed_takes_hidden_values_from_the_environment_by_interpolation():
    from runner.schema.secrets import restored_override

    environ = {"TOKEN": SECRET}
    assert (
        restored_override(f"+hardware.env.TOKEN={HIDDEN}", environ) == "+hardware.env.TOKEN=${oc.env:TOKEN}"
    )
    assert restored_override("rule.alpha=0.5", environ) == "rule.alpha=0.5"
    with pytest.raises(ValueError, match=r"hardware\.env\.OTHER: .*export OTHER"):
        restored_override(f"hardware.env.OTHER={HIDDEN}", environ)
    with pytest.raises(ValueError, match=r"^hardware\.env: "):
        restored_override(f"hardware.env={HIDDEN}", environ)
