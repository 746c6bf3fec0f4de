"""SparseLoCo (runner/rules/sparseloco.py), in process: ranks are threads talking through FakeWorld, models
tiny float64 MLPs or single vectors. Every code sending all values in 32 bits is DiLoCo without momentum to
1e-12 whatever β; one round of sparse codes (32 and 2 bits) and the decayed error feedback of the next are
checked against numbers worked out by hand; the error feedback loses nothing at β = 1; the bytes of a round
are the codes' and the statistics', counted as they travel; checkpoints, a lost worker and new ones."""

from __future__ import annotations

import re

import pytest
import torch
from hydra.errors import ConfigCompositionException
from torch import nn
from torch.nn import functional as F

from runner.comm.sparse import SparseCode
from runner.rules.diloco import DiLoCoConfig
from runner.rules.sparseloco import SparseLoCoConfig
from tests.conftest import checked_config
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import DT, assert_close, batch, build, fit, mlp, params, sgd, vector
from tests.rank.test_checkpoint import CUT, _tensors, train
from tests.rules.test_diloco import ROUNDS, H, N, batches, run

SPARSE = {"chunk": 16, "topk": 4, "bits": 2}  # 66 parameters: 5 chunks (the last padded), 4 values each


def sparse(**kwargs) -> SparseLoCoConfig:
    return SparseLoCoConfig(**{"inner_steps": H, "outer_lr": 0.7, **SPARSE, **kwargs})


def residual(rule) -> torch.Tensor:
    return torch.cat([c.residual for c in rule.compressed])


@pytest.mark.parametrize("beta", [0.0, 0.95, 1.0])
def test_every_value_in_32_bits_is_diloco_without_momentum_whatever_beta(beta):
    """topk = chunk and bits 32: every worker sends its Δ_i as it is, nothing is left over for the error
    feedback, and every step of every rank follows DiLoCo with outer_momentum 0 and no Nesterov (the mean of
    the Δ_i against x_start minus the mean of the x_i: rounding apart, hence 1e-12)."""
    dense = run(sparse(ef_decay=beta, chunk=16, topk=16, bits=32))
    diloco = run(DiLoCoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.0, nesterov=False))
    last = H * ROUNDS - 1
    assert (diloco[0][0][last, "synced"] - params(mlp())).abs().max() > 1e-2, "DiLoCo did not move"
    for (s, rule), (d, _) in zip(dense, diloco, strict=True):
        for step in range(H * ROUNDS):
            assert_close(s[step, "synced"], d[step, "synced"])
        assert torch.equal(residual(rule), torch.zeros(66, dtype=DT))
        assert rule.outer_steps == ROUNDS


X0 = [1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, -3.0]
#: Each worker's Δ_i of round 1 and of round 2, and what is worked out by hand from them below.
ROUND1 = [[4, -1, 0.5, 2, -3, 0.25, 1, -0.5], [1, 3, -2, 0.5, 0.5, 0.5, -4, 2]]
ROUND2 = [[0, 2, 0, 1, 0, 0, 0, 1], [0] * 8]


def test_two_rounds_of_top_2_of_4_by_hand():
    """Chunks of 4 values, k = 2, 32 bits, β = 0.5, outer lr 0.5, two workers, one step per round.

    Round 1 (e = 0): worker 0 sends [4,0,0,2 | -3,0,1,0] and keeps e_0 = [0,-1,0.5,0 | 0,0.25,0,-0.5];
    worker 1 sends [0,3,-2,0 | 0,0,-4,2] and keeps e_1 = [1,0,0,0.5 | 0.5,0.5,0,0]; Δ is their mean.
    Round 2: β·e_0 + Δ'_0 = [0,1.5,0.25,1 | 0,0.125,0,0.75]: it sends [0,1.5,0,1 | 0,0.125,0,0.75] and
    keeps 0.25 (half of round 1's 0.5 left over there); worker 1 trained nothing (Δ'_1 = 0) and sends
    its decayed remainder β·e_1 = [0.5,0,0,0.25 | 0.25,0.25,0,0] whole. Values and offsets: 2 chunks of
    2 × (1 + 8) bytes to the other worker."""
    cfg = SparseLoCoConfig(inner_steps=1, outer_lr=0.5, ef_decay=0.5, chunk=4, topk=2, bits=32)
    rounds = one_step_rounds(cfg, [ROUND1, ROUND2])
    deltas = [[2, 1.5, -1, 1, -1.5, 0, -1.5, 1], [0.25, 0.75, 0, 0.625, 0.125, 0.1875, 0, 0.375]]
    kept = [
        [[0, -1, 0.5, 0, 0, 0.25, 0, -0.5], [1, 0, 0, 0.5, 0.5, 0.5, 0, 0]],
        [[0, 0, 0.25, 0, 0, 0, 0, 0], [0] * 8],
    ]
    start = torch.tensor(X0, dtype=DT)
    for t, delta in enumerate(deltas):
        start = start - 0.5 * torch.tensor(delta, dtype=DT)
        for rank in range(2):
            x_start, x, e, sent = rounds[rank][t]
            assert torch.equal(x_start, start) and torch.equal(x, start), (t, rank)
            assert torch.equal(e, torch.tensor(kept[t][rank], dtype=DT)), (t, rank)
            assert sent == SparseCode(4, 2, 32).nbytes(8, itemsize=8) == 36
    assert torch.equal(
        start, torch.tensor([-0.125, -2.125, 2.5, -2.8125, 1.1875, -0.59375, 3.75, -3.6875], dtype=DT)
    )


