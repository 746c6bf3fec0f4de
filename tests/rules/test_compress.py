"""Encoded sums with error feedback (runner/comm/encodings/) and the rules that take them
(``rule.compress`` of BSP and DiLoCo). In process, rank by rank on tests/helpers/fakecomm.py, whose
collectives really combine the ranks' tensors: the quantizer's error bound, error feedback's invariant, the
bytes that travel, top-k with and without error feedback on a tiny problem; a real mpirun job (slow tier)."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from runner.comm.encodings import encoding
from runner.comm.encodings.int8 import BLOCK, _pack, _unpack, int8_allreduce, int8_chunk
from runner.comm.encodings.topk import topk_allreduce, topk_count
from runner.rules.bsp import BSPConfig
from runner.rules.diloco import DiLoCoConfig
from tests.conftest import COMMON, STEPS, checked_config
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import DT, build, fit, mlp, params, sgd, shard
from tests.rank.test_checkpoint import CUT, _tensors, train
from tests.rules.test_diloco import batches

N = 4


def gradients(rank: int, step: int, numel: int, integer: bool = False) -> torch.Tensor:
    """Rank ``rank``'s tensor at ``step``: float64, of varied magnitude (integers: every sum is exact)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(numel, generator=g, dtype=DT) * (1 + torch.arange(numel, dtype=DT) / 50)
    return (x * 100).round() if integer else x


# -- the quantizer and the exchanges ----------------------------------------------------------------------
def test_int8_round_trip_error_is_at_most_half_a_step_per_element():
    """Each value comes back within scale/2 of itself, the scale being its block's largest |value| / 127;
    the block's largest value comes back exactly, and a block of zeros stays zeros."""
    x = gradients(0, 0, 4 * BLOCK).float()
    x[BLOCK : 2 * BLOCK] = 0
    back = _unpack(_pack(x, 1), 4 * BLOCK, torch.float32)
    scale = x.view(-1, BLOCK).abs().amax(dim=1, keepdim=True) / 127
    error = (back - x).view(-1, BLOCK).abs()
    assert (error <= scale / 2 * (1 + 1e-6)).all()
    assert error.max() > scale.max() / 4, "rounding to the nearest step did happen"
    assert torch.equal(back[BLOCK : 2 * BLOCK], torch.zeros(BLOCK))
    peak = x.view(-1, BLOCK).abs().argmax(dim=1)
    assert torch.allclose(
        back.view(-1, BLOCK).gather(1, peak[:, None]), x.view(-1, BLOCK).gather(1, peak[:, None])
    )


def _exchange(kind: str, steps: int, numel: int, feedback: bool = True, integer: bool = False):
    """Every rank sums ``steps`` tensors through one encoding; per rank: the sums it received
    (added up), its residual and owner state, its tensors (added up), its bytes sent."""

    def main(comm):
        c = encoding(kind, torch.zeros(numel, dtype=DT), comm.size, ratio=0.01, feedback=feedback)
        received = torch.zeros(numel, dtype=DT)
        given = torch.zeros(numel, dtype=DT)
        for step in range(steps):
            t = gradients(comm.rank, step, numel, integer)
            given += t
            received += comm.allreduce(t, encoding=c)
        return received, c.residual, getattr(c, "owner", None), given, comm.stats.bytes_sent

    return FakeWorld(N).run(main)


@pytest.mark.parametrize("kind", ["int8", "topk", "topk_2bit", "sign"])
def test_error_feedback_sent_plus_residuals_is_the_sum_of_the_tensors(kind):
    """Over 6 exchanges: the sums every rank received + every rank's residual (+ with int8 the chunk owners'
    residuals of the re-quantized sums) = the sum of all tensors given. top-k on integers: exactly (what is
    sent and what is kept partition each tensor); int8, 2-bit top-k and signs: to float64 rounding. Without
    error feedback what was not sent is lost."""
    numel, integer = 3 * BLOCK * N + 17, kind == "topk"
    ranks = _exchange(kind, 6, numel, integer=integer)
    total = sum(given for *_, given, _ in ranks)
    received = ranks[0][0]
    assert all(torch.equal(r[0], received) for r in ranks), "every rank received the same bits"
    kept = sum(r[1] for r in ranks)
    if kind == "int8":
        owners = torch.cat([r[2] for r in ranks])[:numel]
        assert torch.allclose(received + kept + owners, total, rtol=0, atol=1e-9)
    elif kind in ("topk_2bit", "sign"):
        assert torch.allclose(received + kept, total, rtol=0, atol=1e-9)
    else:
        assert torch.equal(received + kept, total)
    assert (received - total).abs().max() > 1e-3, "compression left something out: this would prove nothing"
    lost = _exchange(kind, 6, numel, feedback=False, integer=integer)
    assert lost[0][1] is None and (lost[0][0] - total).abs().max() > 1e-3


