"""DiLoCo (runner/rules/diloco.py). In process: ranks are threads talking through FakeWorld, models tiny
float64 MLPs, so the outer step is checked against torch.optim.SGD and a hand computation to 1e-12. In a
real mpirun job: the local SGD settings follow BSP's parameter averaging."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from runner.rules.bsp import BSPConfig
from runner.rules.diloco import DiLoCoConfig
from tests.conftest import COMMON, checked_config, initial_model, params_of
from tests.conftest import assert_close as assert_params_close
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import DT, assert_close, batch, build, fit, mlp, params, plain, sgd
from tests.rank.test_checkpoint import CUT, _tensors, train

N, H, ROUNDS = 3, 3, 3
LOCAL_SGD = DiLoCoConfig(inner_steps=H, outer_lr=1.0, outer_momentum=0.0, nesterov=False)


def batches(rank: int, steps: int = H * ROUNDS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own data, so that the workers drift apart within a round."""
    return [batch(4, seed=100 * rank + s) for s in range(steps)]


def run(cfg, n: int = N):
    """Every rank trains H·ROUNDS steps (inner SGD with momentum 0.9); per rank: the parameters after every
    optimizer step ("stepped") and after the rule's hook ("synced"), the momentum buffers, the rule."""

    def main(comm):
        model = mlp()
        optimizer = sgd(model, lr=0.1, momentum=0.9)
        rule = build(comm, cfg, model, optimizer)
        seen: dict = {}

        def record(step, stage):
            seen[step, stage] = params(model)
            if stage == "synced" and hasattr(rule, "momentum"):
                seen[step, "momentum"] = torch.cat([b.clone() for b in rule.momentum] or [torch.zeros(0)])

        fit(rule, model, optimizer, batches(comm.rank), record)
        return seen, rule

    return FakeWorld(n).run(main)


def outer_by_hand(ranks, cfg, steps: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """x_start, the momentum buffer and Δ of each outer step, from the workers' local end points of each
    round (their parameters after the round's last optimizer step), by the formula in float64."""
    start, buf = params(mlp()), torch.zeros_like(params(mlp()))
    mu, out = cfg.outer_momentum, []
    for last in range(cfg.inner_steps - 1, steps, cfg.inner_steps):
        delta = start - sum(r[0][last, "stepped"] for r in ranks) / len(ranks)
        buf = mu * buf + delta
        step = delta + mu * buf if cfg.nesterov else buf
        start = start - cfg.outer_lr * step
        out.append((start, buf, delta))
    return out


def test_outer_lr_1_without_momentum_is_bsp_params_averaging():
    """Local SGD: DiLoCo with outer lr 1 and no momentum ends each round at the workers' mean, so it follows
    BSP mode=params avg_freq=H. Not bit for bit: x_start − (x_start − mean) rounds differently from the
    mean (a few float64 ulps: 1.7e-16 here), hence the tolerance 1e-12."""
    diloco = run(LOCAL_SGD)
    bsp = run(BSPConfig(mode="params", avg_freq=H, overlap="none"))
    last = H * ROUNDS - 1
    assert (bsp[0][0][last, "synced"] - params(mlp())).abs().max() > 1e-2, "BSP did not move"
    for (d, _), (b, _) in zip(diloco, bsp, strict=True):
        for step in range(H * ROUNDS):
            assert_close(d[step, "synced"], b[step, "synced"])


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_and_momentum_buffer_by_hand(nesterov):
    """Three rounds with outer lr 0.7, momentum 0.9: after each round every worker holds x_start and the
    momentum buffer of the formula; within a round the rule changes nothing."""
    cfg = DiLoCoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.9, nesterov=nesterov)
    ranks = run(cfg)
    expected = outer_by_hand(ranks, cfg, H * ROUNDS)
    for r, (seen, rule) in enumerate(ranks):
        for step in range(H * ROUNDS):
            if (step + 1) % H:
                assert torch.equal(seen[step, "synced"], seen[step, "stepped"]), (r, step)
                continue
            start, buf, _ = expected[step // H]
            assert_close(seen[step, "synced"], start)
            assert_close(seen[step, "momentum"], buf)
        assert rule.outer_steps == ROUNDS and rule.round_step == 0
        assert rule.metrics() == pytest.approx(
            {"outer_steps": ROUNDS, "pseudo_grad_norm": float(expected[-1][2].norm())}, abs=1e-12
        )
        assert torch.equal(torch.cat(rule.start), ranks[0][0][H * ROUNDS - 1, "synced"])
    assert (expected[0][0] - expected[1][0]).abs().max() > 1e-2, "x_start did not move"


def test_outer_step_is_torch_sgd_on_the_pseudo_gradient():
    """The same outer step as torch.optim.SGD(nesterov=True) given Δ as the gradient of x_start."""
    cfg = DiLoCoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.9)
    ranks = run(cfg)
    start = params(mlp()).requires_grad_(True)
    outer = torch.optim.SGD([start], lr=0.7, momentum=0.9, nesterov=True)
    for last in range(H - 1, H * ROUNDS, H):
        start.grad = start.detach() - sum(r[0][last, "stepped"] for r in ranks) / N
        outer.step()
        assert_close(ranks[1][0][last, "synced"], start.detach())
        assert_close(ranks[1][0][last, "momentum"], outer.state[start]["momentum_buffer"])


