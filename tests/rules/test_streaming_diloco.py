"""Streaming DiLoCo (runner/rules/streaming_diloco.py), in process: ranks are threads talking through
FakeWorld, whose collectives really reduce; models tiny float64 MLPs, so that DiLoCo's trajectory is matched
bit for bit where the schedules agree, and the delayed and 8-bit exchanges are checked against the formula."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from runner.comm.encodings.int8 import int8_allreduce
from runner.rules.diloco import DiLoCoConfig
from runner.rules.streaming_diloco import BLOCK, StreamingDiLoCoConfig
from tests.conftest import COMMON, STEPS, checked_config, params_of
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import DT, assert_close, build, fit, mlp, params, sgd
from tests.rank.test_checkpoint import CUT, _tensors, train
from tests.rules.test_diloco import ROUNDS, batches, outer_by_hand

N, H = 3, 4
OUTER = {"inner_steps": H, "outer_lr": 0.7, "outer_momentum": 0.9}


def streaming(**kw) -> StreamingDiLoCoConfig:
    return StreamingDiLoCoConfig(**{**OUTER, **kw})


class Stack(nn.Module):
    """mlp's kind with two hidden blocks of one type in an nn.ModuleList (``fragment_by=blocks``), drawn from
    its own generator (the rank threads build it at once)."""

    def __init__(self):
        super().__init__()
        self.first, self.h, self.last = (
            nn.Linear(5, 7),
            nn.ModuleList(nn.Linear(7, 7) for _ in "ab"),
            nn.Linear(7, 3),
        )
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        self.to(DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.first(x))
        for block in self.h:
            x = torch.tanh(block(x))
        return self.last(x)


#: The models each fragment_by is checked on (``blocks`` needs repeated blocks: Stack's two).
MODELS = {"size": mlp, "blocks": Stack}


def trajectories(cfg, n: int = N, make=mlp) -> list[dict]:
    """Every rank's parameters after each step's optimizer ("stepped") and hook ("synced"), H·ROUNDS steps."""

    def main(comm):
        model = make()
        optimizer = sgd(model, lr=0.1, momentum=0.9)
        rule = build(comm, cfg, model, optimizer)
        seen: dict = {}
        fit(
            rule,
            model,
            optimizer,
            batches(comm.rank, H * ROUNDS),
            lambda s, t: seen.__setitem__((s, t), params(model)),
        )
        rule.finish()
        return seen, rule

    return FakeWorld(n).run(main)


def assert_same(a: list, b: list) -> None:
    for rank, ((x, _), (y, _)) in enumerate(zip(a, b, strict=True)):
        for step in range(H * ROUNDS):
            assert torch.equal(x[step, "synced"], y[step, "synced"]), f"rank {rank}, step {step}"


@pytest.mark.parametrize("fragment_by", ["size", "blocks"])
@pytest.mark.parametrize("nesterov", [True, False])
def test_one_fragment_without_delay_is_diloco_bit_for_bit(nesterov, fragment_by):
    make = MODELS[fragment_by]
    diloco = trajectories(DiLoCoConfig(**OUTER, nesterov=nesterov), make=make)
    cfg = streaming(fragments=1, delay=0, nesterov=nesterov, fragment_by=fragment_by)
    assert_same(trajectories(cfg, make=make), diloco)
    assert (diloco[0][0][H - 1, "synced"] - diloco[0][0][H - 1, "stepped"]).abs().max() > 1e-3, (
        "no outer step"
    )


@pytest.mark.parametrize("fragment_by, fragments", [("size", 3), ("blocks", 2)])
def test_fragments_synchronized_together_without_delay_are_diloco_bit_for_bit(fragment_by, fragments):
    """Fragments all at DiLoCo's round ends (stagger off), no delay: size, three of 22 values each; blocks,
    Stack's two (fragment 0: its first and last layers and block 0, laid out before block 1)."""
    make = MODELS[fragment_by]
    together = trajectories(
        streaming(fragments=fragments, delay=0, stagger=False, fragment_by=fragment_by), make=make
    )
    assert_same(together, trajectories(DiLoCoConfig(**OUTER), make=make))
    assert together[0][1].outer_steps == fragments * ROUNDS


def test_staggered_fragments_synchronize_in_turn():
    """Four fragments at offsets 0, 1, 2, 3 of rounds of H = 4: after c steps only fragment c mod 4 (the one
    synchronized then, delay 0; fragment p > 0 first after p steps) differs from the optimizer's step, and
    every worker holds the same values there."""
    ranks = trajectories(streaming(fragments=4, delay=0))
    rule = ranks[0][1]
    for step in range(H * ROUNDS):
        p = (step + 1) % H
        lo, hi = rule.bounds[0][p], rule.bounds[0][p + 1]
        for seen, _ in ranks:
            changed = (seen[step, "synced"] != seen[step, "stepped"]).nonzero().view(-1)
            assert changed.numel() > 0 and lo <= int(changed.min()) and int(changed.max()) < hi, step
            assert torch.equal(seen[step, "synced"][lo:hi], ranks[0][0][step, "synced"][lo:hi])


