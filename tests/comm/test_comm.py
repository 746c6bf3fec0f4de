"""The communication layer in real mpirun jobs of 1-3 ranks, and flat parameter storage."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner.comm.flat import FlatTensors
from tests.conftest import ROOT, mpirun_argv

COMM_JOB = ROOT / "tests" / "helpers" / "comm_job.py"


def run_job(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        argv,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_comm_layer_in_an_mpirun_job(ranks):
    proc = run_job(mpirun_argv(ranks, sys.executable, "-m", "mpi4py", str(COMM_JOB)))
    assert f"comm checks passed on {ranks} ranks" in proc.stdout


@pytest.mark.slow
def test_comm_layer_without_mpirun():
    """A plain ``python`` process is a one-rank world (singleton MPI init)."""
    assert "comm checks passed on 1 ranks" in run_job([sys.executable, str(COMM_JOB)]).stdout


def test_flat_tensors_are_views_and_keep_values():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))
    before = [p.detach().clone() for p in model.parameters()]
    flat = FlatTensors(model.parameters())
    assert len(flat.buffers) == 1 and flat.numel == sum(p.numel() for p in before)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    flat.buffers[0].zero_()
    assert all(torch.all(p == 0) for p in model.parameters())
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    assert flat.buffers[0].abs().sum() > 0, "optimizer steps must land in the flat buffer"


def test_flat_tensors_group_by_dtype():
    a, b, c = torch.ones(3), torch.zeros(2, dtype=torch.float64), torch.full((2, 2), 2.0)
    flat = FlatTensors([a, b, c])
    assert sorted(buf.numel() for buf in flat.buffers) == [2, 7]
    assert torch.equal(c, torch.full((2, 2), 2.0)) and c.data_ptr() == flat.buffers[0].data_ptr() + 3 * 4


def test_cuda_awareness_is_read_from_the_mpi_library(monkeypatch):
    """Detection agrees with what ``ompi_info`` says the library was built with; the env override wins."""
    import runner.comm  # noqa: F401  (loads the MPI library, which the detection looks for)
    from runner.comm.staging import CUDA_AWARE_ENV, cuda_aware_mpi
    from runner.hardware.mpirun import find_mpirun, mpi_flavor

    monkeypatch.delenv(CUDA_AWARE_ENV, raising=False)
    mpirun = find_mpirun(None)
    if mpi_flavor(mpirun) == "openmpi":
        info = subprocess.run(
            [Path(mpirun).parent / "ompi_info", "--parsable", "--all"],
            capture_output=True,
            text=True,
            timeout=60,
        ).stdout
        built = "opal_built_with_cuda_support:value:true" in info
        assert "opal_built_with_cuda_support:value:" in info, info[:500]
        assert cuda_aware_mpi() == built
    monkeypatch.setenv(CUDA_AWARE_ENV, "1")
    assert cuda_aware_mpi() is True
    monkeypatch.setenv(CUDA_AWARE_ENV, "0")
    assert cuda_aware_mpi() is False


def test_pinned_staging_buffers_are_reused_per_tensor_and_bounded():
    from runner.comm.staging import HostBuffers, Staged

    pool = HostBuffers(capacity=2)
    a, b, c = torch.arange(4.0), torch.arange(6.0), torch.ones(3, dtype=torch.float64)
    first = pool.get(a)
    assert pool.get(a) is first and pool.allocated == 1, "a tensor staged every step gets one buffer"
    assert first.numel() == 4 and first.dtype == a.dtype and first.is_pinned() == torch.cuda.is_available()
    pool.get(b)
    pool.get(c)
    assert len(pool) == 2 and pool.allocated == 3
    assert pool.get(a) is not first and pool.allocated == 4, "least recently used buffer was dropped"

    target = torch.zeros(8)[::2]
    staged = Staged(target, pool.get(target), copy_in=False)
    staged.host.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    staged.finish()
    assert torch.equal(target, torch.tensor([1.0, 2.0, 3.0, 4.0]))


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuda_aware", ["0", "auto"])
def test_comm_layer_on_cuda_tensors(cuda_aware):
    """Every operation on CUDA tensors: staged through pinned buffers ("0"), or as detected ("auto")."""
    forced = [] if cuda_aware == "auto" else ["-x", f"MPITRAIN_CUDA_AWARE={cuda_aware}"]
    job = [sys.executable, "-m", "mpi4py", str(COMM_JOB), "cuda"]
    proc = run_job(mpirun_argv(2, *forced, *job))
    assert "comm checks passed on 2 ranks (cuda" in proc.stdout
    if cuda_aware == "0":
        assert "staged" in proc.stdout and "0 pinned buffers" not in proc.stdout
