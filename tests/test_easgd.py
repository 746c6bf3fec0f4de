"""EASGD in real mpirun jobs: one exchange by hand, the center as the mean, async = sync for one worker."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close, initial_model, params_of

pytestmark = [pytest.mark.slow, pytest.mark.mpi]

ONE_EXCHANGE = [
    "model=mlp",
    "rule=easgd",
    "rule.tau=1",
    "train.epochs=1",
    "train.max_steps=1",
    "optim.lr=0",
    "train.same_init=false",
    "train.save_model=all",
]


def flat_init(overrides, rank):
    return {k: v.detach() for k, v in initial_model(overrides, rank).named_parameters()}


@pytest.mark.parametrize("devices,alpha", [(2, 0.5), (3, 0.3)])
def test_sync_exchange_matches_the_formula(cli, devices, alpha):
    """Workers start from different parameters; with lr 0 the only change is one elastic step:
    d_i = alpha (x_i - c);  x_i <- x_i - d_i;  c <- c + sum_i d_i  (c starts at rank 0's parameters)."""
    overrides = [*ONE_EXCHANGE, f"devices={devices}", f"rule.alpha={alpha}", "hardware.oversubscribe=true"]
    run = cli(*overrides)
    assert run.returncode == 0, run.output
    x = [flat_init(overrides, r) for r in range(devices)]
    assert any((x[0][k] - x[1][k]).abs().max() > 1e-3 for k in x[0]), "workers must start apart"
    center = {k: x[0][k] + sum(alpha * (xi[k] - x[0][k]) for xi in x) for k in x[0]}
    for r in range(devices):
        expected = {k: x[r][k] - alpha * (x[r][k] - x[0][k]) for k in x[r]}
        assert_close(params_of(run.dir / f"model.rank{r}.pt"), expected, atol=1e-6)
    assert_close(params_of(run.dir / "model.pt"), center, atol=1e-6)
    if alpha * devices == 1:
        mean = {k: sum(xi[k] for xi in x) / devices for k in x[0]}
        assert_close(params_of(run.dir / "model.pt"), mean, atol=1e-6)
    assert run.summary["exchanges_per_worker"] == 1


def test_beta_sets_alpha_to_beta_over_n(cli):
    overrides = [*ONE_EXCHANGE, "devices=2", "rule.beta=1.0"]
    run = cli(*overrides)
    assert run.returncode == 0, run.output
    x = [flat_init(overrides, r) for r in range(2)]
    assert_close(params_of(run.dir / "model.pt"), {k: (x[0][k] + x[1][k]) / 2 for k in x[0]}, atol=1e-6)


def test_async_with_one_worker_equals_sync_with_one_worker(cli):
    overrides = [
        "model=mlp",
        "rule=easgd",
        "devices=1",
        "rule.tau=3",
        "rule.alpha=0.4",
        "train.epochs=1",
        "train.max_steps=12",
        "optim.lr=0.1",
        "train.save_model=all",
    ]
    sync = cli(*overrides, "rule.variant=sync")
    asyn = cli(*overrides, "rule.variant=async")
    assert sync.returncode == 0 and asyn.returncode == 0, sync.output + asyn.output
    assert asyn.summary["world_size"] == 2 and asyn.summary["server_exchanges"] == 4
    assert_close(params_of(asyn.dir / "model.pt"), params_of(sync.dir / "model.pt"), atol=1e-6)
    assert_close(params_of(asyn.dir / "model.rank0.pt"), params_of(sync.dir / "model.rank0.pt"), atol=1e-6)
    moved = params_of(sync.dir / "model.rank0.pt")
    start = {k: v.detach() for k, v in initial_model(overrides).named_parameters()}
    assert max((moved[k] - start[k]).abs().max() for k in moved) > 1e-3


def test_async_with_several_workers_serves_every_exchange(cli):
    run = cli(
        "model=mlp",
        "rule=easgd",
        "rule.variant=async",
        "devices=3",
        "rule.tau=2",
        "train.epochs=1",
        "hardware.oversubscribe=true",
    )
    assert run.returncode == 0, run.output
    s = run.summary
    assert s["world_size"] == 4 and s["server_exchanges"] == 3 * s["exchanges_per_worker"]
    epoch = run.records("epoch")[-1]
    assert epoch["center_distance"] > 0 and torch.isfinite(torch.tensor(epoch["center_distance"]))
    assert "worker_mean_val_acc" in run.records("val")[-1]
