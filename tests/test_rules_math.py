"""The rules' update math, rank by rank, in milliseconds: every rank is a thread of this process and talks
through :class:`tests.fakecomm.FakeComm`, whose collectives really combine the ranks' tensors.

Models are tiny float64 MLPs or single weight vectors, so trajectories can be compared to 1e-12 and
exchanges checked against numbers computed by hand. ``fit`` follows ``Trainer.fit``'s hook order.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from runner.rules.asgd import ASGDConfig
from runner.rules.base import RuleContext, split_roles
from runner.rules.bsp import BSPConfig
from runner.rules.easgd import EASGDConfig
from runner.rules.gosgd import GoSGDConfig
from runner.schedule.constant import ConstantConfig
from tests.fakecomm import FakeWorld

DT = torch.float64
_SEEDING = threading.Lock()
ATOL = 1e-12


def mlp(seed: int = 0) -> nn.Module:
    """66 parameters in four tensors (the first, 35 long, straddles ASGD's two-shard boundary at 33).

    Rank threads build models concurrently from torch's one global generator, hence the lock."""
    with _SEEDING:
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(DT)


def vector(*values: float) -> nn.Module:
    """A model whose only parameter is the row vector ``values``, for exchanges computed by hand."""
    model = nn.Linear(len(values), 1, bias=False).to(DT)
    with torch.no_grad():
        model.weight.copy_(torch.tensor([values], dtype=DT))
    return model


def batch(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)


def params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()


def sgd(model: nn.Module, lr: float = 0.1, momentum: float = 0.0) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)


def build(comm, cfg, model, optimizer=None, steps_per_epoch: int = 0):
    """The rule as the worker builds it: roles first (collective), servers without an optimizer."""
    workers = split_roles(comm, cfg.extra_ranks())
    return cfg.build(RuleContext(comm, workers, model, optimizer if workers else None, steps_per_epoch))


def fit(rule, model, optimizer, batches, probe=None) -> None:
    """``Trainer.fit``'s hooks for one step per batch; ``probe(step, stage)`` after the optimizer step
    (stage "stepped") and after ``after_step`` (stage "synced")."""
    for step, (x, y) in enumerate(batches):
        rule.before_step(step)
        optimizer.zero_grad(set_to_none=False)
        (F.cross_entropy(model(x), y) * rule.loss_scale).backward()
        rule.after_backward(step)
        optimizer.step()
        if probe:
            probe(step, "stepped")
        rule.after_step(step)
        if probe:
            probe(step, "synced")


def plain(model: nn.Module, batches, lr: float = 0.1, momentum: float = 0.0) -> torch.Tensor:
    """One process, no rule: the reference trajectory's end point."""
    optimizer = sgd(model, lr, momentum)
    for x, y in batches:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
    return params(model)


def assert_close(a: torch.Tensor, b: torch.Tensor, atol: float = ATOL) -> None:
    diff = (a - b).abs().max().item()
    assert diff <= atol, f"max |diff| {diff:.3g} > {atol}"


# -- the fake communicator itself ------------------------------------------------------------------------
def test_fakecomm_combines_matches_splits_and_accounts():
    def main(comm):
        t = torch.tensor([1.0, -1.0]) * (comm.rank + 1)
        sums, maxs, mins = comm.allreduce(t.clone()), comm.allreduce(t.clone(), "max"), t.clone()
        request = comm.iallreduce(mins, "min")
        root = comm.broadcast(torch.tensor([float(comm.rank)]), root=2)
        sub = comm.split(comm.rank % 2, key=-comm.rank)  # colour 0: ranks 2, 0 in this order
        sub_sum = sub.allreduce(torch.tensor([float(comm.rank)]))
        for tag in (7, 8):
            comm.send(torch.tensor([float(tag)]), (comm.rank + 1) % 3, tag=tag)
        got8, got7 = torch.zeros(1), torch.zeros(1)
        source = comm.recv(got8, tag=8)  # passes over the earlier tag-7 message
        comm.recv(got7, source[0], 7)
        assert comm.iprobe() is None
        request.wait()
        values = comm.allreduce_values([1.0, comm.rank], "max")
        return [x.tolist() for x in (sums, maxs, mins, root, sub_sum, got8, got7)], source, sub.rank, values

    ranks = FakeWorld(3).run(main)
    for rank, (tensors, source, sub_rank, values) in enumerate(ranks):
        assert tensors[:4] == [[6.0, -6.0], [3.0, -1.0], [1.0, -3.0], [2.0]]
        assert tensors[4:] == [[2.0] if rank != 1 else [1.0], [8.0], [7.0]]
        assert source == ((rank - 1) % 3, 8) and sub_rank == {0: 1, 1: 0, 2: 0}[rank] and values == [1.0, 2.0]
    world = FakeWorld(3)
    world.run(main)
    # 3 all-reduces of 8 bytes: 3·int(8·4/3); broadcast at rank 2: 2·4; the colour-0 all-reduce: 4; sends: 8
    assert [c.stats.bytes_sent for c in world.comms] == [30 + 4 + 8, 30 + 8, 30 + 8 + 4 + 8]
    assert world.messages == 6


def test_fakecomm_fails_fast_on_deadlock_and_errors():
    def crossed_sends(comm):
        comm.send(torch.zeros(1), 1 - comm.rank)
        comm.recv(torch.zeros(1))

    FakeWorld(2).run(crossed_sends)  # buffered sends: fine
    with pytest.raises(TimeoutError, match="deadlock"):
        FakeWorld(2, timeout=0.2, sync_sends=True).run(crossed_sends)

    def crash(comm):
        if comm.rank == 0:
            raise KeyError("boom")
        comm.barrier()

    with pytest.raises(KeyError, match="boom"):
        FakeWorld(2, timeout=5).run(crash, timeout=1)


# -- BSP --------------------------------------------------------------------------------------------------
N, B, STEPS = 3, 4, 4
GLOBAL = [batch(N * B, seed=s) for s in range(STEPS)]


def shard(rank: int, size: int = N):
    return [(x[rank::size], y[rank::size]) for x, y in GLOBAL]


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


# -- EASGD ------------------------------------------------------------------------------------------------
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


# -- GoSGD ------------------------------------------------------------------------------------------------
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


# -- ASGD -------------------------------------------------------------------------------------------------
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