def test_a_2_bit_round_by_hand():
    """One chunk of 8, k = 4, 2 bits: each worker's four largest |values| become their sign and the nearer
    of two levels, the mean |value| of the smaller two and of the larger two. Worker 0: |1|,|2| → 1.5 and
    |3|,|4| → 3.5; worker 1: |0.25|,|0.5| → 0.375 and |1|,|2| → 1.5. 4 one-byte offsets, 1 byte of codes
    and two float32 levels: 13 bytes."""
    deltas = [[3, -1, 0, 0.5, -2, 0, 0.25, 4], [0, 0.5, -1, 0, 0, 2, -0.25, 0]]
    cfg = SparseLoCoConfig(inner_steps=1, outer_lr=1.0, chunk=8, topk=4, bits=2)
    [[(start0, _, e0, sent)], [(start1, _, e1, _)]] = one_step_rounds(cfg, [deltas])
    mean = torch.tensor([1.75, -0.5625, -0.75, 0, -0.75, 0.75, -0.1875, 1.75], dtype=DT)
    assert torch.equal(start0, torch.tensor(X0, dtype=DT) - mean) and torch.equal(start1, start0)
    assert torch.equal(e0, torch.tensor([-0.5, 0.5, 0, 0.5, -0.5, 0, 0.25, 0.5], dtype=DT))
    assert torch.equal(e1, torch.tensor([0, 0.125, 0.5, 0, 0, 0.5, 0.125, 0], dtype=DT))
    assert sent == SparseCode(8, 4, 2).nbytes(8) == 13


def one_step_rounds(cfg, rounds):
    """Two workers on the vector X0; in each round worker i moves to x_start − Δ_i of ``rounds`` and the
    rule ends the round. Per worker and round: x_start, its parameters, its error feedback, bytes sent."""

    def main(comm):
        model = vector(*X0)
        rule = build(comm, cfg, model, sgd(model))
        out = []
        for given in rounds:
            with torch.no_grad():
                rule.flat.buffers[0].copy_(rule.start[0] - torch.tensor(given[comm.rank], dtype=DT))
            before = comm.stats.bytes_sent
            rule.after_step(0)
            out.append(
                (rule.start[0].clone(), params(model), residual(rule).clone(), comm.stats.bytes_sent - before)
            )
        return out

    return FakeWorld(2).run(main)


@pytest.mark.parametrize("beta", [1.0, 0.5])
def test_error_feedback_loses_nothing_at_beta_1(beta):
    """Over three rounds of 2-bit codes, N·Σ_t Δ_t (what x_start took: (x_start_0 − x_start_T)/outer_lr)
    plus every worker's error feedback left is every worker's Δ_i of every round: nothing is lost at β = 1,
    and β < 1 decays what waited. Every worker ends every round with the same x_start (bit for bit); within
    a round the rule leaves the workers alone."""
    ranks = run(sparse(ef_decay=beta))
    starts = [params(mlp())] + [ranks[0][0][(t + 1) * H - 1, "synced"] for t in range(ROUNDS)]
    given = sum(starts[t] - seen[(t + 1) * H - 1, "stepped"] for t in range(ROUNDS) for seen, _ in ranks)
    sent = N * (starts[0] - starts[-1]) / 0.7
    kept = sum(residual(rule) for _, rule in ranks)
    assert kept.abs().max() > 1e-3, "the codes must leave something out"
    if beta == 1.0:
        assert_close(sent + kept, given)
    else:
        assert (sent + kept - given).abs().max() > 1e-3
    for step in range(H * ROUNDS):
        for seen, _ in ranks:
            if (step + 1) % H:
                assert torch.equal(seen[step, "synced"], seen[step, "stepped"])
            else:
                assert torch.equal(seen[step, "synced"], ranks[0][0][step, "synced"])
    seen, rule = ranks[1]
    assert rule.metrics()["residual_norm"] == pytest.approx(float(residual(rule).norm()), abs=1e-12)
    assert rule.metrics()["pseudo_grad_norm"] == pytest.approx(float((starts[-2] - starts[-1]).norm()) / 0.7)


def bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.ReLU(), nn.Linear(128, 10))


def round_bytes(cfg, n: int = 4, rounds: int = 2):
    """A float32 model with BatchNorm on ``n`` workers, rounds of 2 steps: per worker the bytes each round
    sent (after the build's broadcast), and the rule's final metrics."""

    def main(comm):
        model = bn_model()
        optimizer = sgd(model)
        rule = build(comm, cfg, model, optimizer)
        sent = []
        for step in range(2 * rounds):
            _, y = batch(8, seed=100 * comm.rank + step)
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(100 * comm.rank + step))
            before = comm.stats.bytes_sent
            optimizer.zero_grad()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            rule.after_step(step)
            if step % 2:
                sent.append(comm.stats.bytes_sent - before)
        return sent, rule.final_metrics()

    return FakeWorld(n).run(main)


def test_a_round_sends_the_codes_and_the_statistics_and_43x_fewer_parameter_bytes_than_diloco():
    """Per round and worker: (N−1) × the code's bytes for the 9,866 parameters (3 chunks of 152 bytes: 64
    two-byte offsets, 16 bytes of 2-bit codes, two float32 levels), plus the float32 all-reduce of the 256
    BatchNorm statistics, 2(N−1)/N × 4 bytes each, which DiLoCo sends too. DiLoCo's parameters: 2(N−1)/N × 4
    bytes each, 43× the codes' (54× for whole chunks)."""
    numel, stats = 9866, 2 * int(128 * 4 * 2 * 3 / 4)
    codes = 3 * SparseCode(4096, 64, 2).nbytes(numel)
    assert codes == 3 * 3 * 152
    ranks = round_bytes(SparseLoCoConfig(inner_steps=2))
    for sent, final in ranks:
        assert sent == [codes + stats] * 2
        assert final["exchange_bytes"] == 4 * 2 * (codes + stats) and final["outer_steps"] == 2
    diloco = int(numel * 4 * 2 * 3 / 4)
    assert [s for s, _ in round_bytes(DiLoCoConfig(inner_steps=2))] == [[diloco + stats] * 2] * 4
    assert 43 < diloco / codes < 44


def test_one_worker_sends_nothing_and_takes_its_own_progress():
    """N = 1: the code is skipped (nothing to send to), Δ = Δ_1 and the error feedback stays 0: DiLoCo
    without momentum."""
    [(mine, rule)] = run(sparse(), n=1)
    [(theirs, _)] = run(DiLoCoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.0, nesterov=False), n=1)
    assert_close(mine[H * ROUNDS - 1, "synced"], theirs[H * ROUNDS - 1, "synced"])
    assert not residual(rule).any() and rule.workers.stats.bytes_sent == 0


def test_16_bit_values_travel_in_2_bytes_and_leave_their_rounding_in_the_error_feedback():
    """comm_dtype bf16 with bits 32: the values travel in 2 bytes (float64's 8 otherwise); what bf16 rounds
    away of a worker's own values stays in its e_i (every value sent: all of e_i)."""
    cfg = {"inner_steps": 2, "chunk": 16, "topk": 16, "bits": 32}

    def main(comm, dtype):
        model = mlp()
        rule = build(comm, SparseLoCoConfig(**cfg, comm_dtype=dtype), model, sgd(model))
        fit(rule, model, sgd(model), batches(comm.rank, 1))
        with torch.no_grad():
            given = rule.start[0] - rule.flat.buffers[0]
        before = comm.stats.bytes_sent
        rule.after_step(1)
        return comm.stats.bytes_sent - before, given, residual(rule)

    full = FakeWorld(N).run(lambda comm: main(comm, "fp32"))
    half = FakeWorld(N).run(lambda comm: main(comm, "bf16"))
    for (sent_full, _, e_full), (sent_half, given, e_half) in zip(full, half, strict=True):
        assert sent_full == (N - 1) * 5 * 16 * 8 and sent_half == (N - 1) * 5 * 16 * 2
        assert not e_full.any() and e_half.any()
        assert torch.equal(e_half, given - given.to(torch.bfloat16).to(DT))


