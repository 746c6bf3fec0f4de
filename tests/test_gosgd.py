"""GoSGD's push-sum invariants in real mpirun jobs."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import assert_close, initial_model, params_of

pytestmark = [pytest.mark.slow, pytest.mark.mpi]


def test_weights_sum_to_one_after_training(cli):
    run = cli(
        "rule=gosgd", "rule.p=0.5", "devices=3", "model=mlp", "train.epochs=2", "hardware.oversubscribe=true"
    )
    assert run.returncode == 0, run.output
    s = run.summary
    assert abs(s["weight_sum"] - 1.0) < 1e-12
    assert s["pushes"] > 10 and s["pushes"] == s["merges"]


def test_with_lr_0_spread_only_decreases_and_the_consensus_is_invariant(cli):
    """A merge is a weighted mean, so without training the spread around the consensus never grows (up to
    float32 rounding, about 1e-6 here: at p=0.5 it gets there within an epoch, hence the small p)."""
    overrides = [
        "rule=gosgd",
        "rule.p=0.05",
        "devices=3",
        "hardware.oversubscribe=true",
        "model=mlp",
        "optim.lr=0",
        "train.same_init=false",
        "train.epochs=4",
    ]
    run = cli(*overrides)
    assert run.returncode == 0, run.output
    spreads = [r["spread"] for r in run.records("epoch")]
    assert all(b <= a + 1e-6 for a, b in zip(spreads, spreads[1:], strict=False)), spreads
    assert spreads[-1] < 0.5 * spreads[0], spreads
    x = [{k: v.detach() for k, v in initial_model(overrides, r).named_parameters()} for r in range(3)]
    mean = {k: sum(xi[k] for xi in x) / 3 for k in x[0]}
    assert_close(params_of(run.dir / "model.pt"), mean, atol=1e-6)


def test_with_p_0_workers_never_communicate(cli):
    run = cli("rule=gosgd", "rule.p=0", "devices=2", "model=mlp", "train.epochs=1", "train.save_model=all")
    assert run.returncode == 0, run.output
    assert run.summary["pushes"] == 0 and run.summary["merges"] == 0
    a, b = params_of(run.dir / "model.rank0.pt"), params_of(run.dir / "model.rank1.pt")
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-3, (
        "workers on different shards must drift apart"
    )
    assert torch.isfinite(torch.tensor(run.summary["spread"]))
