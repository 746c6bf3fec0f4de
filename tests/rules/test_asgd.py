"""ASGD / Downpour (runner/rules/asgd.py). In process, rank by rank on tests/helpers/fakecomm.py: one
worker is plain SGD, two servers equal one, the staleness policies by hand. In real mpirun jobs: one worker
is plain SGD, sharding is exact, staleness is handled."""

from __future__ import annotations

import pytest
import torch

from runner.rules.asgd import ASGDConfig, corrected_momentum, delay_momentum
from tests.conftest import COMMON, params_of, reference_params
from tests.conftest import assert_close as assert_params_close
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import DT, B, assert_close, batch, build, fit, mlp, params, plain, sgd, vector


# -- in process -------------------------------------------------------------------------------------------
def asgd(n, cfg, worker):
    """Workers run ``worker(comm, rule, model)`` then evaluate and finish; servers serve. Returns per rank
    (the value ``worker`` returned, the servers' model as evaluated, final_metrics)."""

    def main(comm):
        model = mlp()
        rule = build(comm, cfg, model, sgd(model))
        out = evaluated = None
        if rule.is_server:
            rule.serve()
        else:
            out = worker(comm, rule, model)
            evaluated = params(rule.eval_models()[""])
            rule.finish()
        return out, evaluated, rule.final_metrics()

    return FakeWorld(n).run(main)


BATCHES = [batch(B, seed=s) for s in range(7)]


def train_asgd(comm, rule, model):
    optimizer = sgd(model, momentum=0.9)
    fit(rule, model, optimizer, BATCHES)
    return params(model)


@pytest.mark.parametrize("n_push,n_fetch", [(1, 1), (2, 3)])
def test_asgd_one_worker_equals_plain_sgd(n_push, n_fetch):
    """With one worker the fetched parameters are its own pushed ones, so the worker and the server follow
    plain SGD (with momentum) for any schedule."""
    (got, served, final), *_ = asgd(2, ASGDConfig(n_push=n_push, n_fetch=n_fetch), train_asgd)
    ref = plain(mlp(), BATCHES, momentum=0.9)
    assert_close(got, ref)
    assert_close(served, ref)
    if n_push == n_fetch == 1:
        assert final["staleness_histogram"] == {"0": 7} and final["server_versions"] == [7]


def test_asgd_two_servers_equal_one():
    """Sharding (here across a tensor) changes nothing: same worker and server parameters, same versions;
    staleness scaling makes the fetches matter (n_fetch = 3 lags n_push = 2)."""
    cfg = {"n_push": 2, "n_fetch": 3, "staleness": "scale"}
    (one, one_served, one_final), _ = asgd(2, ASGDConfig(servers=1, **cfg), train_asgd)
    (two, two_served, two_final), *_ = asgd(3, ASGDConfig(servers=2, **cfg), train_asgd)
    assert (one - plain(mlp(), BATCHES, momentum=0.9)).abs().max() > 1e-3, "staleness never mattered"
    assert_close(two, one)
    assert_close(two_served, one_served)
    assert two_final["server_versions"] == one_final["server_versions"] * 2


@pytest.mark.parametrize(
    "policy,bound,expected,dropped",
    [
        ("accept", None, (11.0, 11.0), 0),
        ("scale", None, (1 + 10 / 3, 0.5 + 10 / 3), 0),
        ("drop", 1, (1.0, 1.0), 1),
        ("drop", 2, (11.0, 11.0), 0),
    ],
)
def test_asgd_staleness_policies_by_hand(policy, bound, expected, dropped):
    """From (0, 0), no worker fetches: worker 0 pushes (1, 0) (staleness 0), then worker 1 pushes (0, 1)
    (staleness 1), then worker 0 pushes (10, 10) (staleness 2). accept adds all, scale adds Δ/(1 + τ),
    drop discards what exceeds the bound."""
    pushes = [(0, (1.0, 0.0)), (1, (0.0, 1.0)), (0, (10.0, 10.0))]

    def main(comm):
        model = vector(0.0, 0.0)
        rule = build(
            comm, ASGDConfig(staleness=policy, max_staleness=bound, n_fetch=10**6), model, sgd(model)
        )
        if rule.is_server:
            rule.serve()
            return None, rule.final_metrics()
        for who, delta in pushes:
            if who == rule.workers.rank:
                rule.x.add_(torch.tensor(delta, dtype=DT))
                rule.push()
            rule.workers.barrier()  # the server receives the pushes in this order
        served = params(rule.eval_models()[""])
        rule.finish()
        return served, rule.final_metrics()

    ranks = FakeWorld(3).run(main)
    for served, _ in ranks[:2]:
        assert_close(served, torch.tensor(expected, dtype=DT))
    final = ranks[0][1]
    assert final["staleness_histogram"] == {"0": 1, "1": 1, "2": 1}
    assert final["dropped_pushes"] == dropped and final["server_versions"] == [3 - dropped]