def test_mid_round_validation_reports_the_workers_mean_in_a_copy():
    def main(comm):
        model = mlp()
        rule = build(comm, sparse(inner_steps=4), model, sgd(model))
        fit(rule, model, sgd(model), batches(comm.rank, 2))
        before = params(model)
        mid = rule.eval_models()[""]
        assert mid is not model and torch.equal(params(model), before)
        return before, params(mid)

    ranks = FakeWorld(N).run(main)
    assert (ranks[0][0] - ranks[1][0]).abs().max() > 1e-4
    for _, reported in ranks:
        assert_close(reported, sum(r[0] for r in ranks) / N)


def test_listed_periods_end_rounds_where_the_list_says():
    def main(comm):
        model = mlp()
        cfg = sparse(period_schedule="list", period_list=[1, 3])
        rule = build(comm, cfg, model, sgd(model))
        counts = []
        fit(rule, model, sgd(model), batches(comm.rank, 7), lambda s, stage: counts.append(rule.outer_steps))
        return counts[1::2]

    assert FakeWorld(2).run(main) == [[1, 1, 1, 2, 2, 2, 3]] * 2


def test_checkpoint_mid_round_resumes_exactly_error_feedback_included():
    """Saved after step CUT = 3 of rounds of 2 (mid-round, the error feedback not zero) and resumed: every
    rank ends where the uninterrupted run did, bit for bit (tests/rank/test_checkpoint.py's harness)."""
    cfg = sparse(inner_steps=2)
    whole = train(FakeWorld(N), cfg, cut=CUT)
    saved = [_tensors(s) for _, s, _ in whole]
    assert all(s["rule"]["round_step"] == 1 for s in saved), "the cut is not mid-round"
    assert all(s["rule"]["residuals"][0].abs().max() > 0 for s in saved)
    resumed = train(FakeWorld(N), cfg, start=saved)
    for (p_whole, _, s_whole), (p_resumed, _, s_resumed) in zip(whole, resumed, strict=True):
        assert torch.equal(p_whole, p_resumed)
        assert torch.equal(s_whole["start"][0], s_resumed["start"][0])
        assert torch.equal(s_whole["residuals"][0], s_resumed["residuals"][0])
        assert s_whole["exchange_bytes"] == s_resumed["exchange_bytes"] > 0
        assert (s_resumed["round_step"], s_resumed["outer_steps"]) == (0, 4)


def test_recover_mid_round_ends_the_round_densely_from_worker_0s_x_start_and_keeps_the_feedback():
    """The survivors' rounds may differ after a loss (an outer step completed on some only): all take worker
    0's x_start and count, then x_start − outer_lr · mean_i(x_start − x_i), densely, as every survivor's
    parameters and x_start, in a new round; each keeps its own error feedback (DiLoCo's restart would zero
    it, and with it most of a worker's progress early in a run)."""

    def main(comm):
        model = mlp()
        rule = build(comm, sparse(), model, sgd(model))
        fit(rule, model, sgd(model), batches(comm.rank, H + 1))
        assert residual(rule).abs().max() > 0 and rule.round_step == 1
        start0 = rule.start[0].clone()
        with torch.no_grad():
            rule.start[0].add_(comm.rank)
        rule.outer_steps += comm.rank
        before = (params(model), residual(rule).clone())
        rule.recover()
        after = (params(model), rule.start[0].clone(), residual(rule))
        return before, start0, after, (rule.round_step, rule.outer_steps)

    ranks = FakeWorld(N).run(main)
    x0 = ranks[0][1]
    expected = x0 - 0.7 * sum(x0 - x for (x, _), *_ in ranks) / N  # (outer_lr 0.7)
    for (_, e_before), _, (x, start, e), counts in ranks:
        assert_close(x, expected)
        assert_close(start, expected)
        assert torch.equal(x, ranks[0][2][0]), "the same bits on every survivor"
        assert torch.equal(e, e_before) and e.abs().max() > 0 and counts == (0, 1)