@pytest.mark.parametrize("delay", [1, 2])
def test_the_delay_applies_the_outer_step_that_many_steps_later(delay):
    """One fragment, delay τ: after a round's last step the parameters are the optimizer's (the exchange is in
    flight), τ steps later x_start is the outer step of the round's end points (computed by hand) and, with
    α = 0, the parameters are x_start; the trajectory differs from DiLoCo's between."""
    cfg = streaming(fragments=1, delay=delay)
    ranks = trajectories(cfg)
    expected = outer_by_hand(ranks, cfg, H * ROUNDS)
    diloco = trajectories(DiLoCoConfig(**OUTER))
    for seen, _ in ranks:
        for k, last in enumerate(range(H - 1, H * ROUNDS - delay, H)):
            for step in range(last, last + delay):
                assert torch.equal(seen[step, "synced"], seen[step, "stepped"]), (last, step)
            assert_close(seen[last + delay, "synced"], expected[k][0])
    assert (ranks[0][0][H - 1, "synced"] - diloco[0][0][H - 1, "synced"]).abs().max() > 1e-3


def test_fragment_alpha_mixes_the_local_parameters_in():
    """α = 0.5, delay 1: at the apply x = 0.5·x(now) + 0.5·x_start, x(now) being the optimizer's step."""
    cfg = streaming(fragments=1, delay=1, fragment_alpha=0.5)
    ranks = trajectories(cfg)
    starts = outer_by_hand(ranks, cfg, H * ROUNDS)
    for seen, _ in ranks:
        for k, apply in enumerate(range(H, H * ROUNDS, H)):
            assert_close(seen[apply, "synced"], 0.5 * seen[apply, "stepped"] + 0.5 * starts[k][0])
    assert (ranks[0][0][H, "synced"] - ranks[1][0][H, "synced"]).abs().max() > 1e-4, "α kept nothing local"


def test_batchnorm_statistics_travel_with_fragment_0_and_become_the_mean():
    """Rounds of 2 in 2 fragments, no delay: after fragment 0's sync (even step counts) every worker's
    statistics are the workers' mean of theirs before it; after fragment 1's they are each worker's own."""

    def main(comm):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
        optimizer = sgd(model, momentum=0.9)
        rule = build(comm, streaming(inner_steps=2, fragments=2, delay=0), model, optimizer)
        out = []

        def record(step, stage):
            out.append(model[1].running_mean.clone())

        fit(rule, model, optimizer, batches(comm.rank, 6), record)
        return out

    ranks = FakeWorld(N).run(main)
    for step in range(6):
        stepped, synced = [r[2 * step] for r in ranks], [r[2 * step + 1] for r in ranks]
        if (step + 1) % 2:
            assert (synced[0] - synced[1]).abs().max() > 1e-4, f"step {step}: averaged off fragment 0"
            continue
        for s in synced:
            assert torch.equal(s, synced[0])
        assert_close(synced[0], sum(stepped) / N)


