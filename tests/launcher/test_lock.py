"""One job per run folder: a used folder and a folder in use are refused before anything is written."""

from __future__ import annotations

import os

import pytest

from runner.launcher.lock import RunFolderLock
from runner.run_folder import CONFIG, LOCK
from tests.conftest import run_cli


def test_a_folder_in_use_is_refused_naming_its_holder_and_free_again_after(tmp_path):
    with RunFolderLock(tmp_path, fresh=True):
        assert f"launcher pid {os.getpid()} on " in (tmp_path / LOCK).read_text()
        with pytest.raises(
            ValueError, match=rf"in use by a running job \(launcher pid {os.getpid()} on .*STOP"
        ):
            RunFolderLock(tmp_path, fresh=False).__enter__()
    with RunFolderLock(tmp_path, fresh=False):  # released when its holder is done
        pass


def test_a_lock_left_by_a_dead_launcher_blocks_nothing(tmp_path):
    (tmp_path / LOCK).write_text("launcher pid 999999 on elsewhere, since 01:02:03\n")
    with RunFolderLock(tmp_path, fresh=True):
        assert "999999" not in (tmp_path / LOCK).read_text()


def test_a_new_run_into_a_folder_that_holds_one_is_refused_with_the_fixes(tmp_path):
    (tmp_path / CONFIG).write_text("devices: 2\n")
    with pytest.raises(ValueError, match=rf"already holds a run .*resume={tmp_path}, or give a fresh folder"):
        RunFolderLock(tmp_path, fresh=True).__enter__()
    with RunFolderLock(tmp_path, fresh=False):  # resume= of it is allowed
        pass


@pytest.mark.slow
def test_the_command_refuses_a_used_folder_and_a_second_resume_with_exit_2(tmp_path):
    used = tmp_path / "used"
    used.mkdir()
    (used / CONFIG).write_text("devices: 2\n")
    again = run_cli(used, "train.epochs=1")
    assert again.returncode == 2 and f"resume={used}" in again.output, again.output
    assert "Traceback" not in again.output and not (used / "mpirun.txt").exists()
    with RunFolderLock(used, fresh=False):  # a job runs there
        second = run_cli(tmp_path / "elsewhere", f"resume={used}")
    assert second.returncode == 2 and f"in use by a running job (launcher pid {os.getpid()}" in second.output
    assert "Traceback" not in second.output, second.output


def test_a_run_folder_that_cannot_be_made_is_refused_in_one_line(tmp_path):
    from runner.launcher.register import check_folders, unique_dir

    under_a_file = tmp_path / "file"
    under_a_file.write_text("")
    for bad in (under_a_file / "run", tmp_path / ("a" * 300)):
        with pytest.raises(OSError, match=r"hydra\.run\.dir=.*: cannot make this folder: "):
            check_folders([f"hydra.run.dir={bad}"])
        with pytest.raises(OSError, match=r"cannot make the run folder .*hydra\.run\.dir=\.\.\."):
            unique_dir(str(bad / "12-00-00"))
    check_folders(["hydra.run.dir=${now:%H}", f"++hydra.sweep.dir={tmp_path / 'ok'}", "train.epochs=1"])
    assert (tmp_path / "ok").is_dir()


@pytest.mark.slow
def test_the_command_names_a_folder_it_cannot_make_without_a_traceback(tmp_path):
    (tmp_path / "file").write_text("")
    run = run_cli(tmp_path / "file" / "run", "train.epochs=1")
    assert run.returncode == 1 and run.output.count("\n") == 1, run.output  # not the input's fault
    assert "hydra.run.dir=" in run.output and "Not a directory" in run.output


def test_hydras_compose_errors_are_told_in_mpitrains_words():
    from hydra.errors import ConfigCompositionException, MissingConfigException

    from runner.launcher.explain import explain

    misspelt = ConfigCompositionException("Could not override 'train.epoch'.\nTo append to your config use +")
    line = explain(misspelt, ["-m", "train.epoch=1,2", "optim.lr=0.1,0.2", "hydra.run.dir=/x"])
    assert line.startswith("train.epoch: not an option of TrainConfig (did you mean train.epochs?)"), line
    missing = MissingConfigException("In 'config': Could not find 'data/rings'\n\nAvailable options...")
    line = explain(missing, ["data=rings"])
    assert "data=rings: no such option (the options of data are: cifar10, " in line, line
    assert "hydra.searchpath=[file://DIR] (or -cd DIR), DIR holding data/rings.yaml" in line
    assert "\n" not in explain(ConfigCompositionException("a\n  full_key: x\n  object_type=y"), [])
