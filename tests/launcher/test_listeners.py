"""A job on one machine keeps its ranks off the network: no rank listens on an address other than the
loopback (the store and gloo on 127.0.0.1, Open MPI's TCP BTL left out), unless the job may grow."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from runner.hardware.cluster import ClusterConfig
from runner.hardware.cpu import CPUConfig
from runner.hardware.mpirun import build_argv
from runner.hardware.slurm import SlurmConfig
from tests.conftest import ROOT, cli_argv
from tests.helpers.store_job import listening


def btl(hw) -> str:
    """The ``--mca btl`` value of ``hw``'s mpirun command line for a 2-rank CPU job."""
    argv = build_argv(hw, 2, Path("/run"), mpirun="mpirun", flavor="openmpi", cores=2, as_root=False)
    return next(argv[i + 2] for i, a in enumerate(argv) if a == "--mca" and argv[i + 1] == "btl")


def test_one_machine_leaves_out_tcp_unless_the_job_may_grow():
    assert btl(CPUConfig()) == "^ofi,tcp"
    assert btl(CPUConfig(fault_tolerance="heal")) == "^ofi", "spawned processes reach the job by TCP"
    assert btl(CPUConfig(fault_tolerance="continue", max_workers=4)) == "^ofi"
    assert btl(CPUConfig(fault_tolerance="continue")) == "^ofi,tcp", "nothing is spawned"


def test_several_hosts_a_slurm_allocation_and_the_users_own_btl_are_kept():
    assert btl(ClusterConfig(hosts=["a:1", "b:1"])) == "^ofi"
    assert btl(SlurmConfig()) == "^ofi", "mpirun reads the allocation's nodes: no host arguments"
    assert btl(CPUConfig(mca={"btl": "self,sm,tcp"})) == "self,sm,tcp"


def rank_pids(run_dir: Path) -> list[int]:
    """The pids of the ranks working on ``run_dir`` (``python -m runner.rank.worker RUN_DIR``; not mpirun,
    whose command line holds theirs)."""
    pids = []
    for entry in os.listdir("/proc"):
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if cmdline[1:4] == [b"-m", b"runner.rank.worker", str(run_dir).encode()]:
            pids.append(int(entry))
    return pids


@pytest.mark.slow
@pytest.mark.mpi
def test_the_ranks_of_a_one_node_gloo_job_listen_on_the_loopback_only(tmp_path):
    """Every listening socket of every rank, read from /proc once both train (the store, gloo's devices)."""
    run_dir = tmp_path / "run"
    overrides = ("devices=2", "hardware.transport=gloo", "hardware.bind=none", "train.epochs=60")
    proc = subprocess.Popen(
        cli_argv(run_dir, *overrides), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline, found = time.time() + 120, {}
        while time.time() < deadline and proc.poll() is None:
            metrics = run_dir / "metrics.jsonl"
            if metrics.exists() and '"step"' in metrics.read_text():  # both ranks are past the rendezvous
                found = {pid: listening(str(pid)) for pid in rank_pids(run_dir)}
                break
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=120)
    assert len(found) == 2 and all(found.values()), (found, out[-2000:])  # the store's and gloo's sockets
    outside = {pid: [a for a in sockets if a[0] != "127.0.0.1"] for pid, sockets in found.items()}
    assert not any(outside.values()), outside