def test_recover_after_a_broken_exchange_takes_the_dense_step_and_keeps_the_feedback():
    """Every survivor had finished the round: the same dense step over their end points (x_start −
    outer_lr·(x_start − mean x_i)); their error feedback stays theirs, for later rounds to send."""
    cfg = sparse(chunk=16, topk=16, bits=32)

    def main(comm):
        model = mlp()
        rule = build(comm, cfg, model, sgd(model))
        with torch.no_grad():
            rule.flat.buffers[0].add_(0.1 * (comm.rank + 1))
            rule.compressed[0].residual.fill_(1.0)
        local = params(model)
        rule.round_step = H
        rule.recover()
        return local, params(model), residual(rule), (rule.round_step, rule.outer_steps)

    ranks = FakeWorld(N).run(main)
    x0 = params(mlp())
    expected = x0 - 0.7 * (x0 - sum(r[0] for r in ranks) / N)
    for _, x, e, counts in ranks:
        assert_close(x, expected)
        assert bool((e == 1.0).all()) and counts == (0, 0)


def test_new_workers_start_with_no_error_feedback_and_the_others_keep_theirs():
    """At a round's start (ready_to_grow), workers 2 and 3 join (grow(joined=True)): their error feedback
    and bytes count are zero, 0 and 1 keep theirs; the next round's outer step leaves all four with the same
    x_start."""

    def main(comm):
        model = mlp()
        optimizer = sgd(model)
        rule = build(comm, sparse(), model, optimizer)
        fit(rule, model, optimizer, batches(comm.rank, H + 1))
        mid_round = rule.ready_to_grow
        fit(rule, model, optimizer, batches(comm.rank, H - 1))
        before = residual(rule).clone()
        assert rule.ready_to_grow and not mid_round and before.abs().max() > 0
        rule.grow(joined=comm.rank >= 2)
        after = residual(rule).clone()
        fit(rule, model, optimizer, batches(comm.rank + 10, H))
        return before, after, params(model), rule.exchange_bytes

    ranks = FakeWorld(4).run(main)
    for rank, (before, after, x, sent) in enumerate(ranks):
        assert torch.equal(after, torch.zeros_like(before) if rank >= 2 else before)
        assert torch.equal(x, ranks[0][2])
        assert sent == ranks[0][3] // (3 if rank >= 2 else 1) > 0, "a new worker counts its own round only"


@pytest.mark.parametrize(
    "overrides, key, hint",
    [
        (["rule.inner_steps=0"], "rule.inner_steps", ">= 1"),
        (["rule.outer_lr=0"], "rule.outer_lr", "> 0"),
        (["rule.ef_decay=1.5"], "rule.ef_decay", "[0, 1]"),
        (["rule.bits=4"], "rule.bits", "2 (sign"),
        (["rule.chunk=0"], "rule.chunk", "[1, 32768]"),
        (["rule.chunk=40000", "rule.topk=8"], "rule.chunk", "[1, 32768]"),
        (["rule.topk=0"], "rule.topk", "[1, rule.chunk=4096]"),
        (["rule.chunk=32"], "rule.topk", "[1, rule.chunk=32]"),
        (["rule.comm_dtype=bf16"], "rule.comm_dtype", "rule.bits=32"),
    ],
)
def test_bad_values_name_their_key_and_the_fix(overrides, key, hint):
    with pytest.raises(ValueError, match=re.escape(key) + ".*" + re.escape(hint)):
        checked_config(["rule=sparseloco", *overrides])


@pytest.mark.parametrize("key", ["outer_momentum", "nesterov", "compress"])
def test_diloco_s_momentum_and_compression_are_not_keys(key):
    with pytest.raises(ConfigCompositionException, match=f"rule.{key}"):
        checked_config(["rule=sparseloco", f"rule.{key}=0"])


def test_defaults_are_the_paper_s():
    rule = checked_config(["rule=sparseloco", "devices=4"]).rule
    assert isinstance(rule, SparseLoCoConfig)
    assert (rule.inner_steps, rule.outer_lr, rule.ef_decay) == (10, 1.0, 0.95)
    assert (rule.chunk, rule.topk, rule.bits, rule.comm_dtype) == (4096, 64, 2, "fp32")
    inner = rule.diloco()
    assert (inner.outer_momentum, inner.nesterov, inner.compress, inner.outer_lr) == (0.0, False, "none", 1.0)
