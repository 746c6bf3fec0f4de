"""Streaming DiLoCo's ``fragment_by=blocks`` (runner/rules/fragments.py) on a small float64 GPT (4 blocks, 2
fragments), in process: ranks are threads talking through FakeWorld, whose collectives really reduce. The
flat layout by fragments, each fragment's outer step on its own parameters only, the bytes of fragments of
unequal size, a resumption with an exchange in flight, and the refusals."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch.nn import functional as F

from models.cnn import CNNConfig
from models.gpt import GPTConfig
from runner.rules.streaming_diloco import StreamingDiLoCoConfig
from tests.conftest import checked_config
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import DT, assert_close, build, sgd

N, H, FRAGMENTS, VOCAB, T = 3, 4, 2, 11, 8
OUTER = {"inner_steps": H, "outer_lr": 0.7, "outer_momentum": 0.9, "fragments": FRAGMENTS}


@functools.cache
def gpt() -> torch.nn.Module:
    """The one GPT drawn (seed 0, the global generator left as it was); the ranks train copies of it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPTConfig([T], VOCAB, VOCAB, n_layer=4, n_head=2, n_embd=8).build().to(DT)


def copies(n: int = N) -> list[torch.nn.Module]:
    """One copy of :func:`gpt` per rank, made before the rank threads start."""
    return [copy.deepcopy(gpt()) for _ in range(n)]


def blocks(**kw) -> StreamingDiLoCoConfig:
    return StreamingDiLoCoConfig(**{**OUTER, "fragment_by": "blocks", **kw})


def expected_fragment(name: str) -> int:
    """Block b (``h.b.*``) in fragment b mod 2; the embeddings (the head is tied to wte) and ln_f in 0."""
    return int(name.split(".")[1]) % FRAGMENTS if name.startswith("h.") else 0


