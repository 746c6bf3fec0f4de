"""The ``torch.distributed`` transport's store is the job's own: it listens on the loopback only on one
node, and its keys are named by a secret the ranks share over MPI, so a process that finds its port cannot
change a run (issue 37, item 3)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from types import SimpleNamespace

import pytest

from runner.comm import dist
from tests.conftest import ROOT, mpirun_argv

JOB = ROOT / "tests" / "helpers" / "store_job.py"


def run_job(mode: str) -> str:
    """``tests/helpers/store_job.py MODE`` on 2 ranks: its output (killed on a timeout)."""
    argv = mpirun_argv(2, sys.executable, "-m", "mpi4py", str(JOB), mode)
    proc = subprocess.Popen(
        argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"store_job.py {mode} did not end in 90 s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    return out


def model(out: str) -> str:
    """The ``model:`` line rank 0 printed."""
    (line,) = [line for line in out.splitlines() if line.startswith("model: ")]
    return line


@pytest.mark.slow
@pytest.mark.mpi
def test_the_store_of_a_one_node_job_listens_on_the_loopback_only():
    """Rank 0's listening sockets on the store's port, read from /proc while the job runs."""
    out = run_job("plain")
    listens = [line.split()[1:] for line in out.splitlines() if line.startswith("listens ")]
    assert listens, out  # the store's socket was found
    assert all(host == "127.0.0.1" for host, _ in listens), listens


@pytest.mark.slow
@pytest.mark.mpi
def test_a_foreign_client_knowing_the_port_does_not_change_the_model():
    """Keys written under ``mpitrain/G/`` (the names before they were secret) before the group's
    rendezvous: the run ends as one without them, to the last digit."""
    assert model(run_job("attacked")) == model(run_job("plain"))


def test_the_store_socket_is_bound_where_the_ranks_reach_it():
    """One node: the loopback; several: the host's own address, else (a loopback name) every interface."""
    fd, host, port = dist.listen("ignored", one_node=True)
    with socket.socket(fileno=fd) as sock:
        assert (host, port) == sock.getsockname() == ("127.0.0.1", port) and port > 0
    fd, host, port = dist.listen("localhost", one_node=False)  # names a loopback address only
    with socket.socket(fileno=fd) as sock:
        assert host == "localhost" and sock.getsockname()[0] in ("0.0.0.0", "::")
    fd, host, port = dist.listen("no-such-host.invalid", one_node=False)
    socket.socket(fileno=fd).close()
    assert host == "no-such-host.invalid"


def test_each_generation_has_its_own_secret_keys():
    """A one-rank transport rebuilt: its keys live under a new random prefix, not under ``mpitrain/G``."""
    sent = []
    alone = SimpleNamespace(
        rank=0, size=1, tolerant=False, local_size=lambda: 1, broadcast_object=lambda x: sent.append(x) or x
    )
    transport = dist.Transport(alone, "gloo", timeout_s=30)
    transport.rebuild(alone)
    (_, _, first, one), (_, _, second, two) = sent
    assert (first, second) == (1, 2) and one != two and len(one) == len(two) == 32
    transport.store.set("k", "v")
    raw = transport.store.underlying_store
    assert raw.check([f"{two}/k"]) and not raw.check(["k"])
