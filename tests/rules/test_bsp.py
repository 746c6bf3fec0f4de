"""BSP (runner/rules/bsp.py). In process, rank by rank on tests/helpers/fakecomm.py: the mean of the
gradients, bucketed and overlapped; params mode averaging exactly every avg_freq steps; linear lr scaling.
In real mpirun jobs through the command line: N ranks with batch b equal one process with batch N·b, equal
torch DDP, and params mode with avg_freq 1 equals grads mode."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from runner.rules.base import RuleContext
from runner.rules.bsp import BSPConfig
from runner.schedule.constant import ConstantConfig
from tests.conftest import COMMON, ROOT, mpirun_argv, params_of, reference_params
from tests.conftest import assert_close as assert_params_close
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import (
    DT,
    GLOBAL,
    B,
    N,
    assert_close,
    batch,
    build,
    fit,
    mlp,
    params,
    plain,
    sgd,
    shard,
)

BATCH = 8


# -- in process -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", ["none", "thread", "nonblocking"])
def test_bsp_grads_n_ranks_follow_one_process_with_n_times_the_batch(overlap):
    """Rank r takes rows r::N of each global batch (equal shards); with the lr unchanged, the mean of the
    gradients (not their sum) gives one process's trajectory on the whole batch. 100-byte buckets: the
    gradients travel in four all-reduces."""
    cfg = BSPConfig(mode="grads", overlap=overlap, bucket_mb=1e-4)

    def main(comm):
        model = mlp()
        optimizer = sgd(model, momentum=0.9)
        rule = build(comm, cfg, model, optimizer)
        assert len(rule.buckets) == 4
        fit(rule, model, optimizer, shard(comm.rank))
        return params(model)

    ref = plain(mlp(), GLOBAL, momentum=0.9)
    assert (ref - params(mlp())).abs().max() > 1e-2, "the reference did not move: this would prove nothing"
    for got in FakeWorld(N).run(main):
        assert_close(got, ref)


@pytest.mark.parametrize("overlap", ["none", "thread", "nonblocking"])
def test_bsp_grads_exchanges_the_mean_of_the_gradients(overlap):
    x, y = GLOBAL[0]

    def local_grad(rank: int) -> torch.Tensor:
        model = mlp()
        F.cross_entropy(model(x[rank::N]), y[rank::N]).backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    def main(comm):
        model = mlp()
        optimizer = sgd(model)
        rule = build(comm, BSPConfig(overlap=overlap, bucket_mb=1e-4), model, optimizer)
        (F.cross_entropy(model(x[comm.rank :: N]), y[comm.rank :: N]) * rule.loss_scale).backward()
        rule.after_backward(0)
        return torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    mean = sum(local_grad(r) for r in range(N)) / N
    for got in FakeWorld(N).run(main):
        assert_close(got, mean)


def test_bsp_grad_buffers_hold_every_gradient_so_a_nan_anywhere_is_seen():
    """The loop checks the sums of BSP's buckets instead of the gradients' norm: they must hold them all."""
    x, y = GLOBAL[0]

    def main(comm):
        model = mlp()
        rule = build(comm, BSPConfig(overlap="none", bucket_mb=1e-4), model, sgd(model))
        for poison in (False, True):
            (F.cross_entropy(model(x[comm.rank :: N]), y[comm.rank :: N]) * rule.loss_scale).backward()
            if poison and comm.rank == 1:
                list(model.parameters())[2].grad[1] = float("nan")
            rule.after_backward(0)
            flat = rule.grad_buffers()
            assert len(flat) > 1
            total = torch.stack([b.sum() for b in flat]).sum()
            if poison:
                assert not torch.isfinite(total)
            else:
                assert_close(total, sum(p.grad.sum() for p in model.parameters()))

    FakeWorld(N).run(main)


@pytest.mark.parametrize("mode", ["grads", "params"])
def test_bsp_one_rank_does_nothing(mode):
    world = FakeWorld(1)

    def main(comm):
        model = mlp()
        optimizer = sgd(model, momentum=0.9)
        rule = build(comm, BSPConfig(mode=mode, lr_scaling="linear"), model, optimizer, steps_per_epoch=2)
        assert rule.buckets == [] and rule.flat is None and rule.lr_factor(0) == 1.0
        fit(rule, model, optimizer, GLOBAL)
        assert rule.eval_models() == {"": model}
        return params(model), comm.stats.bytes_sent

    (got, sent), ref = world.run(main)[0], plain(mlp(), GLOBAL, momentum=0.9)
    assert torch.equal(got, ref) and sent == 0 and world.messages == 0


def test_bsp_params_with_avg_freq_1_and_plain_sgd_equals_grads():
    def run(mode):
        def main(comm):
            model = mlp()
            optimizer = sgd(model)
            rule = build(comm, BSPConfig(mode=mode, overlap="none"), model, optimizer)
            fit(rule, model, optimizer, shard(comm.rank))
            return params(model)

        return FakeWorld(N).run(main)

    ref = run("grads")[0]
    assert (ref - params(mlp())).abs().max() > 1e-2
    for got in run("params"):
        assert_close(got, ref)


def test_bsp_params_averages_exactly_every_avg_freq_steps():
    """Ranks train on different data and agree exactly, on the mean of their parameters, after steps
    3 and 6 only; ``eval_models`` averages too."""
    k, steps = 3, 7

    def main(comm):
        model = mlp()
        optimizer = sgd(model, momentum=0.9)
        rule = build(comm, BSPConfig(mode="params", avg_freq=k), model, optimizer)
        seen = {}

        def record(step, stage):
            seen[step, stage] = params(model)

        fit(rule, model, optimizer, [batch(B, seed=100 * comm.rank + s) for s in range(steps)], record)
        before_eval = params(model)
        rule.eval_models()
        return seen, before_eval, params(model)

    ranks = FakeWorld(N).run(main)
    for step in range(steps):
        stepped = [r[0][step, "stepped"] for r in ranks]
        synced = [r[0][step, "synced"] for r in ranks]
        if (step + 1) % k == 0:
            assert all(torch.equal(s, synced[0]) for s in synced), (
                f"step {step}: ranks differ after averaging"
            )
            assert_close(synced[0], sum(stepped) / N)
        else:
            assert all(torch.equal(s, t) for s, t in zip(synced, stepped, strict=True)), f"step {step}"
            assert (synced[0] - synced[1]).abs().max() > 1e-4, f"step {step}: averaged off schedule"
    assert (ranks[0][1] - ranks[1][1]).abs().max() > 1e-4
    assert all(torch.equal(r[2], ranks[0][2]) for r in ranks)
    assert_close(ranks[0][2], sum(r[1] for r in ranks) / N)


def test_bsp_linear_lr_scaling_with_warmup():
    """N = 4, 10 steps per epoch, 2 warm-up epochs: factor 1 + 3·epoch/2 until epoch 2, then 4."""
    comm = FakeWorld(4).comms[0]  # building BSP communicates nothing
    model = mlp()
    optimizer = sgd(model, lr=0.1)
    rule = build(comm, BSPConfig(lr_scaling="linear", warmup_epochs=2), model, optimizer, steps_per_epoch=10)
    expected = {0: 1.0, 5: 1.75, 10: 2.5, 19: 3.85, 20: 4.0, 1000: 4.0}
    assert {s: rule.lr_factor(s) for s in expected} == pytest.approx(expected, abs=1e-12)
    schedule = ConstantConfig().build(optimizer, 1000, rule.lr_factor)
    for step in (5, 20, 0, 19, 19):  # set from the base rate every step, never compounded
        schedule.apply(step)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * expected[step], abs=1e-12)
    no_warmup = build(comm, BSPConfig(lr_scaling="linear"), model, optimizer, steps_per_epoch=10)
    assert no_warmup.lr_factor(0) == 4.0
    assert build(comm, BSPConfig(), model, optimizer, steps_per_epoch=10).lr_factor(0) == 1.0


def test_bsp_eval_models_averages_batchnorm_statistics():
    def main(comm):
        model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)).to(DT)
        model[1].running_mean.fill_(float(comm.rank))
        model[1].running_var.fill_(2.0 * comm.rank)
        build(comm, BSPConfig(), model, sgd(model)).eval_models()
        return model[1].running_mean.clone(), model[1].running_var.clone()

    ones = torch.ones(4, dtype=DT)
    for mean, var in FakeWorld(N).run(main):  # means of (0, 1, 2) and (0, 2, 4)
        assert torch.equal(mean, ones) and torch.equal(var, 2 * ones)


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


# -- mpirun jobs ------------------------------------------------------------------------------------------
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
        assert_params_close(params_of(run.dir / f"model.rank{r}.pt"), ref)
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
        "-m",
        "tests.helpers.ddp_reference",
        str(out),
        str(port),
        "6",
        str(BATCH),
        *overrides,
    )
    ddp = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert ddp.returncode == 0, ddp.stdout + ddp.stderr
    assert_params_close(params_of(run.dir / "model.pt"), params_of(out))


@pytest.mark.slow
@pytest.mark.mpi
def test_params_mode_with_avg_freq_1_equals_grads_mode(cli):
    overrides = ["model=cnn", "devices=2", f"train.batch_size={BATCH}", *COMMON, "optim.momentum=0"]
    grads = cli(*overrides)
    params = cli(*overrides, "rule.mode=params", "rule.avg_freq=1")
    assert grads.returncode == 0 and params.returncode == 0, grads.output + params.output
    assert_params_close(params_of(params.dir / "model.pt"), params_of(grads.dir / "model.pt"))


@pytest.mark.slow
@pytest.mark.mpi
def test_params_mode_with_rare_averaging_differs(cli):
    """The test above can fail: without averaging every step the two modes part ways."""
    overrides = ["model=mlp", "devices=2", f"train.batch_size={BATCH}", *COMMON, "optim.momentum=0"]
    grads = cli(*overrides)
    params = cli(*overrides, "rule.mode=params", "rule.avg_freq=4", "train.save_model=all")
    a, b = params_of(params.dir / "model.pt"), params_of(grads.dir / "model.pt")
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-4
    assert_params_close(params_of(params.dir / "model.rank1.pt"), a, atol=0)
