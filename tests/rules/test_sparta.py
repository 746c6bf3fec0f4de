"""SPARTA (runner/rules/sparta.py). In process: ranks are threads talking through FakeWorld, models tiny
float64 MLPs, so the averaging is checked against BSP's parameter averaging and against a hand computation to
1e-12. In a real mpirun job: fraction 1 follows BSP's parameter averaging."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from runner.rules.bsp import BSPConfig
from runner.rules.sparta import SEED_STRIDE, SpartaConfig, draw_masks, mask_size
from tests.conftest import COMMON, checked_config, initial_model, params_of
from tests.conftest import assert_close as assert_params_close
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import DT, assert_close, batch, build, fit, mlp, params, plain, sgd
from tests.rank.test_checkpoint import _tensors, train

N, STEPS = 3, 9
NUMEL = 66  # mlp()'s parameters: one flat float64 buffer


def batches(rank: int, steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each rank its own data, so that the workers drift apart between exchanges."""
    return [batch(4, seed=100 * rank + s) for s in range(steps)]


def run(cfg, n: int = N, steps: int = STEPS):
    """Every rank trains ``steps`` steps (SGD with momentum 0.9); per rank: the parameters after every
    optimizer step ("stepped") and after the rule's hook ("synced"), the masks it drew ("mask"), the rule."""

    def main(comm):
        model = mlp()
        optimizer = sgd(model, lr=0.1, momentum=0.9)
        rule = build(comm, cfg, model, optimizer)
        seen: dict = {}

        def record(step, stage):
            seen[step, stage] = params(model)
            if stage == "stepped" and hasattr(rule, "masks"):
                seen[step, "mask"] = rule.masks(rule.exchanges)

        fit(rule, model, optimizer, batches(comm.rank, steps), record)
        return seen, rule

    return FakeWorld(n).run(main)


