"""EASGD (runner/rules/easgd.py). In process, rank by rank on tests/helpers/fakecomm.py: sync and async
exchanges by hand, workers plus center conserved, alpha from beta, async with one worker = sync. In real
mpirun jobs: one exchange by hand, the center as the mean, async = sync for one worker."""

from __future__ import annotations

import pytest
import torch

from runner.rules.easgd import EASGDConfig
from tests.conftest import assert_close as assert_params_close
from tests.conftest import initial_model, params_of
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import DT, B, N, assert_close, batch, build, fit, mlp, params, sgd, vector


# -- in process -------------------------------------------------------------------------------------------
def test_easgd_sync_exchange_by_hand():
    """beta = 0.6 with 3 workers: alpha = 0.2. Center c = (1, 1) (rank 0's parameters at build), then the
    workers move to x_i; the exchange after step tau = 2 (and not after step 1):
    x_i' = x_i − 0.2 (x_i − c), c' = c + 0.2 Σ_i (x_i − c), all from the values before the exchange."""
    xs = [(1.0, 2.0), (3.0, -1.0), (0.0, 4.0)]

    def main(comm):
        model = vector(1.0, 1.0)
        rule = build(comm, EASGDConfig(beta=0.6, tau=2), model)
        assert rule.alpha == pytest.approx(0.2)
        model.weight.data.copy_(torch.tensor([xs[comm.rank]], dtype=DT))
        rule.after_step(0)
        assert torch.equal(params(model), torch.tensor(xs[comm.rank], dtype=DT)), "exchanged before tau steps"
        rule.after_step(1)
        return params(model), rule.center.buffers[0].clone()

    expected_x = [(1.0, 1.8), (2.6, -0.6), (0.2, 3.4)]
    for (x, c), want in zip(FakeWorld(3).run(main), expected_x, strict=True):
        assert_close(x, torch.tensor(want, dtype=DT))
        assert_close(c, torch.tensor([1.2, 1.4], dtype=DT))


def test_easgd_sync_conserves_workers_plus_center_and_converges():
    """Each exchange moves d_i from x_i to the center, so Σ_i x_i + c is invariant; with lr = 0 the
    workers and the center all converge to (Σ_i x_i + c) / (N + 1) (rates 0.7 and |1 − 4·0.3| = 0.2)."""

    def main(comm):
        model = mlp(seed=comm.rank)  # different starting points; the center starts at rank 0's
        optimizer = sgd(model, lr=0.0)
        rule = build(comm, EASGDConfig(alpha=0.3, tau=1), model, optimizer)
        seen = []

        def record(step, stage):
            if stage == "synced":
                seen.append((params(model), rule.center.buffers[0].clone()))

        fit(rule, model, optimizer, [batch(B, 0)] * 60, record)
        return seen

    ranks = FakeWorld(N).run(main)
    total = sum(params(mlp(seed=r)) for r in range(N)) + params(mlp(seed=0))
    for step in range(60):
        assert_close(sum(r[step][0] for r in ranks) + ranks[0][step][1], total, atol=1e-11)
    for r in ranks:
        assert_close(r[-1][0], total / (N + 1), atol=1e-8)
        assert_close(r[-1][1], total / (N + 1), atol=1e-8)


def test_easgd_alpha_from_beta_counts_workers_not_servers():
    def alphas(n, cfg):
        return FakeWorld(n).run(lambda comm: build(comm, cfg, mlp()).alpha)

    assert alphas(3, EASGDConfig(beta=0.9)) == pytest.approx([0.3] * 3)
    assert alphas(3, EASGDConfig()) == pytest.approx([0.3] * 3)  # the paper's beta = 0.9
    assert alphas(3, EASGDConfig(alpha=0.1)) == pytest.approx([0.1] * 3)
    assert alphas(4, EASGDConfig(beta=0.9, variant="async", tau=1))[:3] == pytest.approx([0.3] * 3)
    with pytest.raises(ValueError, match="diverge"):
        EASGDConfig(alpha=0.5).check_devices(4)  # beta = 2
    EASGDConfig(alpha=0.5, variant="async").check_devices(4)


def async_easgd(world, cfg, script):
    """Workers run ``script(workers, rule, model)``, evaluate and finish; the server serves. Per rank:
    (rule, its parameters, its center, final_metrics)."""

    def main(comm):
        model = vector(0.0, 0.0)
        rule = build(comm, cfg, model)
        if rule.is_server:
            rule.serve()
        else:
            script(rule.workers, rule, model)
            rule.eval_models()
            rule.finish()
        return rule, params(model), rule.center.buffers[0].clone(), rule.final_metrics()

    return world.run(main)


