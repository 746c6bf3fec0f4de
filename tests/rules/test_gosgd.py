"""GoSGD (runner/rules/gosgd.py). In process, rank by rank on tests/helpers/fakecomm.py: one push by hand,
the push-sum weights summing to one, the consensus invariant, p = 0 sending nothing. In real mpirun jobs:
the same invariants."""

from __future__ import annotations

import pytest
import torch

from runner.rules.gosgd import GoSGDConfig
from tests.conftest import assert_close as assert_params_close
from tests.conftest import initial_model, params_of
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import (
    DT,
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
    vector,
)


# -- in process -------------------------------------------------------------------------------------------
def test_gosgd_one_push_by_hand():
    """Weights 1/2 each; worker 0 at (1, 2) pushes to worker 1 at (3, 6): a_0 = 1/4, and worker 1 merges
    x_1 = (1/2·(3, 6) + 1/4·(1, 2)) / (3/4) = (7/3, 14/3), a_1 = 3/4. The consensus stays (2, 4)."""

    def main(comm):
        model = vector(*[(1.0, 2.0), (3.0, 6.0)][comm.rank])
        rule = build(comm, GoSGDConfig(p=0.0), model)
        if comm.rank == 0:
            rule.push()
        comm.barrier()
        rule.drain()
        x, weight = params(model), rule.weight
        consensus = params(rule.eval_models()[""])
        rule.finish()
        return x, weight, consensus, rule.weight_sum

    (x0, a0, c0, s0), (x1, a1, c1, s1) = FakeWorld(2).run(main)
    assert (a0, a1, s0, s1) == (0.25, 0.75, 1.0, 1.0)
    assert_close(x0, torch.tensor([1.0, 2.0], dtype=DT))
    assert_close(x1, torch.tensor([7 / 3, 14 / 3], dtype=DT))
    assert_close(c0, torch.tensor([2.0, 4.0], dtype=DT))
    assert torch.equal(c0, c1)


@pytest.mark.parametrize("sync_sends", [False, True])
def test_gosgd_weights_sum_to_one_and_lr0_consensus_is_invariant(sync_sends):
    """4 workers from different points, lr = 0, p = 0.7, at most 2 pushes in flight; at every validation
    (after quiescence) Σ a_i = 1, the consensus Σ a_i x_i is the initial mean, and the spread never grows.
    ``sync_sends``: a push completes only once received, so a worker must drain while it waits."""
    n, steps = 4, 12

    def main(comm):
        model = mlp(seed=comm.rank)
        optimizer = sgd(model, lr=0.0)
        rule = build(comm, GoSGDConfig(p=0.7, seed=3, max_inflight=2), model, optimizer)
        seen = []

        def validate(step, stage):
            if stage == "synced" and step % 3 == 0:
                seen.append((params(rule.eval_models()[""]), rule.weight_sum, rule.spread))

        validate(0, "synced")
        fit(rule, model, optimizer, [batch(B, 0)] * steps, validate)
        rule.finish()
        return seen, rule.final_metrics(), rule.weight

    ranks = FakeWorld(n, sync_sends=sync_sends).run(main)
    mean = sum(params(mlp(seed=r)) for r in range(n)) / n
    spreads = [s for _, _, s in ranks[0][0]]
    for consensus, weight_sum, _ in ranks[0][0]:
        assert_close(consensus, mean)
        assert weight_sum == pytest.approx(1.0, abs=1e-15)
    assert all(b <= a + 1e-12 for a, b in zip(spreads, spreads[1:], strict=False)), spreads
    assert spreads[-1] < 0.5 * spreads[0], spreads
    final = ranks[0][1]
    assert final["pushes"] == final["merges"] > 0 and final["weight_sum"] == pytest.approx(1.0, abs=1e-15)
    assert sum(r[2] for r in ranks) == pytest.approx(1.0, abs=1e-15)


def test_gosgd_p0_sends_no_parameters():
    def main(comm):
        model = mlp()
        optimizer = sgd(model, momentum=0.9)
        rule = build(comm, GoSGDConfig(p=0.0), model, optimizer)
        fit(rule, model, optimizer, shard(comm.rank))
        rule.finish()
        return params(model), comm.stats.bytes_sent, rule.final_metrics()

    world = FakeWorld(N)
    for rank, (got, sent, final) in enumerate(world.run(main)):
        assert_close(got, plain(mlp(), shard(rank), momentum=0.9))
        assert sent == int(8 * N * 2 * (N - 1) / N), "more than the quiescence's N push counters was sent"
        assert final["pushes"] == final["merges"] == 0
    assert world.messages == 0


# -- mpirun jobs ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.mpi
def test_weights_sum_to_one_after_training(cli):
    run = cli(
        "rule=gosgd", "rule.p=0.5", "devices=3", "model=mlp", "train.epochs=2", "hardware.oversubscribe=true"
    )
    assert run.returncode == 0, run.output
    s = run.summary
    assert abs(s["weight_sum"] - 1.0) < 1e-12
    assert s["pushes"] > 10 and s["pushes"] == s["merges"]


@pytest.mark.slow
@pytest.mark.mpi
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
        "data.assignment=static",  # every worker its own steps: the seeded pushes, not the machine, decide
    ]
    run = cli(*overrides)
    assert run.returncode == 0, run.output
    spreads = [r["spread"] for r in run.records("epoch")]
    assert all(b <= a + 1e-6 for a, b in zip(spreads, spreads[1:], strict=False)), spreads
    assert spreads[-1] < 0.5 * spreads[0], spreads
    x = [{k: v.detach() for k, v in initial_model(overrides, r).named_parameters()} for r in range(3)]
    mean = {k: sum(xi[k] for xi in x) / 3 for k in x[0]}
    assert_params_close(params_of(run.dir / "model.pt"), mean, atol=1e-6)


@pytest.mark.slow
@pytest.mark.mpi
def test_with_p_0_workers_never_communicate(cli):
    run = cli("rule=gosgd", "rule.p=0", "devices=2", "model=mlp", "train.epochs=1", "train.save_model=all")
    assert run.returncode == 0, run.output
    assert run.summary["pushes"] == 0 and run.summary["merges"] == 0
    a, b = params_of(run.dir / "model.rank0.pt"), params_of(run.dir / "model.rank1.pt")
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 1e-3, (
        "workers on different shards must drift apart"
    )
    assert torch.isfinite(torch.tensor(run.summary["spread"]))
