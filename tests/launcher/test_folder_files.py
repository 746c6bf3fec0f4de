"""A run folder's files are opened as what they are: a link or a pipe planted in a run folder is refused,
named, and nothing is written where it points; a full disk and a dangling ``hydra.run.dir`` are named with
the fix."""

from __future__ import annotations

import errno
import logging
import os
import sys
import threading
from pathlib import Path

import pytest

from runner.folder_files import (
    ForeignFile,
    create_new,
    dangling_link,
    make_folder,
    open_in_folder,
    unwritten,
)
from runner.launcher.lock import RunFolderLock
from runner.launcher.supervise import Supervisor
from runner.rank.checkpoint import Checkpointer, save_atomic
from runner.rank.fence import Fence
from runner.rank.records.metrics import MetricsLog
from runner.run_folder import CONFIG, LOCK, METRICS, MPIRUN_LOG, part_damage, write_atomic
from tests.conftest import run_cli

PRECIOUS = "a file of the user's, outside the run folder\n"


@pytest.fixture
def target(tmp_path) -> Path:
    """A file outside the run folder that a planted link points to."""
    path = tmp_path / "precious.txt"
    path.write_text(PRECIOUS)
    return path


@pytest.fixture
def run_dir(tmp_path) -> Path:
    path = tmp_path / "run"
    (path / "logs").mkdir(parents=True)
    (path / CONFIG).write_text("devices: 2\n")
    return path


def link_refusal(path: Path, target: Path) -> str:
    return f"{path} is a symbolic link (to {target}): a run folder's files are its own; remove it"


def test_resume_of_a_folder_with_a_planted_lock_link_is_refused_and_writes_nothing(run_dir, target):
    """Before: ``resume=`` truncated the file job.lock pointed to and wrote its pid into it."""
    (run_dir / LOCK).symlink_to(target)
    with pytest.raises(ValueError) as refused:
        RunFolderLock(run_dir, fresh=False).__enter__()
    assert str(refused.value) == link_refusal(run_dir / LOCK, target) + ". Nothing was started"
    assert target.read_text() == PRECIOUS


def test_the_folder_check_names_every_link_and_pipe_in_the_folder_and_its_folders(run_dir, target):
    from runner.run_folder import foreign_files

    (run_dir / METRICS).symlink_to(target)
    os.mkfifo(run_dir / "JOIN")
    (run_dir / "checkpoints" / "00001-step5").mkdir(parents=True)
    (run_dir / "checkpoints" / "00001-step5" / "rank0.pt").symlink_to(target)
    (run_dir / "logs" / "rank0.log").write_text("fine\n")
    found = foreign_files(run_dir)
    assert found == [
        f"{run_dir / 'JOIN'} is a named pipe (FIFO), not a regular file",
        f"{run_dir / 'checkpoints/00001-step5/rank0.pt'} is a symbolic link (to {target})",
        f"{run_dir / METRICS} is a symbolic link (to {target})",
    ]
    with pytest.raises(
        ValueError, match=r"\(to .*precious.txt\): a run folder's files are its own; remove them"
    ):
        RunFolderLock(run_dir, fresh=False).__enter__()
    link = run_dir.parent / "elsewhere"
    link.symlink_to(run_dir)  # the run folder itself may be a link: the user's choice of where it is
    assert len(foreign_files(link)) == 3


def test_metrics_of_a_resumed_run_are_never_cut_or_appended_through_a_link(run_dir, target):
    """Before: a resumed run cut the file metrics.jsonl pointed to back to the checkpoint's line count."""
    (run_dir / METRICS).symlink_to(target)
    with pytest.raises(ForeignFile, match=rf"{METRICS} is a symbolic link \(to {target}\)"):
        MetricsLog(run_dir, True, resume=(0, 0, 0.0), loggers={})
    assert target.read_text() == PRECIOUS


def test_mpirun_log_is_never_appended_through_a_link(run_dir, target, caplog):
    (run_dir / MPIRUN_LOG).symlink_to(target)
    outcome = Supervisor([sys.executable, "-c", "print('hello')"], run_dir, 1, None).run()
    assert outcome.returncode == 0 and target.read_text() == PRECIOUS
    assert link_refusal(run_dir / MPIRUN_LOG, target) in caplog.text


@pytest.mark.parametrize("mode", ["r", "rb", "w", "a", "ab"])
def test_a_link_is_refused_in_every_mode_and_a_pipe_never_blocks(tmp_path, target, mode):
    link = tmp_path / "file"
    link.symlink_to(target)
    with pytest.raises(ForeignFile, match=r"is a symbolic link \(to "):
        open_in_folder(link, mode)
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    with pytest.raises(ForeignFile, match=r"pipe is a named pipe \(FIFO\), not a regular file: .* remove it"):
        open_in_folder(pipe, mode)
    assert target.read_text() == PRECIOUS
    with pytest.raises(IsADirectoryError):
        open_in_folder(tmp_path, mode)


def test_a_join_that_is_a_pipe_is_named_at_once_instead_of_blocking(tmp_path):
    """Before: worker 0 waited on the pipe for a writer, the job with it, until the stall watchdog."""
    from runner.rank.join_request import read_join

    os.mkfifo(tmp_path / "JOIN")
    raised: list[BaseException] = []

    def read() -> None:
        try:
            read_join(tmp_path / "JOIN")
        except OSError as err:
            raised.append(err)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=5)
    if reader.is_alive():  # (let it go)
        os.close(os.open(tmp_path / "JOIN", os.O_RDWR))
        pytest.fail("reading a JOIN that is a named pipe blocked")
    assert "JOIN is a named pipe (FIFO), not a regular file" in str(raised[0])
    (tmp_path / "JOIN").unlink()
    (tmp_path / "JOIN").write_text("2\n")
    assert read_join(tmp_path / "JOIN") == "2\n"