def test_int8_error_feedback_keeps_the_sum_within_one_step_of_the_exact_one():
    """With error feedback the rounding does not add up over exchanges: after 20, the sums received are
    within the last exchange's rounding of the exact sum; without it the error grows with the count."""
    numel = 2 * BLOCK * N
    with_feedback = _exchange("int8", 20, numel)
    without = _exchange("int8", 20, numel, feedback=False)
    total = sum(r[3] for r in with_feedback)
    assert (with_feedback[0][0] - total).abs().max() < 0.5 * (without[0][0] - total).abs().max()


def test_topk_sends_exactly_k_values_per_worker():
    """Disjoint supports: the sum has exactly N·k non-zeros, each rank's k largest; each rank sent (N−1)
    copies of k int32 indices and k float32 values."""
    numel, ratio = 1000, 0.01
    k = topk_count(numel, ratio)
    assert k == 10

    def main(comm):
        t = torch.zeros(numel)
        t[comm.rank :: N] = torch.arange(1.0, numel // N + 1)  # rank r's largest at the end of its stride
        return topk_allreduce(comm, t, k), comm.stats.bytes_sent

    ranks = FakeWorld(N).run(main)
    total = ranks[0][0]
    assert int((total != 0).sum()) == N * k
    for r in range(N):
        assert torch.equal(total[r::N][-k:], torch.arange(numel // N - k + 1.0, numel // N + 1))
    assert all(sent == (N - 1) * k * (4 + 4) for _, sent in ranks)


def test_int8_bytes_are_what_travels_a_quarter_of_float32s_and_a_block_scale():
    """The all-to-all and the all-gather of the int8 exchange send 2(N−1)/N·(1 + 4/256) bytes a value (padded
    to whole blocks per rank's chunk), 0.25 ± 0.02 of the float32 all-reduce's 2(N−1)/N·4."""
    numel = 56554  # the digits CNN's parameters

    def main(comm):
        t = torch.randn(numel)
        int8_allreduce(comm, t)
        fp32 = comm.stats.bytes_sent
        comm.allreduce(torch.randn(numel))
        return fp32, comm.stats.bytes_sent - fp32

    for int8, fp32 in FakeWorld(N).run(main):
        padded = N * int8_chunk(numel, N)
        assert int8 == 2 * (N - 1) * padded // N * (1 + 4 / BLOCK)
        assert fp32 == 2 * (N - 1) * numel * 4 // N
        assert 0.23 <= int8 / fp32 <= 0.27


# -- the rules --------------------------------------------------------------------------------------------
def _bsp(cfg: BSPConfig, steps: int = 6):
    def main(comm):
        model = mlp()
        optimizer = sgd(model, momentum=0.9)
        rule = build(comm, cfg, model, optimizer)
        fit(rule, model, optimizer, shard(comm.rank)[:steps])
        return params(model), comm.stats.bytes_sent, rule

    return FakeWorld(N).run(main)


def test_compress_none_is_bsp_and_diloco_bit_for_bit():
    """``compress: none`` (whatever ``topk_ratio`` and ``error_feedback``) builds no compressed exchange and
    gives today's trajectories and bytes, bit for bit."""
    plain = _bsp(BSPConfig(bucket_mb=1e-4, overlap="none"))
    same = _bsp(
        BSPConfig(bucket_mb=1e-4, overlap="none", compress="none", topk_ratio=0.5, error_feedback=False)
    )
    for (a, sent_a, _), (b, sent_b, rule) in zip(plain, same, strict=True):
        assert torch.equal(a, b) and sent_a == sent_b and rule.compressed == []
    base = DiLoCoConfig(inner_steps=3)

    def diloco(cfg):
        def main(comm):
            model = mlp()
            optimizer = sgd(model, momentum=0.9)
            rule = build(comm, cfg, model, optimizer)
            fit(rule, model, optimizer, batches(comm.rank, 9))
            return params(model), comm.stats.bytes_sent

        return FakeWorld(3).run(main)

    other = DiLoCoConfig(inner_steps=3, compress="none", topk_ratio=0.5, error_feedback=False)
    assert all(
        torch.equal(a, b) and sa == sb for (a, sa), (b, sb) in zip(diloco(base), diloco(other), strict=True)
    )


@pytest.mark.parametrize("kind, gap", [("int8", 0.01), ("topk", 0.5), ("topk_2bit", 0.5), ("sign", 0.5)])
def test_bsp_compressed_keeps_the_workers_together_near_the_uncompressed_run(kind, gap):
    """Every worker steps with the same compressed sum (equal parameters), close to float32's for int8, and
    top-k at 10% sends fewer bytes (int8's bytes: above, on a tensor larger than these 4 tiny buckets,
    which it pads to whole blocks)."""
    exact = _bsp(BSPConfig(bucket_mb=1e-4))
    ranks = _bsp(BSPConfig(bucket_mb=1e-4, compress=kind, topk_ratio=0.1))
    for x, _, rule in ranks:
        assert torch.equal(x, ranks[0][0]) and len(rule.compressed) == 4 and rule.overlap == "none"
    moved = (exact[0][0] - params(mlp())).abs().max()
    assert 0 < (ranks[0][0] - exact[0][0]).abs().max() < gap * moved
    assert kind == "int8" or ranks[0][1] < 0.5 * exact[0][1]


def test_topk_at_one_percent_reaches_the_optimum_only_with_error_feedback():
    """Worker i minimizes ½‖w − c_i‖², c_i = c* + 5(e_i − e_{i+1}): the mean's optimum is c*, but each
    worker's largest gradient values are its own spikes. Top-k at 1% of 100 values (k = 1) without error
    feedback sends only spikes, and w never leaves 0 elsewhere; with it the rest is sent in turn, and w comes
    within a sixth of its initial distance to c* in 400 steps."""
    dim = 100
    g = torch.Generator().manual_seed(0)
    star = torch.randn(dim, generator=g, dtype=DT)
    targets = []
    for i in range(N):
        c = star.clone()
        c[i] += 5
        c[(i + 1) % N] -= 5
        targets.append(c)

    def distance(feedback: bool) -> float:
        cfg = BSPConfig(compress="topk", topk_ratio=0.01, error_feedback=feedback)

        def main(comm):
            model = nn.Linear(dim, 1, bias=False).to(DT)
            with torch.no_grad():
                model.weight.zero_()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
            rule = build(comm, cfg, model, optimizer)
            for step in range(400):
                optimizer.zero_grad(set_to_none=False)
                loss = 0.5 * (model.weight[0] - targets[comm.rank]).square().sum()
                (loss * rule.loss_scale).backward()
                rule.after_backward(step)
                optimizer.step()
                rule.after_step(step)
            return float((model.weight[0].detach() - star).norm())

        return FakeWorld(N).run(main)[0]

    start = float(star.norm())
    assert distance(True) < start / 6
    assert distance(False) > 0.95 * start


@pytest.mark.parametrize("kind", ["int8", "topk", "topk_2bit", "sign"])
def test_diloco_compressed_outer_gradients_keep_the_workers_together(kind):
    """The workers take the same outer step from the compressed mean of their outer gradients; int8 stays
    close to float32's; top-k at 20% sends fewer bytes per round (int8 pads these 66 values to whole
    blocks)."""

    def run(cfg):
        def main(comm):
            model = mlp()
            optimizer = sgd(model, momentum=0.9)
            rule = build(comm, cfg, model, optimizer)
            fit(rule, model, optimizer, batches(comm.rank, 9))
            return params(model), torch.cat(rule.start), comm.stats.bytes_sent

        return FakeWorld(3).run(main)

    exact = run(DiLoCoConfig(inner_steps=3))
    ranks = run(DiLoCoConfig(inner_steps=3, compress=kind, topk_ratio=0.2))
    for x, start, _ in ranks:
        assert torch.equal(x, ranks[0][0]) and torch.equal(start, x)
    moved = (exact[0][0] - params(mlp())).abs().max()
    gap = (ranks[0][0] - exact[0][0]).abs().max()
    assert 0 < gap < (0.01 if kind == "int8" else 0.9) * moved
    assert kind in ("int8", "topk_2bit") or ranks[0][2] < exact[0][2]  # (tiny tensors: whole chunks)


@pytest.mark.parametrize("cfg", [BSPConfig(compress="int8"), DiLoCoConfig(inner_steps=5, compress="topk")])
def test_a_checkpoint_keeps_the_error_feedback_and_resumes_exactly(cfg):
    """The residuals are each worker's rule state: saved at CUT and resumed, every rank ends where the
    uninterrupted run did."""
    whole = train(FakeWorld(3), cfg, cut=CUT)
    saved = [_tensors(s) for _, s, _ in whole]
    assert all(s["rule"]["workers"] == 3 and s["rule"]["residuals"] for s in saved)
    resumed = train(FakeWorld(3), cfg, start=saved)
    for rank, ((a, _, _), (b, _, _)) in enumerate(zip(whole, resumed, strict=True)):
        assert torch.equal(a, b), f"rank {rank}"


def test_recover_starts_the_error_feedback_anew():
    def main(comm):
        model = mlp()
        rule = build(comm, BSPConfig(compress="int8"), model, sgd(model))
        fit(rule, model, sgd(model), shard(comm.rank)[:2])
        assert rule.compressed[0].residual.abs().max() > 0
        rule.recover()
        return rule.compressed[0].residual.abs().max(), rule.compressed[0].owner.abs().max()

    assert all(r == 0 and o == 0 for r, o in FakeWorld(N).run(main))


# -- the configuration ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "overrides, key, hint",
    [
        (["rule.compress=fp4"], "rule.compress", "none, int8, topk"),
        (["rule.compress=topk", "rule.topk_ratio=0"], "rule.topk_ratio", "(0, 1]"),
        (["rule.topk_ratio=1.5"], "rule.topk_ratio", "(0, 1]"),
        (["rule.compress=int8", "rule.comm_dtype=bf16"], "rule.compress", "rule.comm_dtype=fp32"),
        (["rule.compress=int8", "rule.mode=params"], "rule.compress", "rule.mode=grads"),
        (["rule.compress=topk", "rule.overlap=thread"], "rule.overlap", "rule.overlap=none"),
        (
            ["rule=diloco", "rule.compress=int8", "rule.comm_dtype=fp16"],
            "rule.compress",
            "rule.comm_dtype=fp32",
        ),
        (["rule=diloco", "rule.topk_ratio=-0.1"], "rule.topk_ratio", "(0, 1]"),
        (["rule=streaming_diloco", "rule.compress=int8"], "rule.compress", "rule.quantize=int8"),
    ],
)
def test_bad_values_name_their_key_and_the_fix(overrides, key, hint):
    with pytest.raises(ValueError, match=re.escape(key) + ".*" + re.escape(hint)):
        checked_config(overrides)


@pytest.mark.parametrize("rule", ["bsp", "diloco"])
def test_defaults_send_uncompressed(rule):
    cfg = checked_config([f"rule={rule}", "rule.compress=topk"]).rule
    assert (cfg.topk_ratio, cfg.error_feedback) == (0.01, True)
    assert checked_config([f"rule={rule}"]).rule.compress == "none"


# -- mpirun job -------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.mpi
def test_bsp_int8_trains_and_records_the_bytes_that_travel(cli):
    """A real job over MPI's all-to-all and all-gather: 2 ranks, int8 gradients; it trains like float32, and
    the bytes it records are fewer by exactly what the exchange's formula says each step saves (float32's
    2(N−1)/N·4 bytes a value against 2(N−1)/N·(1 + 4/256) a padded value), 0.25 ± 0.02 of them."""
    overrides = ["model=mlp", "devices=2", "train.batch_size=8", *COMMON]
    fp32 = cli("rule=bsp", *overrides)
    int8 = cli("rule=bsp", "rule.compress=int8", *overrides)
    assert fp32.returncode == 0 and int8.returncode == 0, fp32.output + int8.output
    numel = sum(p.numel() for p in checked_config(overrides).model.build().parameters())  # one bucket
    per_value = 2 * (2 - 1) / 2
    exchange = {"fp32": per_value * 4 * numel, "int8": per_value * 2 * int8_chunk(numel, 2) * (1 + 4 / BLOCK)}
    assert 0.23 <= exchange["int8"] / exchange["fp32"] <= 0.27
    saved = 2 * STEPS * (exchange["fp32"] - exchange["int8"])  # 2 ranks, each step
    assert fp32.summary["bytes_sent"] - int8.summary["bytes_sent"] == saved
    assert int8.summary["steps"] == fp32.summary["steps"] == STEPS
    loss = fp32.summary["final_val_loss"]
    assert abs(int8.summary["final_val_loss"] - loss) < 0.05 * loss