def named(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def step(model, optimizer, rank: int, s: int) -> None:
    g = torch.Generator().manual_seed(100 * rank + s)
    x, y = torch.randint(0, VOCAB, (4, T), generator=g), torch.randint(0, VOCAB, (4, T), generator=g)
    optimizer.zero_grad()
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    optimizer.step()


def test_fragment_p_is_one_range_of_blocks_p_and_p_plus_2():
    """Fragment 0's range of the flat buffer holds exactly wte, wpe, ln_f and blocks 0 and 2; fragment 1's
    blocks 1 and 3: every parameter lies inside its fragment's bounds, and they fill them."""

    models = copies(1)

    def main(comm):
        model = models[comm.rank]
        rule = build(comm, blocks(), model, sgd(model))
        [buffer], [bounds] = rule.flat.buffers, rule.bounds
        held: dict[int, set[str]] = {0: set(), 1: set()}
        for name, p in model.named_parameters():
            at = (p.data_ptr() - buffer.data_ptr()) // p.element_size()
            p_of = [f for f in range(FRAGMENTS) if bounds[f] <= at and at + p.numel() <= bounds[f + 1]]
            assert len(p_of) == 1, name
            held[p_of[0]].add(name)
        sizes = [sum(dict(model.named_parameters())[n].numel() for n in held[f]) for f in held]
        rule.finish()
        return held, sizes, bounds

    held, sizes, bounds = FakeWorld(1).run(main)[0]
    names = [name for name, _ in gpt().named_parameters()]
    for f in range(FRAGMENTS):
        assert held[f] == {n for n in names if expected_fragment(n) == f}
        assert sizes[f] == bounds[f + 1] - bounds[f]
    assert {"wte.weight", "wpe.weight", "ln_f.weight"} <= held[0]
    assert sizes[0] > sizes[1], "fragment 0 also holds the embeddings: fragments of unequal size"


def test_each_sync_takes_the_outer_step_on_its_fragments_blocks_only():
    """No delay, offsets 0 and 2: after steps 2, 6, 10 fragment 1 (blocks 1, 3), after 4, 8, 12 fragment 0
    (blocks 0, 2 and the rest; after odd steps none) is the outer Nesterov step of the workers' mean,
    computed here by hand per parameter, equal on every worker; every other parameter stays the worker's
    own optimizer step (and differs between workers). ``sync_bytes_peak`` is fragment 0's exchange, a
    round's bytes both fragments'; the mid-round model reported is the workers' mean, by name."""
    steps, models = 3 * H, copies()

    def main(comm):
        model = models[comm.rank]
        optimizer = sgd(model, lr=0.1, momentum=0.9)
        rule = build(comm, blocks(delay=0), model, optimizer)
        seen, before = [], comm.stats.bytes_sent
        for s in range(steps):
            step(model, optimizer, comm.rank, s)
            stepped = named(model)
            rule.after_step(s)
            seen.append((stepped, named(model)))
        sent = comm.stats.bytes_sent - before
        mean = named(rule.eval_models()[""])  # fragment 1 mid-round: the workers' mean copy
        rule.finish()
        return seen, sent, rule.sync_bytes_peak, mean

    ranks = FakeWorld(N).run(main)
    start, buf, mu, lr = named(gpt()), {n: torch.zeros_like(p) for n, p in gpt().named_parameters()}, 0.9, 0.7
    for s in range(steps):
        due = {f for f, offset in enumerate((0, H // 2)) if (s + 1 - offset) % H == 0}  # (odd steps: none)
        for name in start:
            if expected_fragment(name) in due:
                delta = start[name] - sum(r[0][s][0][name] for r in ranks) / N
                buf[name] = mu * buf[name] + delta
                start[name] = start[name] - lr * (delta + mu * buf[name])
                for seen, *_ in ranks:
                    assert_close(seen[s][1][name], start[name])
                assert (ranks[0][0][s][1][name] - ranks[0][0][s][0][name]).abs().max() > 0, (s, name)
            else:
                for seen, *_ in ranks:
                    assert torch.equal(seen[s][1][name], seen[s][0][name]), (s, name)
                assert (ranks[0][0][s][1][name] - ranks[1][0][s][1][name]).abs().max() > 0, (s, name)
    sizes = [sum(p.numel() for n, p in gpt().named_parameters() if expected_fragment(n) == f) for f in (0, 1)]
    exchange = [int(n * 8 * (2 * (N - 1) / N)) for n in sizes]  # float64, an all-reduce's share per rank
    for _, sent, peak, mean in ranks:
        assert peak == exchange[0] > exchange[1]
        assert sent == 3 * sum(exchange)
        for name, p in mean.items():
            assert_close(p, sum(r[0][-1][1][name] for r in ranks) / N)


def _train(cfg, cut: int | None = None, start: list | None = None, steps: int = 2 * H):
    """Every rank trains ``steps`` steps (from ``start``: the states saved after ``cut`` steps); with ``cut``
    each rank also returns its state then, as the worker saves it (before_checkpoint, model, optimizer,
    rule)."""

    models = copies()

    def main(comm):
        model = models[comm.rank]
        optimizer = sgd(model, lr=0.1, momentum=0.9)
        rule = build(comm, cfg, model, optimizer)
        first, saved = 0, None
        if start is not None:
            mine = start[comm.rank]
            rule.load_state_dict(mine["rule"])
            model.load_state_dict(mine["model"])
            optimizer.load_state_dict(mine["optimizer"])
            first = start[comm.rank]["step"]
        for s in range(first, steps):
            step(model, optimizer, comm.rank, s)
            rule.after_step(s)
            if s + 1 == cut:
                rule.before_checkpoint(cut)
                saved = copy.deepcopy(
                    {
                        "step": cut,
                        "model": model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "rule": rule.state_dict(),
                    }
                )
        rule.finish()
        return named(model), saved, rule.state_dict()

    return FakeWorld(N).run(main)


def test_a_checkpoint_with_an_exchange_in_flight_resumes_exactly():
    """Delay 2: after 3 steps fragment 1's exchange (blocks 1 and 3, started at step 2) is in flight. The
    checkpoint (x_start, momentum and the pending sums in the blocks layout) restores into the same layout:
    resumed, every rank ends where the uninterrupted run did."""
    cfg = blocks(delay=2)
    whole = _train(cfg, cut=3)
    assert all(
        [(e["fragment"], e["due"]) for e in saved["rule"]["pending"]] == [(1, 4)] for _, saved, _ in whole
    )
    resumed = _train(cfg, start=[saved for _, saved, _ in whole])
    for (p_whole, _, s_whole), (p_resumed, _, s_resumed) in zip(whole, resumed, strict=True):
        assert all(torch.equal(p_whole[n], p_resumed[n]) for n in p_whole)
        for key in ("start", "momentum"):
            assert all(torch.equal(a, b) for a, b in zip(s_whole[key], s_resumed[key], strict=True)), key
        assert s_whole["outer_steps"] == s_resumed["outer_steps"] == 3


@pytest.mark.parametrize(
    "model, fragments, match",
    [
        ("cnn", 2, r"rule\.fragment_by='blocks' is invalid: the model \(CNN\).*set rule\.fragment_by=size"),
        ("gpt", 5, r"rule\.fragments=5 is invalid: the model has 4 blocks \(h\.0 \.\. h\.3\).*<= 4"),
    ],
)
def test_a_model_without_blocks_or_with_fewer_blocks_than_fragments_is_refused(model, fragments, match):
    """Refused at build, before any collective call: the digits CNN has no repeated blocks; the GPT has 4."""
    cfg = StreamingDiLoCoConfig(inner_steps=2 * H, fragments=fragments, fragment_by="blocks")
    net = CNNConfig([1, 8, 8], 10).build() if model == "cnn" else copies(1)[0]

    def main(comm):
        build(comm, cfg, net, sgd(net))

    with pytest.raises(ValueError, match=match):
        FakeWorld(1).run(main)


@pytest.mark.parametrize(
    "given, match",
    [
        (["model=cnn"], r"rule\.fragment_by='blocks' is invalid: the model \(CNN\)"),
        (
            [
                "model=gpt",
                "task=language_model",
                "data=synthetic",
                "data.shape=[16]",
                "data.num_classes=32",
                "model.vocab_size=32",
                "model.n_layer=2",
                "model.n_head=2",
                "model.n_embd=16",
                "model.block_size=16",
            ],
            r"rule\.fragments=4 is invalid: the model has 2 blocks",
        ),
    ],
)
def test_the_launcher_refuses_blocks_the_model_lacks_before_any_process_starts(given, match):
    rule = ["rule=streaming_diloco", "rule.fragment_by=blocks", "rule.fragments=4", "rule.inner_steps=8"]
    with pytest.raises(ValueError, match=match):
        checked_config([*rule, *given])
    checked_config([*rule, *given, "rule.fragment_by=size"])  # the same with ranges: taken


def test_bounds_follow_the_buffers_in_the_order_the_flat_tensors_meet_their_types():
    """Buffers are made per dtype in the order of first appearance in the *reordered* parameters: a model
    whose first parameter is float64 but whose fragment 0 starts with a float32 one gets float32's first."""
    import torch

    from runner.comm.flat import FlatTensors
    from runner.rules.fragments import layout

    a, b = torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.float32)
    c, d = torch.zeros(4, dtype=torch.float64), torch.zeros(5, dtype=torch.float32)
    ordered, bounds = layout([a, b, c, d], [1, 0, 0, 1], 2)
    assert [t.numel() for t in ordered] == [2, 4, 3, 5]
    flat = FlatTensors(ordered)
    assert [buf.dtype for buf in flat.buffers] == [torch.float32, torch.float64]
    assert bounds == [[0, 2, 7], [0, 4, 7]]