def test_temporary_files_are_made_anew_never_written_through_a_link(tmp_path, target):
    """write_atomic's and save_atomic's temporary files: before, a link in their place was written through."""
    (tmp_path / ".summary.json.tmp").symlink_to(target)
    write_atomic(tmp_path / "summary.json", "{}")
    (tmp_path / "rank0.pt.tmp").symlink_to(target)
    save_atomic({"x": 1}, tmp_path / "rank0.pt")
    assert target.read_text() == PRECIOUS and (tmp_path / "summary.json").read_text() == "{}"
    assert part_damage(tmp_path / "rank0.pt", None) is None
    assert not (tmp_path / ".summary.json.tmp").exists() and not (tmp_path / "rank0.pt.tmp").exists()
    (tmp_path / "folder.tmp").mkdir()
    with pytest.raises(IsADirectoryError):
        create_new(tmp_path / "folder.tmp")


def test_a_checkpoint_part_behind_a_link_is_damaged_not_read(tmp_path, target):
    part = tmp_path / "rank0.pt"
    part.symlink_to(target)
    assert part_damage(part, None) == f"unreadable: {link_refusal(part, target)}"


def test_a_link_in_place_of_a_run_folders_own_folder_is_refused(run_dir, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (run_dir / "checkpoints").symlink_to(elsewhere)
    with pytest.raises(ForeignFile, match=r"checkpoints is a symbolic link \(to .*elsewhere\)"):
        Checkpointer(None, run_dir, None, None, Fence(run_dir, False))
    (run_dir / "file").write_text("")
    with pytest.raises(FileExistsError):
        make_folder(run_dir / "file")
    assert make_folder(run_dir / "logs") == run_dir / "logs" and not list(elsewhere.iterdir())


def test_a_full_disk_is_named_with_the_file_and_the_fix(tmp_path, monkeypatch):
    """Before: 'error: nothing was started: No space left on device', without the folder."""
    import runner.run_folder

    def full(path: Path, binary: bool = False):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(runner.run_folder, "create_new", full)
    with pytest.raises(OSError) as failed:
        write_atomic(tmp_path / "config.yaml", "x")
    assert str(failed.value) == (
        f"[Errno 28] cannot write {tmp_path / 'config.yaml'}: No space left on device; free space on its "
        f"disk (df -h {tmp_path})"
    )
    (tmp_path / ".hydra").mkdir()

    def save_config(output_dir: Path) -> None:  # as Hydra writes .hydra/config.yaml: closing it fails
        with open(output_dir / "config.yaml", "w") as file:
            file.write("x")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(OSError) as hydra:
        save_config(tmp_path / ".hydra")
    assert unwritten(hydra.value, "hydra.run.dir") == (
        f"cannot write {tmp_path / '.hydra/config.yaml'}: No space left on device; free space on its disk "
        f"(df -h {tmp_path / '.hydra'}), or give a folder on another disk (hydra.run.dir=...)"
    )
    assert unwritten(OSError(errno.EACCES, "Permission denied", str(tmp_path))) is None


def test_a_dangling_link_as_the_run_folder_is_named_with_its_key_and_the_fix(tmp_path):
    (tmp_path / "run").symlink_to(tmp_path / "gone")
    assert dangling_link("hydra.run.dir", str(tmp_path / "run" / "sub")) == (
        f"hydra.run.dir={tmp_path / 'run' / 'sub'}: {tmp_path / 'run'} is a symbolic link to "
        f"{tmp_path / 'gone'}, which does not exist: make that folder (mkdir -p {tmp_path / 'gone'}), "
        f"remove the link (rm {tmp_path / 'run'}), or give another folder (hydra.run.dir=...)"
    )
    assert dangling_link("hydra.run.dir", str(tmp_path / "other")) is None


def test_resume_of_a_folder_with_planted_links_exits_2_naming_them_and_writes_nothing(run_dir, target):
    """The command itself: invalid input (exit 2) before any rank starts, the files named, the target as
    it was (before: job.lock's target truncated, metrics.jsonl's and mpirun.log's cut and appended to)."""
    for name in (LOCK, METRICS, MPIRUN_LOG):
        (run_dir / name).symlink_to(target)
    run = run_cli(run_dir.parent / "elsewhere", f"resume={run_dir}")
    assert run.returncode == 2, run.output
    for name in (LOCK, METRICS, MPIRUN_LOG):
        assert f"{run_dir / name} is a symbolic link (to {target})" in run.output
    assert "remove them" in run.output and "Traceback" not in run.output
    assert target.read_text() == PRECIOUS and not (run_dir / "mpirun.txt").exists()


def test_the_launchers_log_file_is_never_written_through_a_link(run_dir, target):
    """Hydra makes the handler of ``cli.log`` before the launcher checks the folder; before, the launcher's
    lines (the refusal too) were appended to what a planted ``cli.log`` pointed to."""
    from runner.launcher.echo import FolderFileHandler

    record = logging.LogRecord("runner", logging.ERROR, __file__, 1, "invalid input", None, None)
    (run_dir / "cli.log").symlink_to(target)
    linked = FolderFileHandler(str(run_dir / "cli.log"))
    linked.emit(record)
    linked.close()
    assert target.read_text() == PRECIOUS
    own = FolderFileHandler(str(run_dir / "own.log"))
    own.emit(record)
    own.close()
    assert (run_dir / "own.log").read_text() == "invalid input\n"