def test_workers_are_identical_after_every_outer_step_batchnorm_included():
    """Ranks train on different data, so their parameters and BatchNorm statistics differ mid-round; after
    every outer step they are bit for bit equal, the statistics the workers' mean."""

    def bn_model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).to(DT)

    def main(comm):
        model = bn_model()
        optimizer = sgd(model, momentum=0.9)
        rule = build(comm, DiLoCoConfig(inner_steps=2), model, optimizer)
        out = []
        for step, (x, y) in enumerate(batches(comm.rank, 6)):
            optimizer.zero_grad()
            (F.cross_entropy(model(x), y) * rule.loss_scale).backward()
            optimizer.step()
            stats = [model[1].running_mean.clone(), model[1].running_var.clone()]
            rule.after_step(step)
            out.append((params(model), stats, [model[1].running_mean.clone(), model[1].running_var.clone()]))
        return out

    ranks = FakeWorld(N).run(main)
    for step in range(6):
        synced = [r[step][0] for r in ranks]
        if step % 2 == 0:
            assert (synced[0] - synced[1]).abs().max() > 1e-4, f"step {step}: synced off schedule"
            continue
        assert all(torch.equal(s, synced[0]) for s in synced), f"step {step}"
        for i in range(2):
            assert all(torch.equal(r[step][2][i], ranks[0][step][2][i]) for r in ranks)
            assert_close(ranks[0][step][2][i], sum(r[step][1][i] for r in ranks) / N)


def test_one_worker_applies_the_outer_step_to_its_own_progress():
    """N = 1: plain training for H steps, then the outer step with Δ = x_start − x_1; nothing is sent."""
    cfg = DiLoCoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.9)
    world = FakeWorld(1)

    def main(comm):
        model = mlp()
        optimizer = sgd(model, lr=0.1, momentum=0.9)
        rule = build(comm, cfg, model, optimizer)
        seen = {}
        fit(rule, model, optimizer, batches(0), lambda s, stage: seen.__setitem__((s, stage), params(model)))
        return seen, rule.eval_models()[""] is model, comm.stats.bytes_sent

    seen, reports_itself, sent = world.run(main)[0]
    expected = outer_by_hand([(seen,)], cfg, H * ROUNDS)
    for last, (start, _, _) in zip(range(H - 1, H * ROUNDS, H), expected, strict=True):
        assert_close(seen[last, "synced"], start)
    assert reports_itself and sent == 0 and world.messages == 0


def test_one_worker_local_sgd_settings_are_plain_training():
    [(seen, _)] = run(LOCAL_SGD, n=1)
    ref = plain(mlp(), batches(0), lr=0.1, momentum=0.9)
    assert_close(seen[H * ROUNDS - 1, "synced"], ref)


def test_mid_round_validation_reports_the_mean_in_a_copy():
    """Mid-round eval_models gives a copy set to the workers' mean and leaves every worker's model as it was
    (training goes on undisturbed); at a round boundary it gives the workers' model itself."""

    def main(comm):
        model = mlp()
        optimizer = sgd(model, momentum=0.9)
        rule = build(comm, DiLoCoConfig(inner_steps=4), model, optimizer)
        fit(rule, model, optimizer, batches(comm.rank, 6))
        before = params(model)
        mid = rule.eval_models()[""]
        assert mid is not model and torch.equal(params(model), before)
        fit(rule, model, optimizer, batches(comm.rank, 2))  # steps 7 and 8: the end of round 2
        return before, params(mid), rule.eval_models()[""] is model

    ranks = FakeWorld(N).run(main)
    mean = sum(r[0] for r in ranks) / N
    assert (ranks[0][0] - ranks[1][0]).abs().max() > 1e-4
    for _, reported, boundary_is_model in ranks:
        assert_close(reported, mean)
        assert boundary_is_model