def _one_round(comm, cfg, counted: str = "bytes_sent"):
    """H steps of a 4096-value float32 layer on rank ``comm`` under ``cfg``: the rule, and how much its
    ``counted`` statistic grew in them (the build's broadcast excluded)."""
    torch.manual_seed(comm.rank)
    model = nn.Linear(64, 64, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rule = build(comm, cfg, model, optimizer)
    before = getattr(comm.stats, counted)
    for step in range(cfg.inner_steps):
        optimizer.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
        rule.after_step(step)
    rule.finish()
    return rule, getattr(comm.stats, counted) - before


def _one_round_bytes(cfg, n: int = 4) -> list[int]:
    """The bytes each rank sent in H steps of a 4096-value float32 layer (the build's broadcast excluded)."""

    def main(comm):
        rule, sent = _one_round(comm, cfg)
        return sent, getattr(rule, "sync_bytes_peak", None)

    return FakeWorld(n).run(main)


@pytest.mark.parametrize("quantize, most", [("none", 1.0), ("int8", 0.27)])
def test_one_synchronization_sends_a_fragment_of_diloco_bytes(quantize, most):
    """4 workers, 4 fragments: one fragment's exchange is 1/4 of DiLoCo's round exchange (float32: exactly;
    8 bits: about a quarter of that again), counted by the communicator and reported as sync_bytes_peak; the
    workers' counts include it."""
    [(diloco, _), *_] = _one_round_bytes(DiLoCoConfig(inner_steps=4))
    assert diloco == 4096 * 4 * 2 * 3 // 4
    for sent, peak in _one_round_bytes(
        StreamingDiLoCoConfig(inner_steps=4, fragments=4, delay=0, quantize=quantize)
    ):
        assert sent == 4 * peak, "four fragments synchronized once each"
        assert peak <= most * diloco / 4 * 1.0001
    assert peak >= 0.25 * diloco / 4


def test_int8_allreduce_is_close_to_the_sum_and_the_same_on_every_rank():
    """Every rank ends with the same bits; the error is within half a step of each of the two quantizations
    (the contributions', then the sum's: |x|max/254 per block of 128)."""
    numel = 3 * BLOCK * 4 + 17  # padded to whole blocks per rank's chunk

    def data(rank):
        g = torch.Generator().manual_seed(rank)
        return torch.randn(numel, generator=g) * (1 + torch.arange(numel) / 100)

    def main(comm):
        t = data(comm.rank)
        int8_allreduce(comm, t, BLOCK)
        return t, comm.stats.bytes_sent

    ranks = FakeWorld(4).run(main)
    exact = sum(data(r) for r in range(4))
    for got, _ in ranks:
        assert torch.equal(got, ranks[0][0])
    step_in = sum(data(r).abs().max() for r in range(4)) / 254
    error = (ranks[0][0] - exact).abs().max()
    assert 0 < error <= step_in + exact.abs().max() / 254
    assert (ranks[0][0] - exact).mean().abs() < 0.1 * error, "rounding to the nearest step is unbiased"
    chunk = 4 * BLOCK  # ceil(1553 / (4·128)) blocks of 128 per rank
    assert ranks[0][1] == 2 * 3 * (chunk + 4 * chunk // BLOCK)


def test_int8_training_keeps_the_workers_together_and_close_to_float32():
    ranks = trajectories(streaming(fragments=2, delay=1, quantize="int8"))
    exact = trajectories(streaming(fragments=2, delay=1))
    last = H * ROUNDS - 1
    starts = [torch.cat(rule.start) for _, rule in ranks]
    assert all(torch.equal(s, starts[0]) for s in starts)
    gap = (starts[0] - torch.cat(exact[0][1].start)).abs().max()
    assert 0 < gap < 1e-2, gap
    assert (ranks[0][0][last, "synced"] - params(mlp())).abs().max() > 1e-2, "did not train"


@pytest.mark.parametrize("quantize", ["none", "int8"])
def test_checkpoint_with_an_exchange_in_flight_resumes_exactly(quantize):
    """Rounds of 4 in 2 fragments (offsets 0, 2), delay 2: at CUT = 3 fragment 1's exchange of step 2 is in
    flight (due at 4). The checkpoint completes it and saves its result; resumed, every rank ends where the
    uninterrupted run did."""
    cfg = streaming(fragments=2, delay=2, quantize=quantize)
    whole = train(FakeWorld(N), cfg, cut=CUT)
    saved = [_tensors(s) for _, s, _ in whole]
    assert all([(e["fragment"], e["due"]) for e in s["rule"]["pending"]] == [(1, 4)] for s in saved)
    resumed = train(FakeWorld(N), cfg, start=saved)
    for rank, ((p_whole, _, s_whole), (p_resumed, _, s_resumed)) in enumerate(
        zip(whole, resumed, strict=True)
    ):
        assert torch.equal(p_whole, p_resumed), f"rank {rank}: parameters differ"
        for key in ("start", "momentum"):
            assert all(torch.equal(a, b) for a, b in zip(s_whole[key], s_resumed[key], strict=True)), key
        assert s_whole["outer_steps"] == s_resumed["outer_steps"] == 3


def test_recover_forgets_the_exchanges_in_flight_and_restarts_from_worker_0s_start():
    def main(comm):
        model = nn.Sequential(nn.Linear(5, 4), nn.BatchNorm1d(4)).to(DT)
        rule = build(comm, streaming(fragments=2, delay=2), model, sgd(model))
        fit(rule, model, sgd(model), batches(comm.rank, 3))  # fragment 1's exchange (step 2) in flight
        assert [e.fragment for e in rule.pending] == [1]
        with torch.no_grad():
            model[1].running_mean.fill_(float(comm.rank))
            for t in [*rule.start, *rule.momentum]:
                t.add_(comm.rank + 1.0)
        rule.steps += comm.rank
        rule.abandon()
        before = rule.link
        rule.recover()
        links = [before, rule.link]
        rule.finish()
        return params(model), torch.cat(rule.start), rule, model[1].running_mean, links

    ranks = FakeWorld(N).run(main)
    x0 = ranks[0][1]
    for x, start, rule, stats, links in ranks:
        assert torch.equal(x, x0) and torch.equal(start, x0)
        assert rule.pending == [] and rule.steps == 3
        assert torch.equal(stats, torch.ones(4, dtype=DT))
        assert links[0] is not links[1], "the exchanges' communicator (and its thread) is made anew"
        assert all(link.background_ended for link in links), "the one replaced, and the new one at the end"


@pytest.mark.parametrize(
    "overrides, key, hint",
    [
        (["rule.fragments=0"], "rule.fragments", "1 to inner_steps=10"),
        (["rule.fragments=11"], "rule.fragments", "1 to inner_steps=10"),
        (["rule.delay=10"], "rule.delay", "0 to inner_steps-1=9"),
        (["rule.delay=-1"], "rule.delay", "0 to inner_steps-1=9"),
        (["rule.fragment_alpha=1"], "rule.fragment_alpha", "[0, 1)"),
        (["rule.quantize=fp4"], "rule.quantize", "none, int8"),
        (["rule.quantize=int8", "rule.comm_dtype=bf16"], "rule.quantize", "rule.comm_dtype=fp32"),
        (["rule.outer_momentum=1"], "rule.outer_momentum", "[0, 1)"),
        (["rule.fragment_by=layers"], "rule.fragment_by", "size, blocks"),
    ],
)
def test_bad_values_name_their_key_and_the_fix(overrides, key, hint):
    with pytest.raises(ValueError, match=re.escape(key) + ".*" + re.escape(hint)):
        checked_config(["rule=streaming_diloco", *overrides])


def test_defaults_validate():
    rule = checked_config(["rule=streaming_diloco", "devices=4"]).rule
    assert isinstance(rule, StreamingDiLoCoConfig)
    assert (rule.inner_steps, rule.fragments, rule.delay, rule.fragment_alpha) == (10, 4, 1, 0.0)
    assert (rule.quantize, rule.stagger, rule.outer_lr, rule.outer_momentum) == ("none", True, 0.7, 0.5)
    assert rule.fragment_by == "size"


# -- mpirun jobs ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.mpi
def test_one_fragment_without_delay_equals_diloco_under_mpirun(cli):
    """The exchanges on their own communicator and thread, through real MPI: 2 ranks in rounds of 3 steps,
    every rank's model and the reported one bit for bit DiLoCo's; with 3 fragments in 8 bits the job trains
    and reports the peak bytes of one exchange."""
    overrides = ["model=mlp", "devices=2", "train.batch_size=8", "train.save_model=all", *COMMON]
    diloco = cli("rule=diloco", "rule.inner_steps=3", *overrides)
    one = cli("rule=streaming_diloco", "rule.inner_steps=3", "rule.fragments=1", "rule.delay=0", *overrides)
    int8 = cli(
        "rule=streaming_diloco", "rule.inner_steps=3", "rule.fragments=3", "rule.quantize=int8", *overrides
    )
    assert diloco.returncode == 0 and one.returncode == 0, diloco.output + one.output
    assert one.summary["outer_steps"] == diloco.summary["outer_steps"] == STEPS // 3
    for name in ("model.pt", "model.rank0.pt", "model.rank1.pt"):
        ours, ref = params_of(one.dir / name), params_of(diloco.dir / name)
        assert all(torch.equal(ours[k], ref[k]) for k in ref), name
    assert int8.returncode == 0, int8.output
    assert 0 < int8.summary["sync_bytes_peak"] < one.summary["sync_bytes_peak"] / 3 / 3


def test_its_exchanges_are_the_link_communicators_background_sums_counted_with_the_workers():
    """The exchanges are its link communicator's background all-reduces (int8: with the int8 encoding),
    and that communicator shares the workers' counts and emulated links: the communicator prices and counts
    them (tests/comm/test_encodings.py) as it does every all-reduce. Before, the rule priced its own."""
    calls = []

    def main(comm):
        model = nn.Linear(5, 4).to(DT)
        rule = build(comm, streaming(fragments=2, delay=1, quantize="int8"), model, sgd(model))
        queued = rule.link.allreduce_background

        def spy(t, op="sum", wire=None, encoding=None):
            calls.append(type(encoding).__name__)
            return queued(t, op, wire, encoding)

        rule.link.allreduce_background = spy
        fit(rule, model, sgd(model), batches(comm.rank, 6))
        rule.finish()
        return rule.link.stats is comm.stats, rule.link.background_ended

    assert FakeWorld(2).run(main) == [(True, True)] * 2
    assert calls and set(calls) == {"Int8"}, calls
