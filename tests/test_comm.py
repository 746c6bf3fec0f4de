"""The communication layer in real mpirun jobs of 1-3 ranks, and flat parameter storage."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from runner.flat import FlatTensors
from tests.conftest import ROOT, mpirun_argv


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


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_comm_layer_in_an_mpirun_job(ranks):
    proc = run_job(mpirun_argv(ranks, sys.executable, "-m", "mpi4py", str(ROOT / "tests" / "comm_job.py")))
    assert f"comm checks passed on {ranks} ranks" in proc.stdout


def test_comm_layer_without_mpirun():
    """A plain ``python`` process is a one-rank world (singleton MPI init)."""
    assert (
        "comm checks passed on 1 ranks"
        in run_job([sys.executable, str(ROOT / "tests" / "comm_job.py")]).stdout
    )


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