@pytest.mark.parametrize("correction", ["momentum", "delay"])
def test_momentum_correction_at_staleness_0_is_plain_asgd_bit_for_bit(correction):
    """One worker fetching after each push: every push has staleness 0, so the corrected momentum is the
    configured one and the trajectory is plain ASGD's, bit for bit (worker and servers). (With n_push <
    n_fetch its own pushes would count as staleness, as they do for staleness=scale.)"""

    def train(comm, rule, model):
        optimizer = sgd(model, momentum=0.9)
        rule.optimizer, rule.momenta = optimizer, [0.9]  # the rule is built with the loop's optimizer
        fit(rule, model, optimizer, BATCHES)
        return params(model), optimizer.param_groups[0]["momentum"]

    cfg = {"servers": 2}
    (plain_run, plain_served, _), *_ = asgd(3, ASGDConfig(momentum_correction="none", **cfg), train)
    (fixed_run, fixed_served, final), *_ = asgd(3, ASGDConfig(momentum_correction=correction, **cfg), train)
    assert torch.equal(fixed_run[0], plain_run[0]) and torch.equal(fixed_served, plain_served)
    assert fixed_run[1] == 0.9 and set(final["staleness_histogram"]) == {"0"}


@pytest.mark.parametrize("correction, expected", [("momentum", 0.4), ("delay", 8 / 9), ("none", 0.9)])
def test_momentum_correction_follows_the_servers_mean_staleness(correction, expected):
    """Pushes of staleness 0, 1, 2 (mean 1, as in the test above); worker 0's next fetch sets its momentum:
    ``momentum`` to 0.9 − 1/(1 + 1) = 0.4 (Mitliagkas et al.: implicit momentum 1 − 1/M with M = 2);
    ``delay`` to 8/9, a mean delay of 8 steps, which with the pushes' 1 is 0.9's 9."""
    pushes = [(0, (1.0, 0.0)), (1, (0.0, 1.0)), (0, (10.0, 10.0))]

    def main(comm):
        model = vector(0.0, 0.0)
        optimizer = sgd(model, momentum=0.9)
        rule = build(comm, ASGDConfig(momentum_correction=correction, n_fetch=10**6), model, optimizer)
        if rule.is_server:
            rule.serve()
            return None
        for who, delta in pushes:
            if who == rule.workers.rank:
                rule.x.add_(torch.tensor(delta, dtype=DT))
                rule.push()
            rule.workers.barrier()
        if rule.workers.rank == 0:
            rule.fetch()
        rule.finish()
        return optimizer.param_groups[0]["momentum"]

    first, second, _ = FakeWorld(3).run(main)
    assert first == pytest.approx(expected) and second == 0.9
    assert corrected_momentum(0.9, 0) == 0.9 and corrected_momentum(0.9, 9) == 0.0
    assert delay_momentum(0.9, 0) == 0.9 and delay_momentum(0.9, 10) == 0.0 and delay_momentum(0.0, 3) == 0.0


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("mu, staleness", [(0.9, 1.0), (0.9, 3.0), (0.5, 0.25), (0.99, 2.0), (0.9, 50.0)])
def test_the_delay_correction_takes_the_staleness_out_of_a_gradients_mean_delay(mu, staleness, nesterov):
    """Heavy-ball momentum μ moves a weight, for one gradient, over the steps after it with a mean delay of
    μ/(1 − μ) steps; at :func:`delay_momentum`'s μ' the mean delay is τ̄ steps less (0 at least), so a
    push τ̄ steps stale reaches the weights when it would in one process. Nesterov's look-ahead moves
    the same a step sooner."""

    def mean_delay(momentum, steps=4000):  # of the moves, weighted by their size
        w = torch.zeros(1, dtype=torch.float64, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.01, momentum=momentum, nesterov=nesterov and momentum > 0)
        moves = []
        for step in range(steps):
            w.grad = torch.ones_like(w) if step == 0 else torch.zeros_like(w)
            before = float(w.detach())
            opt.step()
            moves.append(before - float(w.detach()))
        return sum(k * m for k, m in enumerate(moves)) / sum(moves)

    ahead = mu if nesterov else 0.0  # (Nesterov: μ/(1 − μ) − μ)
    assert mean_delay(mu) == pytest.approx(mu / (1 - mu) - ahead, abs=1e-6)
    lowered = delay_momentum(mu, staleness)
    assert lowered < mu
    ahead = lowered if nesterov else 0.0
    assert mean_delay(lowered) == pytest.approx(max(0.0, mu / (1 - mu) - staleness) - ahead, abs=1e-6)


