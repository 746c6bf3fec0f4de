"""A sweep folder has one owner: a second sweep into a folder in use (a sweep running there, or one that
ended there) is refused before any point starts (exit 2), naming the folder and the fixes, and no report is
written into it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from runner.launcher import outcomes
from runner.launcher.sweep_resume import MANIFEST, read_manifest
from runner.launcher.sweeper import SWEEP_LOCK, MpitrainSweeper, SweepFolderLock
from runner.run_folder import SWEEP_CONFIG
from tests.conftest import ROOT


def test_a_held_folder_refuses_a_second_sweep_and_its_resume(tmp_path):
    with SweepFolderLock(tmp_path, fresh=True):
        assert f"pid {os.getpid()} on " in (tmp_path / SWEEP_LOCK).read_text()
        for fresh in (True, False):
            with pytest.raises(ValueError) as refused, SweepFolderLock(tmp_path, fresh=fresh):
                pass
            assert str(refused.value).startswith(
                f"{tmp_path} is in use by a running sweep (pid {os.getpid()}"
            )
            assert "hydra.sweep.dir=" in str(refused.value) and f"resume={tmp_path}" in str(refused.value)
    with SweepFolderLock(tmp_path, fresh=True):  # released: taken again
        pass


@pytest.mark.parametrize("record", [SWEEP_CONFIG, MANIFEST])
def test_a_folder_that_holds_a_sweep_takes_its_resume_only(tmp_path, record):
    (tmp_path / record).write_text("{}\n")
    with pytest.raises(ValueError, match=rf"already holds a sweep \(its {record}\).*resume={tmp_path}"):
        with SweepFolderLock(tmp_path, fresh=True):
            pass
    with SweepFolderLock(tmp_path, fresh=False):
        pass


def test_a_lock_that_cannot_be_taken_refuses_the_sweep(tmp_path):
    (tmp_path / SWEEP_LOCK).mkdir()  # a folder in the lock's place
    with pytest.raises(
        ValueError, match=rf"cannot lock the sweep folder: {tmp_path / SWEEP_LOCK}: .*Nothing"
    ):
        with SweepFolderLock(tmp_path, fresh=True):
            pass


def test_a_lock_linked_elsewhere_is_refused_and_its_target_untouched(tmp_path):
    """A sweep folder from elsewhere whose sweep.lock links to a file of the user's: never truncated."""
    (tmp_path / "mine").write_text("the user's\n")
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / SWEEP_LOCK).symlink_to(tmp_path / "mine")
    with pytest.raises(ValueError, match=r"sweep\.lock is a symbolic link .*Nothing was started"):
        with SweepFolderLock(tmp_path / "sweep", fresh=True):
            pass
    assert (tmp_path / "mine").read_text() == "the user's\n"


class Launcher:
    def __init__(self) -> None:
        self.launches: list = []

    def launch(self, batch: list, initial_job_idx: int) -> list:
        self.launches.append(batch)
        return []


def test_the_sweeper_launches_nothing_into_a_folder_in_use(tmp_path, monkeypatch):
    monkeypatch.setattr(outcomes, "REFUSED", set())
    (tmp_path / SWEEP_CONFIG).write_text("kept: the first sweep's\n")
    sweeper = MpitrainSweeper()
    settings = {"retry": True, "fail_fast": False, "zip": []}
    sweeper.config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path)}}, "sweep": settings})
    sweeper.hydra_context = SimpleNamespace(config_loader=None)
    sweeper.launcher = Launcher()
    with pytest.raises(ValueError, match="already holds a sweep"):
        sweeper.sweep(["optim.lr=1,2"])
    assert sweeper.launcher.launches == [] and outcomes.REFUSED == {tmp_path}
    assert (tmp_path / SWEEP_CONFIG).read_text() == "kept: the first sweep's\n"


def cli(*args: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "runner", *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)


def stamps(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


@pytest.mark.slow
def test_a_second_sweep_into_a_folder_in_use_is_refused(tmp_path):
    """Sweeps of points refused before launch (no such mpirun). One ends in the folder; a second sweep of
    other points there is refused, and so is its resume while another process holds the folder; the first
    sweep's files stay as they were (no report written over its own)."""
    sweep = tmp_path / "sweep"
    first = cli("-m", f"hydra.sweep.dir={sweep}", "hardware.mpirun=/nonexistent/mpirun")
    assert first.returncode == 2 and (sweep / "report.md").is_file(), first.stdout + first.stderr
    before = {k: v for k, v in stamps(sweep).items() if k != SWEEP_LOCK}

    second = cli("-m", f"hydra.sweep.dir={sweep}", "devices=-1")
    said = second.stdout + second.stderr
    assert second.returncode == 2, said
    assert f"{sweep} already holds a sweep (its {SWEEP_CONFIG})" in said and f"resume={sweep}" in said
    assert "hydra.sweep.dir" in said and "Launching" not in said  # no point started
    assert list(read_manifest(sweep)) == ["0"] and not (sweep / "1").exists()

    with SweepFolderLock(sweep, fresh=False):  # a sweep running there now
        resumed = cli(f"resume={sweep}")
    said = resumed.stdout + resumed.stderr
    assert resumed.returncode == 2 and f"{sweep} is in use by a running sweep (pid {os.getpid()}" in said, (
        said
    )
    assert {k: v for k, v in stamps(sweep).items() if k != SWEEP_LOCK} == before
