"""DES-LOC (runner/rules/desloc.py). In process: ranks are threads talking through FakeWorld, models tiny
float64 MLPs, so every average is checked to 1e-12 against Local Adam written by hand (one plain
torch.optim.Adam per rank, the chosen tensors set to the ranks' mean after the chosen steps) and against
BSP's parameter averaging, and the bytes against the formula of the module's docstring. In a real mpirun
job: SGD with moment periods beyond the run follows BSP's parameter averaging."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from runner.rules.base import RuleContext
from runner.rules.bsp import BSPConfig
from runner.rules.desloc import DesLocConfig
from runner.rules.diloco import DiLoCoConfig
from tests.conftest import COMMON, checked_config, initial_model, params_of
from tests.conftest import assert_close as assert_params_close
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import DT, assert_close, batch, build, fit, mlp, params, sgd

N = 3
KINDS = ("x", "u", "v")  # parameters, first moments, second moments
#: The state tensors of each moment, by torch's names (written out here, not taken from the module).
FIRST, SECOND = ("exp_avg", "momentum_buffer"), ("exp_avg_sq", "max_exp_avg_sq")
P = 66  # parameters of mlp()


def with_periods(x: int, u: int, v: int, **kwargs) -> DesLocConfig:
    """The rule with periods K_x, K_u, K_v."""
    return DesLocConfig(param_period=x, momentum_period=u, variance_period=v, **kwargs)


def adam(model: nn.Module, **kwargs) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.02, **kwargs)


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1)


def amsgrad(model: nn.Module) -> torch.optim.Optimizer:
    return adam(model, amsgrad=True)


def sgd_momentum(model: nn.Module) -> torch.optim.Optimizer:
    return sgd(model, lr=0.1, momentum=0.9)


OPTIMIZERS = {"adam": adam, "adamw": adamw, "amsgrad": amsgrad, "sgd": sgd_momentum}


def batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own data, so that the workers drift apart between averages."""
    return [batch(4, seed=100 * rank + s) for s in range(steps)]


def moments(optimizer: torch.optim.Optimizer, names: tuple[str, ...]) -> list[torch.Tensor]:
    """The state tensors called ``names``, in the order of the parameters."""
    states = [optimizer.state.get(p, {}) for p in optimizer.param_groups[0]["params"]]
    return [state[name] for state in states for name in names if name in state]


