"""BSP's math: N ranks with batch b equal one process with batch N·b, equal torch DDP, and params mode
with avg_freq 1 equals grads mode. Each test runs real mpirun jobs through the command line."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch

from runner.rules.base import RuleContext
from runner.rules.bsp import BSPConfig
from runner.schedule.constant import ConstantConfig
from tests.conftest import COMMON, ROOT, assert_close, mpirun_argv, params_of, reference_params

BATCH = 8


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("ranks,overlap", [(2, "none"), (2, "nonblocking"), (4, "thread")])
def test_grads_mode_equals_one_process_with_n_times_the_batch(cli, ranks, overlap):
    """Small buckets (10 kB) so that the MLP's gradients travel in several all-reduces."""
    overrides = ["model=mlp", *COMMON]
    run = cli(
        f"devices={ranks}",
        "hardware.oversubscribe=true",
        f"train.batch_size={BATCH}",
        "train.save_model=all",
        f"rule.overlap={overlap}",
        "rule.bucket_mb=0.01",
        *overrides,
    )
    assert run.returncode == 0, run.output
    ref = reference_params(ranks * BATCH, overrides)
    initial = reference_params(ranks * BATCH, overrides, steps=0)
    moved = max((ref[k] - initial[k]).abs().max().item() for k in ref)
    assert moved > 1e-3, "the reference did not train: the comparison would prove nothing"
    for r in range(ranks):
        assert_close(params_of(run.dir / f"model.rank{r}.pt"), ref)
    assert run.summary["steps"] == 6


@pytest.mark.slow
@pytest.mark.mpi
def test_grads_mode_matches_torch_ddp(cli, tmp_path):
    overrides = ["model=cnn", *COMMON]
    run = cli("devices=2", f"train.batch_size={BATCH}", *overrides)
    assert run.returncode == 0, run.output
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ddp.pt"
    argv = mpirun_argv(
        2,
        sys.executable,
        str(ROOT / "tests" / "ddp_reference.py"),
        str(out),
        str(port),
        "6",
        str(BATCH),
        *overrides,
    )
    ddp = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    assert_close(params_of(run.dir / "model.pt"), params_of(out))


@pytest.mark.slow
@pytest.mark.mpi
def test_params_mode_with_avg_freq_1_equals_grads_mode(cli):
    overrides = ["model=cnn", "devices=2", f"train.batch_size={BATCH}", *COMMON, "optim.momentum=0"]
    grads = cli(*overrides)
    params = cli(*overrides, "rule.mode=params", "rule.avg_freq=1")
    assert grads.returncode == 0 and params.returncode == 0, grads.output + params.output
    assert_close(params_of(params.dir / "model.pt"), params_of(grads.dir / "model.pt"))


@pytest.mark.slow
@pytest.mark.mpi
def test_params_mode_with_rare_averaging_differs(cli):
    """The test above can fail: without averaging every step the two modes part ways."""
    overrides = ["model=mlp", "devices=2", f"train.batch_size={BATCH}", *COMMON, "optim.momentum=0"]
    grads = cli(*overrides)
    params = cli(*overrides, "rule.mode=params", "rule.avg_freq=4", "train.save_model=all")
    a, b = params_of(params.dir / "model.pt"), params_of(grads.dir / "model.pt")
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-4
    assert_close(params_of(params.dir / "model.rank1.pt"), a, atol=0)


class _FakeComm:
    def __init__(self, size):
        self.size, self.rank = size, 0

    def keep(self, t):
        pass


@pytest.mark.parametrize(
    "scaling,warmup,step,expected",
    [
        ("none", 0, 50, 1.0),
        ("linear", 0, 0, 4.0),
        ("linear", 2, 0, 1.0),
        ("linear", 2, 10, 2.5),
        ("linear", 2, 20, 4.0),
        ("linear", 2, 99, 4.0),
    ],
)
def test_linear_lr_scaling_with_warmup(scaling, warmup, step, expected):
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctx = RuleContext(_FakeComm(4), _FakeComm(4), model, optimizer, steps_per_epoch=10)
    rule = BSPConfig(lr_scaling=scaling, warmup_epochs=warmup).build(ctx)
    ConstantConfig().build(optimizer, 100, rule.lr_factor).apply(step)
    assert rule.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * expected)