@pytest.mark.parametrize(
    "given, read", [(True, "momentum"), (False, "none"), ("false", "none"), ("delay", "delay")]
)
def test_momentum_correction_takes_its_names_and_earlier_releases_bools(given, read):
    assert ASGDConfig(momentum_correction=given).momentum_correction == read
    with pytest.raises(ValueError, match="momentum_correction.*delay, momentum, none"):
        ASGDConfig(momentum_correction="lag")


# -- mpirun jobs ------------------------------------------------------------------------------------------
NEVER = "rule.n_fetch=100000"


@pytest.mark.slow
@pytest.mark.mpi
def test_one_worker_equals_single_process_sgd(cli):
    overrides = ["model=mlp", *COMMON]
    run = cli("rule=asgd", "devices=1", "train.batch_size=16", "train.save_model=all", *overrides)
    assert run.returncode == 0, run.output
    ref = reference_params(16, overrides)
    assert_params_close(params_of(run.dir / "model.pt"), ref, atol=1e-6)
    assert_params_close(params_of(run.dir / "model.rank0.pt"), ref, atol=1e-6)
    s = run.summary
    assert s["world_size"] == 2 and s["pushes"] == 6 and s["staleness_histogram"] == {"0": 6}


@pytest.mark.slow
@pytest.mark.mpi
def test_two_servers_hold_the_same_parameters_as_one(cli):
    """Workers that never fetch follow a fixed schedule (static shards: each worker the same batches in
    both jobs): the servers end at x0 + all pushed updates."""
    overrides = ["model=mlp", "rule=asgd", "devices=2", NEVER, *COMMON, "hardware.oversubscribe=true"]
    overrides.append("data.assignment=static")
    one, two = cli(*overrides, "rule.servers=1"), cli(*overrides, "rule.servers=2")
    assert one.returncode == 0 and two.returncode == 0, one.output + two.output
    assert two.summary["world_size"] == 4 and len(two.summary["server_versions"]) == 2
    assert_params_close(params_of(two.dir / "model.pt"), params_of(one.dir / "model.pt"), atol=1e-6)


@pytest.mark.slow
@pytest.mark.mpi
def test_staleness_is_recorded_and_drop_drops_what_exceeds_the_bound(cli):
    overrides = ["model=mlp", "rule=asgd", "devices=2", NEVER, *COMMON, "hardware.oversubscribe=true"]
    accept = cli(*overrides)
    drop = cli(*overrides, "rule.staleness=drop", "rule.max_staleness=2")
    assert accept.returncode == 0 and drop.returncode == 0, accept.output + drop.output
    hist = {int(k): v for k, v in accept.summary["staleness_histogram"].items()}
    assert sum(hist.values()) == 2 * 6 and max(hist) >= 6, "without fetches staleness must grow"
    assert accept.summary["dropped_pushes"] == 0
    dropped = drop.summary
    stale = sum(v for k, v in dropped["staleness_histogram"].items() if int(k) > 2)
    assert dropped["dropped_pushes"] == stale > 0
    assert dropped["server_versions"] == [2 * 6 - stale]
    (final,) = drop.records("final")
    assert final["dropped_pushes"] == stale and final["server_versions"] == dropped["server_versions"]