def state_of(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Parameters, first and second moments, each flat."""
    flat = lambda ts: torch.cat([t.detach().reshape(-1) for t in ts] or [torch.zeros(0, dtype=DT)])  # noqa: E731
    return {
        "x": params(model),
        "u": flat(moments(optimizer, FIRST)).clone(),
        "v": flat(moments(optimizer, SECOND)).clone(),
    }


def run(cfg, make, steps: int, n: int = N, model=mlp):
    """Every rank trains ``steps`` steps; per rank: its state after every optimizer step ("stepped") and
    after the rule's hook ("synced"), the rule, the bytes it sent."""

    def main(comm):
        net = model()
        optimizer = make(net)
        rule = build(comm, cfg, net, optimizer)
        seen = {}
        probe = lambda step, stage: seen.__setitem__((step, stage), state_of(net, optimizer))  # noqa: E731
        fit(rule, net, optimizer, batches(comm.rank, steps), probe)
        return seen, rule, comm.stats.bytes_sent

    return FakeWorld(n).run(main)


@torch.no_grad()
def set_to_mean(tensors: list[torch.Tensor]) -> None:
    """The ranks' copies of one tensor, each set to their mean."""
    mean = sum(t.detach() for t in tensors) / len(tensors)
    for t in tensors:
        t.copy_(mean)


def by_hand(periods, make, steps: int, n: int = N, join: tuple[int, int] | None = None):
    """Local Adam (or SGD) by hand: one model and plain optimizer per rank, stepped in turn; after step t
    (1-based) each kind whose period divides t is set to the ranks' mean. ``join=(at, k)``: after step
    ``at``, k new ranks start as copies of rank 0. Per step, every rank's state."""
    models = [mlp() for _ in range(n)]
    optimizers = [make(m) for m in models]
    data = [batches(r, steps) for r in range(n + (join[1] if join else 0))]
    out = []
    for s in range(steps):
        for r, (m, o) in enumerate(zip(models, optimizers, strict=True)):
            x, y = data[r][s]
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
        kinds = {
            "x": [list(m.parameters()) for m in models],
            "u": [moments(o, FIRST) for o in optimizers],
            "v": [moments(o, SECOND) for o in optimizers],
        }
        for kind, period in zip(KINDS, periods, strict=True):
            if (s + 1) % period == 0:
                for copies in zip(*kinds[kind], strict=True):
                    set_to_mean(list(copies))
        out.append([state_of(m, o) for m, o in zip(models, optimizers, strict=True)])
        if join and s + 1 == join[0]:
            for _ in range(join[1]):
                models.append(copy.deepcopy(models[0]))
                optimizers.append(make(models[-1]))
                optimizers[-1].load_state_dict(copy.deepcopy(optimizers[0].state_dict()))
    return out


def differ(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a - b).abs().max().item() > 1e-6


@pytest.mark.parametrize("optim", ["adam", "adamw", "amsgrad"])
@pytest.mark.parametrize("k", [1, 3])
def test_equal_periods_are_local_adam_by_hand(optim, k):
    """K_x = K_u = K_v = K: Local Adam, every rank's parameters and moments after every step as the hand
    computation's (amsgrad: its running maximum is averaged with the second moment)."""
    steps = 4 * k
    ranks = run(with_periods(k, k, k), OPTIMIZERS[optim], steps)
    expected = by_hand((k, k, k), OPTIMIZERS[optim], steps)
    for r, (seen, rule, _) in enumerate(ranks):
        for s in range(steps):
            for kind in KINDS:
                assert_close(seen[s, "synced"][kind], expected[s][r][kind])
        assert rule.metrics() == {"param_syncs": 4, "momentum_syncs": 4, "variance_syncs": 4}
    if optim == "amsgrad":
        assert ranks[0][0][0, "synced"]["v"].numel() == 2 * P, "the maximum is averaged too"
    assert differ(expected[-1][0]["x"], params(mlp())), "the parameters did not move"
    if k > 1:
        assert differ(ranks[0][0][k - 2, "synced"]["x"], ranks[1][0][k - 2, "synced"]["x"]), "mid-period"


@pytest.mark.parametrize("periods", [(2, 3, 4), (1, 2, 5), (2, 2, 6)])
def test_each_kind_is_averaged_on_its_own_period_and_the_others_stay_the_workers_own(periods):
    """With distinct periods: after step t exactly the kinds whose period divides t are the ranks' mean of
    what the optimizer left (bit for bit the same on every rank); the others are untouched, and differ
    between ranks. The whole trajectory is the hand computation's."""
    steps = 12
    ranks = run(with_periods(*periods), adam, steps)
    expected = by_hand(periods, adam, steps)
    for s in range(steps):
        for kind, period in zip(KINDS, periods, strict=True):
            stepped = [seen[s, "stepped"][kind] for seen, _, _ in ranks]
            synced = [seen[s, "synced"][kind] for seen, _, _ in ranks]
            if (s + 1) % period == 0:
                assert all(torch.equal(x, synced[0]) for x in synced), (s, kind)
                assert_close(synced[0], sum(stepped) / N)
            else:
                assert all(torch.equal(a, b) for a, b in zip(stepped, synced, strict=True)), (s, kind)
                assert differ(synced[0], synced[1]), f"step {s + 1}: {kind} is the same on every rank"
            for r in range(N):
                assert_close(synced[r], expected[s][r][kind])
    x, u, v = (steps // k for k in periods)
    assert ranks[0][1].metrics() == {"param_syncs": x, "momentum_syncs": u, "variance_syncs": v}


@pytest.mark.parametrize("momentum_period", [1, 3])
def test_sgd_with_param_period_1_is_bsp_every_step(momentum_period):
    """SGD with momentum and K_x = 1: the parameters follow BSP's parameter averaging every step and BSP's
    gradient averaging (x − lr·mean(b_i) is linear in the buffers, so averaging them or not leaves the mean
    buffer, and the parameters, where they are; not bit for bit: the rounding of the means differs)."""
    steps = 9
    desloc = run(with_periods(1, momentum_period, 9), sgd_momentum, steps)
    params_mode = run(BSPConfig(mode="params", avg_freq=1, overlap="none"), sgd_momentum, steps)
    grads = run(BSPConfig(overlap="none"), sgd_momentum, steps)
    for s in range(steps):
        for d, p, g in zip(desloc, params_mode, grads, strict=True):
            assert_close(d[0][s, "synced"]["x"], p[0][s, "synced"]["x"])
            assert_close(d[0][s, "synced"]["x"], g[0][s, "synced"]["x"])
        if (s + 1) % momentum_period == 0:  # the averaged buffer is the mean of BSP's local ones
            mean = sum(p[0][s, "synced"]["u"] for p in params_mode) / N
            assert_close(desloc[0][0][s, "synced"]["u"], mean)
    assert differ(desloc[0][0][0, "stepped"]["u"], desloc[1][0][0, "stepped"]["u"])
    assert differ(params_mode[0][0][steps - 1, "synced"]["x"], params(mlp())), "BSP did not move"


def test_sgd_with_moment_periods_beyond_the_run_is_bsp_params_averaging_bit_for_bit():
    """K_u, K_v longer than the run: local SGD with momentum, the buffers each worker's own, as
    ``rule=bsp rule.mode=params rule.avg_freq=K_x``, to the last bit (the same all-reduce and scaling)."""
    steps = 9
    desloc = run(with_periods(3, 100, 100), sgd_momentum, steps)
    bsp = run(BSPConfig(mode="params", avg_freq=3, overlap="none"), sgd_momentum, steps)
    for d, b in zip(desloc, bsp, strict=True):
        for s in range(steps):
            assert torch.equal(d[0][s, "synced"]["x"], b[0][s, "synced"]["x"]), s
            assert torch.equal(d[0][s, "synced"]["u"], b[0][s, "synced"]["u"]), s
    assert differ(desloc[0][0][steps - 1, "synced"]["u"], desloc[1][0][steps - 1, "synced"]["u"])


def allreduce_bytes(values: int, itemsize: int = 8) -> float:
    """What one rank sends in an all-reduce of ``values`` numbers of ``itemsize`` bytes over N ranks."""
    return 2 * (N - 1) / N * values * itemsize


@pytest.mark.parametrize(
    "optim, comm_dtype, second",
    [("adam", "fp32", 1), ("amsgrad", "fp32", 2), ("sgd", "fp32", 0), ("adam", "bf16", 1)],
)
def test_bytes_are_the_parameters_over_k_x_and_the_moments_over_k_u_and_k_v(optim, comm_dtype, second):
    """Rank 1 (not the root of the model's broadcast at build) sends one all-reduce of the parameters per
    K_x steps, of the first moments per K_u, of the second per K_v (amsgrad: two tensors a parameter; SGD:
    none); bf16 halves the parameters' bytes (a quarter of float64's here), not the moments'."""
    periods, steps = (2, 3, 4), 12
    [_, (_, _, sent), _] = run(with_periods(*periods, comm_dtype=comm_dtype), OPTIMIZERS[optim], steps)
    x, u, v = (steps // k for k in periods)
    wire = 2 if comm_dtype == "bf16" else 8
    assert sent == x * allreduce_bytes(P, wire) + u * allreduce_bytes(P) + v * second * allreduce_bytes(P)


def test_defaults_send_one_and_a_half_times_diloco_and_half_of_local_adam():
    """The default periods 10, 30, 60 with Adam over 60 steps: 6 + 2 + 1 all-reduces of the model, where
    DiLoCo at H = 10 sends 6 and Local Adam at K = 10 (all state every 10 steps) 18."""
    steps = 60

    def sent(cfg):
        return run(cfg, adam, steps)[1][2]  # rank 1's

    desloc = sent(DesLocConfig())
    assert desloc == 9 * allreduce_bytes(P)
    assert desloc / sent(DiLoCoConfig(inner_steps=10)) == 1.5
    assert desloc / sent(with_periods(10, 10, 10)) == 0.5


def test_one_worker_is_plain_adam_and_sends_nothing():
    [(seen, rule, sent)] = run(with_periods(2, 3, 4), adam, 8, n=1)
    expected = by_hand((100, 100, 100), adam, 8, n=1)  # no average: plain Adam
    for kind in KINDS:
        assert torch.equal(seen[7, "synced"][kind], expected[7][0][kind])
    assert sent == 0 and rule.eval_models()[""] is rule.model


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).to(DT)


def test_batchnorm_statistics_are_averaged_with_the_parameters():
    def main(comm):
        model = bn_model()
        optimizer = adam(model)
        rule = build(comm, with_periods(2, 3, 4), model, optimizer)
        out = []

        def probe(step, stage):
            out.append([model[1].running_mean.clone(), model[1].running_var.clone()])

        fit(rule, model, optimizer, batches(comm.rank, 6), probe)
        return out

    ranks = FakeWorld(N).run(main)
    for s in range(6):
        for i in range(2):
            stepped = [r[2 * s][i] for r in ranks]
            synced = [r[2 * s + 1][i] for r in ranks]
            if (s + 1) % 2:
                assert all(torch.equal(a, b) for a, b in zip(stepped, synced, strict=True))
                assert differ(synced[0], synced[1])
            else:
                assert all(torch.equal(x, synced[0]) for x in synced)
                assert_close(synced[0], sum(stepped) / N)


def test_mid_period_validation_reports_the_mean_in_a_copy():
    """Mid-period eval_models gives a copy set to the workers' mean parameters and BatchNorm statistics and
    leaves every worker's model as it was; where the parameters were just averaged, the model itself."""

    def main(comm):
        model = bn_model()
        optimizer = adam(model)
        rule = build(comm, with_periods(4, 4, 8), model, optimizer)
        fit(rule, model, optimizer, batches(comm.rank, 6))
        before, stats = params(model), model[1].running_mean.clone()
        mid = rule.eval_models()[""]
        assert mid is not model and torch.equal(params(model), before)
        reported = params(mid), mid[1].running_mean.clone()
        fit(rule, model, optimizer, batches(comm.rank, 2))  # local steps 7 and 8: an average
        return before, stats, reported, rule.eval_models()[""] is model

    ranks = FakeWorld(N).run(main)
    assert differ(ranks[0][0], ranks[1][0])
    for _, _, (x, stats), boundary_is_model in ranks:
        assert_close(x, sum(r[0] for r in ranks) / N)
        assert_close(stats, sum(r[1] for r in ranks) / N)
        assert boundary_is_model


def snapshot(model: nn.Module, optimizer: torch.optim.Optimizer, rule) -> dict:
    """A copy of what a checkpoint (or a joining worker) takes of a worker."""
    return copy.deepcopy(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rule": rule.state_dict()}
    )


def train_with_cut(cfg, start=None, cut: int = 5, steps: int = 10):
    """Every rank trains ``steps`` steps with Adam (from ``start``, the states saved after ``cut``); with
    no start, also its model, optimizer and rule states after ``cut`` steps, as the worker saves them."""

    def main(comm):
        model = mlp(seed=comm.rank + 1 if start else 0)  # a resume starts from other models: all replaced
        optimizer = adam(model)
        rule = build(comm, cfg, model, optimizer)
        saved, first = {}, 0
        if start:
            mine = start[comm.rank]
            rule.load_state_dict(mine["rule"])
            model.load_state_dict(mine["model"])
            optimizer.load_state_dict(mine["optimizer"])
            first = cut
        for step, (x, y) in enumerate(batches(comm.rank, steps)[first:], start=first):
            fit(rule, model, optimizer, [(x, y)])
            if start is None and step + 1 == cut:
                rule.before_checkpoint(cut)
                saved = snapshot(model, optimizer, rule)
        return state_of(model, optimizer), saved, rule.state_dict()

    return FakeWorld(N).run(main)


def test_checkpoint_mid_period_resumes_exactly():
    """Saved after step 5 of periods 2, 3, 4 (mid-period for every kind) and resumed: every rank ends where
    the uninterrupted run did, bit for bit, its moments and counts included."""
    cfg = with_periods(2, 3, 4)
    whole = train_with_cut(cfg)
    assert all(s["rule"] == {"local_steps": 5, "syncs": [2, 1, 1]} for _, s, _ in whole)
    resumed = train_with_cut(cfg, start=[s for _, s, _ in whole])
    for (end, _, rule), (end_resumed, _, rule_resumed) in zip(whole, resumed, strict=True):
        assert all(torch.equal(end[k], end_resumed[k]) for k in KINDS)
        assert rule == rule_resumed == {"local_steps": 10, "syncs": [5, 3, 2]}


def test_recover_averages_every_kind_over_the_survivors_and_takes_worker_0s_count():
    """After a loss the survivors' states may differ (an average completed on some of them only): all take
    the mean of parameters, statistics and moments over themselves, and worker 0's counts."""

    def main(comm):
        model = bn_model()
        optimizer = adam(model)
        rule = build(comm, with_periods(2, 3, 4), model, optimizer)
        fit(rule, model, optimizer, batches(comm.rank, 1))
        rule.local_steps, rule.syncs = 7 + comm.rank, [3 + comm.rank, 2, 1]
        before = state_of(model, optimizer), model[1].running_var.clone()
        rule.recover()
        return before, (state_of(model, optimizer), model[1].running_var.clone()), rule

    ranks = FakeWorld(N).run(main)
    for _, (state, stats), rule in ranks:
        for kind in KINDS:
            assert_close(state[kind], sum(r[0][0][kind] for r in ranks) / N)
        assert_close(stats, sum(r[0][1] for r in ranks) / N)
        assert (rule.local_steps, rule.syncs) == (7, [3, 2, 1])
    assert differ(ranks[0][0][0]["u"], ranks[1][0][0]["u"]), "the moments differed before"


def test_joined_workers_take_worker_0s_state_and_the_averages_go_over_all():
    """2 workers train 4 steps (periods 2, 6, 6: ready to grow after each even step, not after odd ones;
    their moments still their own at the join), 2 more join with worker 0's model, optimizer and counts,
    and the 4 train on: every state as the hand computation in which ranks 2 and 3 start as copies of
    rank 0."""
    cfg, at, steps = with_periods(2, 6, 6), 4, 10

    def phase1(comm):
        model = mlp()
        optimizer = adam(model)
        rule = build(comm, cfg, model, optimizer)
        ready = []
        for xy in batches(comm.rank, at):
            fit(rule, model, optimizer, [xy])
            ready.append(rule.ready_to_grow)
        assert ready == [s % 2 == 1 for s in range(at)]
        return snapshot(model, optimizer, rule)

    states = FakeWorld(2).run(phase1)

    def phase2(comm):
        joined = comm.rank >= 2
        model = mlp(seed=5)
        optimizer = adam(model)
        # (the 2 first workers keep their rule objects in a job; here built anew, without a collective)
        rule = cfg.build(RuleContext(comm, comm, model, optimizer, joined=True))
        mine = copy.deepcopy(states[0 if joined else comm.rank])  # (load_state_dict keeps the tensors)
        model.load_state_dict(mine["model"])
        optimizer.load_state_dict(mine["optimizer"])
        rule.load_state_dict(mine["rule"])
        rule.grow(joined)
        seen = {}
        probe = lambda step, stage: seen.__setitem__((step, stage), state_of(model, optimizer))  # noqa: E731
        fit(rule, model, optimizer, batches(comm.rank, steps)[at:], probe)
        return seen, rule

    ranks = FakeWorld(4).run(phase2)
    expected = by_hand(cfg_periods(cfg), adam, steps, n=2, join=(at, 2))
    for r, (seen, rule) in enumerate(ranks):
        for s in range(steps - at):
            for kind in KINDS:
                assert_close(seen[s, "synced"][kind], expected[at + s][r][kind])
        assert rule.state_dict() == {"local_steps": steps, "syncs": [5, 1, 1]}
    assert differ(ranks[2][0][0, "synced"]["u"], ranks[3][0][0, "synced"]["u"]), "joined ones trained"


def cfg_periods(cfg: DesLocConfig) -> tuple[int, int, int]:
    return cfg.param_period, cfg.momentum_period, cfg.variance_period


def test_an_optimizer_whose_state_it_cannot_name_is_refused_at_build():
    model = mlp()
    with pytest.raises(ValueError, match="RMSprop.*optim=adam, optim=adamw or optim=sgd"):
        build(FakeWorld(1).comms[0], DesLocConfig(), model, torch.optim.RMSprop(model.parameters()))


@pytest.mark.parametrize(
    "overrides, key, hint",
    [
        (["rule.param_period=0"], "rule.param_period", ">= 1"),
        (
            ["rule.param_period=10", "rule.momentum_period=5"],
            "rule.momentum_period",
            ">= rule.param_period=10",
        ),
        (
            ["rule.momentum_period=30", "rule.variance_period=20"],
            "rule.variance_period",
            "momentum_period=30",
        ),
        (["rule.comm_dtype=int8"], "rule.comm_dtype", "fp32, bf16, fp16"),
        (
            ["optim=custom", "optim._target_=torch.optim.RMSprop", "+optim.lr=0.01"],
            "optim._target_",
            "use optim=adam, optim=adamw or optim=sgd",
        ),
    ],
)
def test_bad_values_name_their_key_and_the_fix(overrides, key, hint):
    with pytest.raises(ValueError, match=re.escape(key) + ".*" + re.escape(hint)):
        checked_config(["rule=desloc", *overrides])


@pytest.mark.parametrize(
    "optim",
    [["optim=sgd"], ["optim=adam"], ["optim=adamw"], ["optim=custom", "optim._target_=torch.optim.Adam"]],
)
def test_defaults_validate_with_the_optimizers_it_can_name(optim):
    rule = checked_config(["rule=desloc", "devices=4", *optim]).rule
    assert isinstance(rule, DesLocConfig)
    assert cfg_periods(rule) == (10, 30, 60) and rule.comm_dtype == "fp32"


# -- mpirun jobs ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.mpi
def test_sgd_with_long_moment_periods_follows_bsp_params_averaging_under_mpirun(cli):
    """The in-process bit-for-bit equivalence through the command line: 2 ranks, 6 steps, parameters
    averaged every 3, the momentum never; every rank's model and the reported one as BSP's."""
    overrides = ["model=mlp", "devices=2", "train.batch_size=8", "train.save_model=all", *COMMON]
    periods = ["rule.param_period=3", "rule.momentum_period=100", "rule.variance_period=100"]
    desloc = cli("rule=desloc", *periods, *overrides)
    bsp = cli("rule=bsp", "rule.mode=params", "rule.avg_freq=3", *overrides)
    assert desloc.returncode == 0 and bsp.returncode == 0, desloc.output + bsp.output
    assert desloc.summary["param_syncs"] == 2 and desloc.summary["momentum_syncs"] == 0
    for name in ("model.pt", "model.rank0.pt", "model.rank1.pt"):
        assert_params_close(params_of(desloc.dir / name), params_of(bsp.dir / name), atol=1e-6)
    moved, start = params_of(bsp.dir / "model.pt"), dict(initial_model(overrides).named_parameters())
    assert max((moved[k] - start[k]).abs().max().item() for k in moved) > 1e-3, "BSP did not train"