def test_checkpoint_mid_round_resumes_exactly():
    """Saved after step CUT = 3 of rounds of 2 steps (mid-round) and resumed: every rank ends where the
    uninterrupted run did, x_start and the momentum buffer included (tests/rank/test_checkpoint.py's harness;
    its ranks start from different models, which DiLoCo replaces with worker 0's at build)."""
    cfg = DiLoCoConfig(inner_steps=2, outer_lr=0.7, outer_momentum=0.9)
    whole = train(FakeWorld(N), cfg, cut=CUT)
    saved = [_tensors(s) for _, s, _ in whole]
    assert all(s["rule"]["round_step"] == 1 for s in saved), "the cut is not mid-round"
    resumed = train(FakeWorld(N), cfg, start=saved)
    for rank, ((p_whole, _, s_whole), (p_resumed, _, s_resumed)) in enumerate(
        zip(whole, resumed, strict=True)
    ):
        assert torch.equal(p_whole, p_resumed), f"rank {rank}: parameters differ"
        for key in ("start", "momentum"):
            assert all(torch.equal(a, b) for a, b in zip(s_whole[key], s_resumed[key], strict=True)), key
        for state in (s_whole, s_resumed):
            assert (state["round_step"], state["outer_steps"]) == (0, 4)


def test_recover_restarts_the_round_from_worker_0s_state():
    """After a loss mid-round the survivors' round states may differ (an outer step completed on some only):
    all take worker 0's x_start, buffer and count, parameters = x_start, BatchNorm statistics averaged."""

    def main(comm):
        model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)).to(DT)
        rule = build(comm, DiLoCoConfig(inner_steps=5), model, sgd(model))
        with torch.no_grad():
            model[1].running_mean.fill_(float(comm.rank))
            for t in [*rule.flat.buffers, *rule.start, *rule.momentum]:
                t.add_(comm.rank + 1.0)
        rule.round_step, rule.outer_steps = 2 + comm.rank, 7 + comm.rank
        rule.recover()
        return params(model), torch.cat(rule.start), torch.cat(rule.momentum), rule, model[1].running_mean

    ranks = FakeWorld(N).run(main)
    x0 = ranks[0][1]
    for x, start, buf, rule, stats in ranks:
        assert torch.equal(x, x0) and torch.equal(start, x0) and torch.equal(buf, torch.ones_like(buf))
        assert (rule.round_step, rule.outer_steps) == (0, 7)
        assert torch.equal(stats, torch.ones(4, dtype=DT))


def test_recover_after_a_broken_exchange_takes_the_outer_step_over_the_survivors():
    """Every survivor had finished the round (round_step = H: the loss broke the exchange): the round ends
    with the outer step over the survivors' end points instead of being thrown away."""
    cfg = DiLoCoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.9)

    def main(comm):
        model = mlp()
        rule = build(comm, cfg, model, sgd(model))
        with torch.no_grad():
            rule.flat.buffers[0].add_(0.1 * (comm.rank + 1))
        local = params(model)
        rule.round_step = H
        rule.recover()
        return local, params(model), rule

    ranks = FakeWorld(N).run(main)
    [(start, _, _)] = outer_by_hand([({(H - 1, "stepped"): r[0]},) for r in ranks], cfg, H)
    for _, x, rule in ranks:
        assert_close(x, start)
        assert (rule.round_step, rule.outer_steps) == (0, 1)


@pytest.mark.parametrize(
    "overrides, key, hint",
    [
        (["rule.inner_steps=0"], "rule.inner_steps", ">= 1"),
        (["rule.outer_lr=0"], "rule.outer_lr", "> 0"),
        (["rule.outer_momentum=1"], "rule.outer_momentum", "[0, 1)"),
        (["rule.outer_momentum=-0.1"], "rule.outer_momentum", "[0, 1)"),
        (["rule.outer_momentum=0"], "rule.outer_momentum", "rule.nesterov=false"),
    ],
)
def test_bad_values_name_their_key_and_the_fix(overrides, key, hint):
    with pytest.raises(ValueError, match=re.escape(key) + ".*" + re.escape(hint)):
        checked_config(["rule=diloco", *overrides])