def by_hand(fraction: float, seed: int, exchange: int) -> torch.Tensor:
    """The documented mask of mlp()'s one buffer, drawn here without the rule's code."""
    k = -(-round(fraction * NUMEL * 1e6) // 1_000_000)
    g = torch.Generator().manual_seed(seed * SEED_STRIDE + exchange)
    if 16 * k <= NUMEL:
        return torch.randint(NUMEL, (k,), generator=g)
    return torch.randperm(NUMEL, generator=g)[:k]


@pytest.mark.parametrize("interval", [1, 3])
def test_fraction_1_is_bsp_params_averaging(interval):
    """Every entry, every ``interval`` steps: BSP mode=params avg_freq=interval, step by step, bit for bit
    (the same clone, all-reduce and 1/N), hence within 1e-12."""
    sparta = run(SpartaConfig(fraction=1.0, interval=interval))
    bsp = run(BSPConfig(mode="params", avg_freq=interval, overlap="none"))
    assert (bsp[0][0][STEPS - 1, "synced"] - params(mlp())).abs().max() > 1e-2, "BSP did not move"
    assert (sparta[0][0][0, "stepped"] - sparta[1][0][0, "stepped"]).abs().max() > 1e-4, "same data"
    for (s, rule), (b, _) in zip(sparta, bsp, strict=True):
        for step in range(STEPS):
            assert_close(s[step, "synced"], b[step, "synced"])
            assert torch.equal(s[step, "synced"], b[step, "synced"]), step
            assert s[step, "mask"] == [None], "fraction 1 draws no mask"
        assert rule.exchanges == STEPS // interval and rule.entries == NUMEL


@pytest.mark.parametrize("fraction", [0.05, 0.2])
def test_exactly_the_masked_entries_become_the_workers_mean(fraction):
    """After each exchange an entry of the mask holds the workers' mean of their stepped values and every
    other entry stays each worker's own; the mask is the documented draw (0.05: k = 4 with replacement,
    0.2: k = 14 distinct, from a permutation), the same on every worker, a new one every exchange."""
    cfg = SpartaConfig(fraction=fraction, seed=5)
    ranks = run(cfg)
    k = mask_size(fraction, NUMEL)
    assert k == {0.05: 4, 0.2: 14}[fraction]
    masks = []
    for step in range(STEPS):
        [mask] = ranks[0][0][step, "mask"]
        assert torch.equal(mask, by_hand(fraction, 5, step)) and len(mask) == k
        assert all(torch.equal(r[0][step, "mask"][0], mask) for r in ranks), "workers drew different masks"
        masks.append(set(mask.tolist()))
        inside = torch.zeros(NUMEL, dtype=torch.bool)
        inside[mask] = True
        mean = sum(r[0][step, "stepped"] for r in ranks) / N
        stepped = [r[0][step, "stepped"] for r in ranks]
        assert (stepped[0] - stepped[1])[~inside].abs().min() > 0, "the workers agree off the mask"
        for r, (seen, _) in enumerate(ranks):
            assert_close(seen[step, "synced"][inside], mean[inside])
            assert torch.equal(seen[step, "synced"][~inside], stepped[r][~inside]), (r, step)
    assert len({frozenset(m) for m in masks}) == STEPS, "a mask repeated"
    if fraction == 0.2:
        assert all(len(m) == k for m in masks), "the permutation's entries are distinct"


def test_masks_depend_on_the_seed_and_the_count_and_cover_everything_at_fraction_1():
    first = draw_masks(0.1, [1000, 50], seed=0, exchange=0)
    assert [len(m) for m in first] == [100, 5]
    assert not torch.equal(first[0], draw_masks(0.1, [1000, 50], seed=1, exchange=0)[0])
    assert not torch.equal(first[0], draw_masks(0.1, [1000, 50], seed=0, exchange=1)[0])
    assert all(torch.equal(a, b) for a, b in zip(first, draw_masks(0.1, [1000, 50], 0, 0), strict=True))
    assert draw_masks(1.0, [1000], seed=3, exchange=7) == [None]
    assert mask_size(1.0, 7) == 7 and mask_size(0.07, 100) == 7 and mask_size(1e-9, 10) == 1
    assert len(set(draw_masks(0.9, [1000], 0, 0)[0].tolist())) == 900, "a large share: distinct entries"


def test_bytes_per_exchange_are_the_masked_count_times_4_times_the_allreduce_share():
    """float32, 4 workers: k·4·2(N−1)/N bytes per worker and exchange (the communicator's count), k/n of
    BSP's parameter averaging; bf16 half of it (k a multiple of N: no padding)."""
    n, steps, fraction = 4, 5, 8 / NUMEL

    def sent(cfg):
        def main(comm):
            model = mlp().float()
            optimizer = sgd(model)
            rule = build(comm, cfg, model, optimizer)
            before = comm.stats.bytes_sent  # (worker 0's broadcast at build)
            for step in range(steps):
                rule.after_step(step)
            return comm.stats.bytes_sent - before

        return FakeWorld(n).run(main)

    k = mask_size(fraction, NUMEL)
    assert k == 8
    assert sent(SpartaConfig(fraction=fraction)) == [steps * k * 4 * 2 * (n - 1) // n] * n
    assert sent(BSPConfig(mode="params", overlap="none")) == [steps * NUMEL * 4 * 2 * (n - 1) // n] * n
    assert sent(SpartaConfig(fraction=fraction, comm_dtype="bf16")) == [steps * k * 2 * 2 * (n - 1) // n] * n


def test_bf16_exchange_gives_every_worker_the_same_bits_and_follows_fp32():
    """comm_dtype=bf16: the masked entries hold the same (16-bit rounded) mean on every worker, and the
    trajectory stays within bf16's rounding of the float32 exchange's."""
    full = run(SpartaConfig(fraction=0.5))
    half = run(SpartaConfig(fraction=0.5, comm_dtype="bf16"))
    for step in range(STEPS):
        [mask] = half[0][0][step, "mask"]
        synced = [r[0][step, "synced"][mask] for r in half]
        assert all(torch.equal(s, synced[0]) for s in synced), step
    for (f, _), (h, _) in zip(full, half, strict=True):
        assert not torch.equal(f[STEPS - 1, "synced"], h[STEPS - 1, "synced"]), "bf16 changed nothing"
        assert_close(f[STEPS - 1, "synced"], h[STEPS - 1, "synced"], atol=2e-2)


def test_every_worker_starts_from_worker_0s_model():
    def main(comm):
        model = mlp(seed=comm.rank)
        build(comm, SpartaConfig(), model, sgd(model))
        return params(model)

    ranks = FakeWorld(N).run(main)
    assert all(torch.equal(p, params(mlp(seed=0))) for p in ranks)


def test_validation_reports_the_workers_mean_in_a_copy_batchnorm_included():
    """eval_models gives a copy holding the workers' mean parameters and BatchNorm statistics, leaves each
    worker's own model as it was, and measures the spread sqrt((1/N) Σ_i |x_i − x̄|²)."""

    def main(comm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
        optimizer = sgd(model, momentum=0.9)
        rule = build(comm, SpartaConfig(fraction=0.1), model, optimizer)
        fit(rule, model, optimizer, batches(comm.rank, 4))
        before, stats = params(model), model[1].running_mean.clone()
        mean = rule.eval_models()[""]
        assert mean is not model and torch.equal(params(model), before)
        assert torch.equal(model[1].running_mean, stats)
        return before, stats, params(mean), mean[1].running_mean.clone(), rule.spread

    ranks = FakeWorld(N).run(main)
    x_mean = sum(r[0] for r in ranks) / N
    assert (ranks[0][0] - ranks[1][0]).abs().max() > 1e-4 and (ranks[0][1] - ranks[1][1]).abs().max() > 1e-4
    spread = (sum(float((r[0] - x_mean).pow(2).sum()) for r in ranks) / N) ** 0.5
    for _, _, reported, stats, measured in ranks:
        assert_close(reported, x_mean)
        assert_close(stats, sum(r[1] for r in ranks) / N)
        assert measured == pytest.approx(spread, rel=1e-12)


def test_one_worker_is_plain_training_and_sends_nothing():
    world = FakeWorld(1)

    def main(comm):
        model = mlp()
        optimizer = sgd(model, lr=0.1, momentum=0.9)
        rule = build(comm, SpartaConfig(fraction=0.3), model, optimizer)
        fit(rule, model, optimizer, batches(0))
        return params(model), rule.eval_models()[""] is model, comm.stats.bytes_sent, rule.exchanges

    x, reports_itself, sent, exchanges = world.run(main)[0]
    assert_close(x, plain(mlp(), batches(0), lr=0.1, momentum=0.9))
    assert reports_itself and sent == 0 and exchanges == STEPS


def test_a_failed_exchange_changes_nothing():
    """Two flat buffers (float32 and float64 parameters): the second all-reduce fails (a lost worker), and
    the first buffer's averaged entries are not written either; the exchange count stays."""

    def main(comm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 4).float(), nn.Linear(4, 3).to(DT))
        rule = build(comm, SpartaConfig(fraction=0.5), model)
        with torch.no_grad():
            for x in rule.flat.buffers:
                x.add_(comm.rank)
        before = [x.clone() for x in rule.flat.buffers]
        calls, reduce = [], rule.workers.allreduce

        def fails_second(t, *args, **kwargs):
            calls.append(t.numel())
            if len(calls) == 2:
                raise RuntimeError("lost")
            return reduce(t, *args, **kwargs)

        rule.workers.allreduce = fails_second
        with pytest.raises(RuntimeError, match="lost"):
            rule.after_step(0)
        return len(rule.flat.buffers), before, rule.flat.buffers, rule.exchanges

    for buffers, before, after, exchanges in FakeWorld(2).run(main):
        assert buffers == 2 and exchanges == 0
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


def test_checkpoint_mid_interval_resumes_exactly():
    """Saved after step 3 with exchanges every 2 steps and resumed: every rank ends where the uninterrupted
    run did (the masks replayed from the saved exchange count; tests/rank/test_checkpoint.py's harness)."""
    cfg = SpartaConfig(fraction=0.2, interval=2, seed=4)
    whole = train(FakeWorld(N), cfg, cut=3)
    saved = [_tensors(s) for _, s, _ in whole]
    assert [s["rule"]["exchanges"] for s in saved] == [1] * N
    resumed = train(FakeWorld(N), cfg, start=saved)
    for rank, ((p_whole, _, s_whole), (p_resumed, _, s_resumed)) in enumerate(
        zip(whole, resumed, strict=True)
    ):
        assert torch.equal(p_whole, p_resumed), f"rank {rank}: parameters differ"
        assert s_whole == s_resumed and s_whole["exchanges"] == 4
    assert (whole[0][0] - whole[1][0]).abs().max() > 1e-4, "the workers are identical"


def test_recover_takes_worker_0s_exchange_count_and_keeps_each_model():
    def main(comm):
        model = mlp()
        rule = build(comm, SpartaConfig(), model, sgd(model))
        with torch.no_grad():
            rule.flat.buffers[0].add_(comm.rank)
        before = params(model)
        rule.exchanges = 7 + comm.rank
        rule.recover()
        return before, params(model), rule.exchanges

    for before, after, exchanges in FakeWorld(N).run(main):
        assert torch.equal(before, after) and exchanges == 7


def test_grow_gives_every_worker_worker_0s_exchange_count():
    def main(comm):
        model = mlp()
        rule = build(comm, SpartaConfig(), model, sgd(model))
        rule.exchanges = 0 if comm.rank == 2 else 5 + comm.rank
        rule.num_workers = 2
        rule.grow(joined=comm.rank == 2)
        return rule.exchanges, rule.num_workers, rule.ready_to_grow

    assert FakeWorld(N).run(main) == [(5, N, True)] * N


@pytest.mark.parametrize(
    "overrides, key, hint",
    [
        (["rule.fraction=0"], "rule.fraction", "(0, 1]"),
        (["rule.fraction=1.5"], "rule.fraction", "(0, 1]"),
        (["rule.interval=0"], "rule.interval", ">= 1"),
        (["rule.seed=-1"], "rule.seed", "[0, 2^31)"),
        (["rule.comm_dtype=int8"], "rule.comm_dtype", "fp32, bf16, fp16"),
    ],
)
def test_bad_values_name_their_key_and_the_fix(overrides, key, hint):
    with pytest.raises(ValueError, match=re.escape(key) + ".*" + re.escape(hint)):
        checked_config(["rule=sparta", *overrides])


def test_defaults_validate():
    rule = checked_config(["rule=sparta", "devices=4"]).rule
    assert isinstance(rule, SpartaConfig)
    assert (rule.fraction, rule.interval, rule.seed, rule.comm_dtype) == (0.005, 1, 0, "fp32")


# -- mpirun jobs ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.mpi
def test_fraction_1_follows_bsp_params_averaging_under_mpirun(cli):
    """The in-process test_fraction_1_is_bsp_params_averaging through the command line: 2 ranks, 6 steps,
    every rank's model and the reported one as BSP's (float32 rounding); the bytes of a small fraction."""
    overrides = ["model=mlp", "devices=2", "train.batch_size=8", "train.save_model=all", *COMMON]
    sparta = cli("rule=sparta", "rule.fraction=1", *overrides)
    bsp = cli("rule=bsp", "rule.mode=params", "rule.avg_freq=1", *overrides)
    assert sparta.returncode == 0 and bsp.returncode == 0, sparta.output + bsp.output
    assert sparta.summary["exchanges"] == 6 and sparta.summary["steps"] == 6
    for name in ("model.pt", "model.rank0.pt", "model.rank1.pt"):
        assert_params_close(params_of(sparta.dir / name), params_of(bsp.dir / name), atol=1e-6)
    moved, start = params_of(bsp.dir / "model.pt"), dict(initial_model(overrides).named_parameters())
    assert max((moved[k] - start[k]).abs().max().item() for k in moved) > 1e-3, "BSP did not train"
