"""mpirun's session files: a folder of the job's own, removed after it, so a killed mpirun's leftovers
cannot stop a later mpirun that is given the same pid (:mod:`runner.launcher.session_dir`)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from runner.launcher.session_dir import LOCAL_TMPDIR_ENV, PREFIX, session_dir
from runner.launcher.supervise import Supervisor
from tests.conftest import ROOT, plain_mpirun_argv

NS_LAST_PID = Path("/proc/sys/kernel/ns_last_pid")
PID_MAX = Path("/proc/sys/kernel/pid_max")
#: Where PMIx tells a rank its server's session folder.
SHOW_SESSION = "import os; print('session:', os.environ['PMIX_SERVER_TMPDIR'], flush=True)"


def test_each_use_gets_a_new_folder_removed_after_it_even_on_error():
    with session_dir({"A": "1"}) as env:
        first = Path(env[LOCAL_TMPDIR_ENV])
        assert env["A"] == "1" and first.is_dir() and first.name.startswith(PREFIX)
        (first / "ompi.123").mkdir()  # what a killed mpirun leaves
    assert not first.exists()
    with pytest.raises(RuntimeError), session_dir({}) as env:
        second = Path(env[LOCAL_TMPDIR_ENV])
        assert second != first
        raise RuntimeError("the job failed")
    assert not second.exists()


@pytest.mark.parametrize("key", ["PRTE_MCA_prte_tmpdir_base", LOCAL_TMPDIR_ENV])
def test_a_place_the_user_chose_is_kept(tmp_path, key):
    with session_dir({key: str(tmp_path)}) as env:
        assert env == {key: str(tmp_path)}
    assert tmp_path.is_dir()


def stale_session_folders(tmp: Path, count: int = 3000) -> None:
    """What killed mpiruns would leave in ``tmp`` for the next ``count`` pids this machine hands out."""
    if not NS_LAST_PID.is_file():
        pytest.skip("no /proc/sys/kernel/ns_last_pid: the next pids cannot be known")
    last, top = int(NS_LAST_PID.read_text()), int(PID_MAX.read_text())
    host = socket.gethostname()
    for n in range(1, count + 1):
        pid = last + n if last + n < top else 300 + last + n - top  # pids wrap to 300
        folder = tmp / f"ompi.{pid}"
        folder.mkdir(exist_ok=True)
        (folder / f"pmix.{host}.tool").write_text("tcp4://127.0.0.1:1\n5.0.11\n1\n0:0\n")


@pytest.mark.slow
@pytest.mark.mpi
def test_a_killed_mpiruns_leftovers_stop_a_plain_mpirun_but_not_the_launchers(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    stale_session_folders(tmp)
    env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": str(ROOT)}
    argv = plain_mpirun_argv(2, sys.executable, "-c", SHOW_SESSION)
    plain = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert plain.returncode != 0 and "listener thread failed to start" in plain.stderr, (
        "the premise: Open MPI's PMIx does not reclaim a dead mpirun's session files (if it now does, the "
        f"launcher's own session folder is no longer needed): {plain.returncode} {plain.stderr[-400:]}"
    )
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    outcome = Supervisor(argv, run_dir, 2, None, env={"TMPDIR": str(tmp)}).run()
    log = (run_dir / "mpirun.log").read_text()
    assert outcome.returncode == 0, log
    sessions = {Path(line.split()[1]) for line in log.splitlines() if line.startswith("session:")}
    assert len(sessions) == 1, log
    [session] = sessions
    base = next(p for p in session.parents if p.name.startswith(PREFIX))
    assert not base.exists(), "the job's session folder is removed after it"
    assert tmp not in session.parents