def test_defaults_and_local_sgd_settings_validate():
    rule = checked_config(["rule=diloco", "devices=4"]).rule
    assert isinstance(rule, DiLoCoConfig)
    assert (rule.inner_steps, rule.outer_lr, rule.outer_momentum, rule.nesterov) == (10, 0.7, 0.5, True)
    local = checked_config(["rule=diloco", "rule.outer_lr=1", "rule.outer_momentum=0", "rule.nesterov=false"])
    assert (local.rule.outer_lr, local.rule.outer_momentum, local.rule.nesterov) == (1.0, 0.0, False)


# -- mpirun jobs ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.mpi
def test_local_sgd_settings_follow_bsp_params_averaging_under_mpirun(cli):
    """The in-process test_outer_lr_1_without_momentum_is_bsp_params_averaging through the command line:
    2 ranks, 6 steps in rounds of 3, every rank's model and the reported one as BSP's (float32 rounding)."""
    overrides = ["model=mlp", "devices=2", "train.batch_size=8", "train.save_model=all", *COMMON]
    local = ["rule.inner_steps=3", "rule.outer_lr=1", "rule.outer_momentum=0", "rule.nesterov=false"]
    diloco = cli("rule=diloco", *local, *overrides)
    bsp = cli("rule=bsp", "rule.mode=params", "rule.avg_freq=3", *overrides)
    assert diloco.returncode == 0 and bsp.returncode == 0, diloco.output + bsp.output
    assert diloco.summary["outer_steps"] == 2 and diloco.summary["steps"] == 6
    for name in ("model.pt", "model.rank0.pt", "model.rank1.pt"):
        assert_params_close(params_of(diloco.dir / name), params_of(bsp.dir / name), atol=1e-6)
    moved, start = params_of(bsp.dir / "model.pt"), dict(initial_model(overrides).named_parameters())
    assert max((moved[k] - start[k]).abs().max().item() for k in moved) > 1e-3, "BSP did not train"


def test_outer_momentum_warmup_raises_mu_from_zero_by_hand():
    """Warm-up over 2 outer steps to μ = 0.9: the three outer steps take μ = 0, 0.45, 0.9 (Nesterov), the
    buffer following b ← μ_r·b + Δ; without the warm-up the first step already differs."""
    cfg = DiLoCoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.9, outer_momentum_warmup=2)
    ranks = run(cfg)
    start, buf = params(mlp()), torch.zeros_like(params(mlp()))
    for r, last in enumerate(range(H - 1, H * ROUNDS, H)):
        mu = [0.0, 0.45, 0.9][r]
        delta = start - sum(rank[0][last, "stepped"] for rank in ranks) / len(ranks)
        if mu > 0:
            buf = mu * buf + delta
        start = start - 0.7 * (delta + mu * buf if mu > 0 else delta)
        assert_close(ranks[0][0][last, "synced"], start)
    plain_cfg = DiLoCoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.9)
    first = run(plain_cfg)[0][0][H - 1, "synced"]
    assert (first - ranks[0][0][H - 1, "synced"]).abs().max() > 1e-3


def test_outer_momentum_warmup_is_refused_without_momentum_and_by_streaming():
    from runner.rules.streaming_diloco import StreamingDiLoCoConfig

    with pytest.raises(ValueError, match="outer_momentum_warmup"):
        DiLoCoConfig(outer_momentum=0.0, nesterov=False, outer_momentum_warmup=3)
    with pytest.raises(ValueError, match="outer_momentum_warmup"):
        StreamingDiLoCoConfig(outer_momentum_warmup=3)
    with pytest.raises(ValueError, match="period_schedule"):
        StreamingDiLoCoConfig(period_schedule="list", period_list=[4])


def test_new_workers_join_only_at_a_round_s_start():
    """``ready_to_grow`` is a property that is false mid-round (it once was a method: always true)."""

    def main(comm):
        model = mlp()
        optimizer = sgd(model)
        rule = build(comm, DiLoCoConfig(inner_steps=2), model, optimizer)
        seen = []
        for step, (x, y) in enumerate(batches(comm.rank, 4)):
            seen.append(rule.ready_to_grow)
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            rule.after_step(step)
        return seen

    assert FakeWorld(2).run(main)[0] == [True, False, True, False]
