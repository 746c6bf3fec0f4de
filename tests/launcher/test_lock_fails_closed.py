"""The run folder's lock fails closed: a ``job.lock`` that cannot be opened or locked refuses the job (exit
2, the file and the fix named) instead of letting two jobs run in one folder at once (issue 37, item 7)."""

from __future__ import annotations

import errno
import os

import pytest

from runner.launcher.lock import RunFolderLock
from runner.run_folder import CONFIG, LOCK
from tests.conftest import run_cli


def test_a_lock_that_is_a_directory_refuses_every_job_naming_it_and_the_fix(tmp_path):
    (tmp_path / LOCK).mkdir()
    for fresh in (True, False):
        with pytest.raises(ValueError, match=rf"cannot lock the run folder: {tmp_path / LOCK}: .*rm -r"):
            RunFolderLock(tmp_path, fresh=fresh).__enter__()


def test_a_folder_that_cannot_be_read_or_written_is_refused(tmp_path, monkeypatch):
    """An EACCES opening the lock (a folder of another user, or mode 000) refuses the job."""

    def denied(path, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))

    monkeypatch.setattr(os, "open", denied)
    with pytest.raises(ValueError, match=rf"{tmp_path / LOCK}: Permission denied; make {tmp_path} readable"):
        RunFolderLock(tmp_path, fresh=False).__enter__()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes every folder (the test above stands in)")
def test_an_unreadable_folder_is_refused(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    folder.chmod(0)
    try:
        with pytest.raises(ValueError, match=r"cannot lock the run folder: .*Permission denied"):
            RunFolderLock(folder, fresh=False).__enter__()
    finally:
        folder.chmod(0o755)


def test_a_missing_folder_to_resume_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"No such file or directory; give the folder of a run"):
        RunFolderLock(tmp_path / "nowhere", fresh=False).__enter__()


def test_no_flock_on_the_file_system_refuses_too(tmp_path, monkeypatch):
    import fcntl

    def unsupported(*args):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", unsupported)
    with pytest.raises(ValueError, match=r"cannot lock the run folder: .*No locks available"):
        RunFolderLock(tmp_path, fresh=True).__enter__()


@pytest.mark.slow
def test_resume_of_a_folder_whose_lock_is_a_directory_exits_2_before_anything_starts(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / LOCK).mkdir(parents=True)
    (run_dir / CONFIG).write_text("devices: 2\n")
    run = run_cli(tmp_path / "elsewhere", f"resume={run_dir}", timeout=120)
    assert run.returncode == 2, run.output
    assert f"cannot lock the run folder: {run_dir / LOCK}: Is a directory; remove that folder" in run.output
    assert "Traceback" not in run.output and not (run_dir / "mpirun.txt").exists(), run.output