def test_easgd_async_exchanges_in_arrival_order_by_hand():
    """alpha = 0.5, center (0, 0); worker 0 at (2, 4) exchanges first, then worker 1 at (4, 0):
    x_0 = (1, 2), c = (1, 2); then x_1 = (4, 0) − 0.5·(3, −2) = (2.5, 1), c = (2.5, 1)."""

    def script(workers, rule, model):
        start = [(2.0, 4.0), (4.0, 0.0)][workers.rank]
        model.weight.data.copy_(torch.tensor([start], dtype=DT))
        for turn in range(2):
            if turn == workers.rank:
                rule.exchange()
            workers.barrier()

    ranks = async_easgd(FakeWorld(3), EASGDConfig(alpha=0.5, variant="async"), script)
    assert_close(ranks[0][1], torch.tensor([1.0, 2.0], dtype=DT))
    assert_close(ranks[1][1], torch.tensor([2.5, 1.0], dtype=DT))
    for _, _, center, _ in ranks:  # the server's center, and the one workers fetched from it
        assert_close(center, torch.tensor([2.5, 1.0], dtype=DT))


@pytest.mark.parametrize("sync_sends", [False, True])
def test_easgd_async_serves_every_exchange(sync_sends):
    """3 workers of 6, 8, 10 steps with tau = 2: 3 + 4 + 5 exchanges, all served; at the end every
    worker's center is the server's."""

    def script(workers, rule, model):
        for step in range(6 + 2 * workers.rank):
            model.weight.data.add_(float(workers.rank + 1))  # a local step that moves x_i
            rule.after_step(step)

    ranks = async_easgd(
        FakeWorld(4, sync_sends=sync_sends), EASGDConfig(alpha=0.3, tau=2, variant="async"), script
    )
    assert [r[0].exchanges for r in ranks[:3]] == [3, 4, 5]
    assert ranks[3][0].served == 12
    assert all(r[3]["server_exchanges"] == 12 for r in ranks)
    for r in ranks[:3]:
        assert torch.equal(r[2], ranks[3][2])
    assert ranks[3][2].abs().max() > 0.5, "the center did not move"


def test_easgd_async_with_one_worker_equals_sync():
    batches = [batch(B, seed=s) for s in range(7)]

    def run(variant, n):
        def main(comm):
            model = mlp()
            optimizer = sgd(model, momentum=0.9)
            rule = build(comm, EASGDConfig(alpha=0.3, tau=2, variant=variant), model, optimizer)
            if rule.is_server:
                return rule.serve()
            fit(rule, model, optimizer, batches)
            center = params(rule.eval_models()[""])
            rule.finish()
            return params(model), center, rule.exchanges

        return FakeWorld(n).run(main)[0]

    sync, async_ = run("sync", 1), run("async", 2)
    assert sync[2] == async_[2] == 3
    assert (sync[0] - sync[1]).abs().max() > 1e-3, "worker and center coincide: the test would prove nothing"
    assert_close(async_[0], sync[0])
    assert_close(async_[1], sync[1])


# -- mpirun jobs ------------------------------------------------------------------------------------------
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


@pytest.mark.slow
@pytest.mark.mpi
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
        assert_params_close(params_of(run.dir / f"model.rank{r}.pt"), expected, atol=1e-6)
    assert_params_close(params_of(run.dir / "model.pt"), center, atol=1e-6)
    if alpha * devices == 1:
        mean = {k: sum(xi[k] for xi in x) / devices for k in x[0]}
        assert_params_close(params_of(run.dir / "model.pt"), mean, atol=1e-6)
    assert run.summary["exchanges_per_worker"] == 1


@pytest.mark.slow
@pytest.mark.mpi
def test_beta_sets_alpha_to_beta_over_n(cli):
    overrides = [*ONE_EXCHANGE, "devices=2", "rule.beta=1.0"]
    run = cli(*overrides)
    assert run.returncode == 0, run.output
    x = [flat_init(overrides, r) for r in range(2)]
    assert_params_close(
        params_of(run.dir / "model.pt"), {k: (x[0][k] + x[1][k]) / 2 for k in x[0]}, atol=1e-6
    )


@pytest.mark.slow
@pytest.mark.mpi
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
    assert_params_close(params_of(asyn.dir / "model.pt"), params_of(sync.dir / "model.pt"), atol=1e-6)
    assert_params_close(
        params_of(asyn.dir / "model.rank0.pt"), params_of(sync.dir / "model.rank0.pt"), atol=1e-6
    )
    moved = params_of(sync.dir / "model.rank0.pt")
    start = {k: v.detach() for k, v in initial_model(overrides).named_parameters()}
    assert max((moved[k] - start[k]).abs().max() for k in moved) > 1e-3


@pytest.mark.slow
@pytest.mark.mpi
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
    assert s["world_size"] == 4 and s["server_exchanges"] == sum(s["worker_exchanges"])
    assert s["assignment"] == "dynamic" and len(s["worker_exchanges"]) == 3
    epoch = run.records("epoch")[-1]
    assert epoch["center_distance"] > 0 and torch.isfinite(torch.tensor(epoch["center_distance"]))
    assert "worker_mean_val_acc" in run.records("val")[-1]
