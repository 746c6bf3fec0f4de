"""DeMo (runner/rules/demo.py). In process, ranks as threads on tests/helpers/fakecomm.py, float64 MLPs: with
every component extracted it is SGD on the mean gradient (rule=bsp); one step with a few kept is checked
against a hand computation (explicit cosine sums, sorted magnitudes, the 1-bit code's levels); the DCT is
orthonormal; workers stay identical; the bytes are the all-gather's; ``delay`` shifts the trajectory by its
steps; checkpoints, a lost worker, joining workers and a non-finite step. In a real mpirun job: the
extract-all settings follow rule=bsp through the command line."""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch.nn import functional as F

from runner.comm.sparse import SparseCode
from runner.rules.base import RuleContext
from runner.rules.bsp import BSPConfig
from runner.rules.demo import DeMoConfig, dct_matrix
from tests.conftest import assert_close as assert_params_close
from tests.conftest import checked_config, params_of
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import (
    DT,
    GLOBAL,
    B,
    N,
    assert_close,
    batch,
    build,
    fit,
    mlp,
    params,
    plain,
    sgd,
    shard,
    vector,
)
from tests.rank.test_checkpoint import CUT, _tensors, train

LR = 0.1
#: Every component extracted each step, exact and applied as it is: SGD on the workers' mean gradient.
ALL = {"topk": 64, "bits": 32, "sign": False}


def local_grads(model: torch.nn.Module, rank: int, n: int = N, step: int = 0) -> torch.Tensor:
    """Worker ``rank``'s gradient of step ``step`` (its share of GLOBAL), flat, at ``model``'s parameters."""
    x, y = GLOBAL[step]
    model.zero_grad()
    F.cross_entropy(model(x[rank::n]), y[rank::n]).backward()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def momentum(rule) -> torch.Tensor:
    return torch.cat([b.momentum for b in rule.buffers])


# -- the DCT -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 8, 64])
def test_the_dct_is_orthonormal_dct_ii(n):
    """D·Dᵀ = I, and D·x is the DCT-II with the orthonormal scaling (scipy's ``norm="ortho"``)."""
    scipy_fft = pytest.importorskip("scipy.fft")
    d = dct_matrix(n, DT)
    assert_close((d @ d.T).reshape(-1), torch.eye(n, dtype=DT).reshape(-1))
    x = torch.randn(n, dtype=DT, generator=torch.Generator().manual_seed(n))
    assert_close(d @ x, torch.from_numpy(scipy_fft.dct(x.numpy(), norm="ortho")))


# -- the update's math -------------------------------------------------------------------------------------
@pytest.mark.parametrize("chunk", [64, 16])
def test_extracting_every_component_is_sgd_on_the_mean_gradient_as_bsp(chunk):
    """topk = chunk, 32 bits, no sign, no delay: the momentum is emptied each step (to rounding) and every
    worker steps with the mean gradient, which is rule=bsp with plain SGD (66 values: the last chunk
    padded, chunks straddling tensors)."""
    cfg = DeMoConfig(**{**ALL, "topk": chunk, "chunk": chunk}, beta=0.9)

    def main(comm):
        model = mlp()
        optimizer = sgd(model, lr=LR)
        rule = build(comm, cfg, model, optimizer)
        left = []
        fit(rule, model, optimizer, shard(comm.rank), lambda step, stage: left.append(momentum(rule)))
        return params(model), left

    def bsp(comm):
        model = mlp()
        optimizer = sgd(model, lr=LR)
        fit(build(comm, BSPConfig(overlap="none"), model, optimizer), model, optimizer, shard(comm.rank))
        return params(model)

    ref = FakeWorld(N).run(bsp)[0]
    assert_close(ref, plain(mlp(), GLOBAL, lr=LR))
    assert (ref - params(mlp())).abs().max() > 1e-2, "the reference did not move: this would prove nothing"
    for got, left in FakeWorld(N).run(main):
        assert_close(got, ref)
        assert all(m.abs().max() <= 1e-12 for m in left)


def dct_by_hand(x: torch.Tensor, c: int) -> torch.Tensor:
    """The orthonormal DCT-II of each chunk of c values of ``x`` (zero-padded), by its cosine sums."""
    rows = torch.cat([x, x.new_zeros(-x.numel() % c)]).view(-1, c)
    out = torch.zeros_like(rows)
    for k in range(c):
        scale = math.sqrt((1 if k == 0 else 2) / c)
        for j in range(c):
            out[:, k] += scale * math.cos(math.pi * (2 * j + 1) * k / (2 * c)) * rows[:, j]
    return out


def idct_by_hand(coefficients: torch.Tensor, numel: int) -> torch.Tensor:
    """The inverse (the transposed sums) of each row, flat, cut to ``numel``."""
    c = coefficients.shape[1]
    out = torch.zeros_like(coefficients)
    for j in range(c):
        for k in range(c):
            scale = math.sqrt((1 if k == 0 else 2) / c)
            out[:, j] += scale * math.cos(math.pi * (2 * j + 1) * k / (2 * c)) * coefficients[:, k]
    return out.reshape(-1)[:numel]


def keep_largest(coefficients: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's k largest |values| (by a full sort), the others 0."""
    kept = torch.zeros_like(coefficients)
    for r, row in enumerate(coefficients):
        order = sorted(range(len(row)), key=lambda j: -abs(float(row[j])))[:k]
        kept[r, order] = row[order]
    return kept


def one_bit(kept: torch.Tensor, k: int) -> torch.Tensor:
    """What a 1-bit code of ``kept`` (k values a chunk) decodes to: each kept value's sign times its chunk's
    mean |kept|, a float32 scale (rounded once here; the code's float32 mean may differ in the last bit,
    which no sign taken below depends on)."""
    scale = (kept.abs().float().double().sum(1) / k).float().double()
    return torch.where(kept != 0, torch.where(kept < 0, -1.0, 1.0) * scale[:, None], 0.0)


@pytest.mark.parametrize("bits, sign", [(32, True), (32, False), (1, True)])
def test_one_step_with_a_few_kept_by_hand(bits, sign):
    """Chunks of 8, 3 kept, β = 0.5, every worker's momentum starting non-zero (its own): the DCT by its
    cosine sums, the 3 largest by a sort, the momentum left, the workers' mean and the update, all by hand."""
    c, k, beta = 8, 3, 0.5
    cfg = DeMoConfig(chunk=c, topk=k, beta=beta, bits=bits, sign=sign)
    start = params(mlp())
    numel = start.numel()

    def before(rank: int) -> torch.Tensor:
        return torch.linspace(-1, 1, numel, dtype=DT) * (rank + 1) * 0.1

    def main(comm):
        model = mlp()
        optimizer = sgd(model, lr=LR)
        rule = build(comm, cfg, model, optimizer)
        rule.buffers[0].momentum.copy_(before(comm.rank))
        fit(rule, model, optimizer, [shard(comm.rank)[0]])
        return params(model), momentum(rule), torch.cat([p.grad.reshape(-1) for p in model.parameters()])

    coded, left = [], []
    for r in range(N):
        m = beta * before(r) + local_grads(mlp(), r)
        coefficients = dct_by_hand(m, c)
        kept = keep_largest(coefficients, k)
        assert ((kept != 0).sum(1) == k).all()
        left.append(m - idct_by_hand(kept, numel))
        coded.append(kept if bits == 32 else one_bit(kept, k))
    q = idct_by_hand(sum(coded) / N, numel)
    direction = q.sign() if sign else q
    for r, (x, m, grad) in enumerate(FakeWorld(N).run(main)):
        assert_close(m, left[r])
        assert_close(grad, direction)
        assert_close(x, start - LR * direction)
    assert (left[0] - left[1]).abs().max() > 1e-3, "each worker's momentum is its own"


def test_workers_hold_the_same_parameters_after_every_step_and_their_own_momentum():
    """The defaults (8 of 64, 1-bit signs, sign updates), each rank its own data and its own initial model
    (replaced by worker 0's at build): equal parameters after every step, different momenta."""
    steps = 5

    def main(comm):
        model = mlp(seed=comm.rank)
        optimizer = sgd(model, lr=0.01)
        rule = build(comm, DeMoConfig(), model, optimizer)
        seen = []
        data = [batch(B, seed=100 * comm.rank + s) for s in range(steps)]
        fit(rule, model, optimizer, data, lambda step, stage: seen.append(params(model)))
        return seen, momentum(rule)

    ranks = FakeWorld(N).run(main)
    for seen, _ in ranks:
        assert all(torch.equal(a, b) for a, b in zip(seen, ranks[0][0], strict=True))
    moved = (ranks[0][0][0] - params(mlp(0))).abs()
    assert_close(moved, torch.full_like(moved, 0.01)), "a sign update moves every parameter by lr"
    assert not torch.equal(ranks[0][1], ranks[1][1])


@pytest.mark.parametrize("cfg", [DeMoConfig(), DeMoConfig(bits=32, topk=8), DeMoConfig(bits=2, chunk=32)])
def test_bytes_per_step_are_an_all_gather_of_the_code_and_grow_with_n(cfg):
    """Each worker sends its code to the N − 1 others each step: (N − 1) × its bytes, 3 times as much with 4
    workers as with 2 (BSP's all-reduce: 2(N − 1)/N of the buffer, 1.5 times). The start's broadcast of
    worker 0's model is not counted here."""
    steps, numel = 3, params(mlp()).numel()
    code = SparseCode(cfg.chunk, cfg.topk, cfg.bits)
    payload = code.nbytes(numel, itemsize=8)
    assert payload == code.encode(torch.zeros(numel, dtype=DT))[0].numel()

    def sent(n: int) -> list[int]:
        def main(comm):
            model = mlp()
            optimizer = sgd(model, lr=0.01)
            rule = build(comm, cfg, model, optimizer)
            before = comm.stats.bytes_sent
            fit(rule, model, optimizer, shard(comm.rank, n)[:steps])
            assert rule.code_bytes == payload
            return comm.stats.bytes_sent - before

        return FakeWorld(n).run(main)

    two, four = sent(2), sent(4)
    assert two == [steps * 1 * payload] * 2 and four == [steps * 3 * payload] * 4
    if cfg.bits == 1:  # 66 values, 2 chunks: 16 one-byte offsets, 16 sign bits, 2 float32 scales
        assert payload == 16 + 2 + 2 * 4
    elif cfg.bits == 32:  # 8 offsets and 8 float64 values per chunk
        assert payload == 2 * 8 * (1 + 8)


def test_one_worker_keeps_what_it_does_not_send_and_sends_nothing():
    """Alone, the worker still extracts only its top k (its momentum is not emptied) and sends no byte."""
    world = FakeWorld(1)

    def main(comm):
        model = mlp()
        optimizer = sgd(model, lr=0.01)
        rule = build(comm, DeMoConfig(), model, optimizer)
        fit(rule, model, optimizer, GLOBAL)
        return momentum(rule), comm.stats.bytes_sent

    left, sent = world.run(main)[0]
    assert left.abs().max() > 1e-3 and sent == 0 and world.messages == 0


def test_bf16_coefficients_halve_the_bytes_and_follow_float32():
    """``bits: 32`` with ``comm_dtype: bf16`` (every coefficient, no offsets): half the bytes of float32, the
    parameters within bf16's rounding of the float32 run, and alike on every worker."""

    def run(wire: str):
        def main(comm):
            model = mlp().float()
            optimizer = sgd(model, lr=LR)
            rule = build(comm, DeMoConfig(**ALL, comm_dtype=wire), model, optimizer)
            before = comm.stats.bytes_sent
            fit(rule, model, optimizer, [(x.float(), y) for x, y in shard(comm.rank)])
            assert rule.code_bytes == SparseCode(64, 64, 32).nbytes(66, itemsize=4 if wire == "fp32" else 2)
            return params(model), comm.stats.bytes_sent - before

        return FakeWorld(N).run(main)

    full, half = run("fp32"), run("bf16")
    code = SparseCode(64, 64, 32).nbytes(66, itemsize=2)
    for (x_full, sent_full), (x_half, sent_half) in zip(full, half, strict=True):
        assert sent_half == len(GLOBAL) * (N - 1) * code and sent_full == 2 * sent_half
        assert not torch.equal(x_full, x_half) and torch.allclose(x_full, x_half, atol=1e-2)
        assert torch.equal(x_half, half[0][0])


# -- delay -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("delay", [1, 2])
def test_delay_applies_each_direction_delay_steps_late(delay):
    """A linear loss (gradients that do not depend on the parameters: the same exchanges whatever the
    parameters): with ``delay`` d the parameters after step t are those of delay 0 after step t − d, and the
    first d steps apply nothing."""
    steps = 6

    def run(d: int) -> list[torch.Tensor]:
        def main(comm):
            model = vector(*([0.5] * 70))
            optimizer = sgd(model, lr=LR)
            rule = build(comm, DeMoConfig(chunk=16, topk=2, delay=d), model, optimizer)
            a = torch.randn(70, dtype=DT, generator=torch.Generator().manual_seed(comm.rank))
            seen = []
            for step in range(steps):
                optimizer.zero_grad(set_to_none=False)
                (model.weight[0] * a).sum().backward()
                rule.after_backward(step)
                optimizer.step()
                rule.after_step(step)
                seen.append(params(model))
            return seen

        return FakeWorld(N).run(main)[0]

    late, now = run(delay), run(0)
    start = params(vector(*([0.5] * 70)))
    for t in range(steps):
        assert torch.equal(late[t], start if t < delay else now[t - delay]), t


# -- checkpoints, lost and joining workers, non-finite steps ----------------------------------------------
def test_checkpoint_with_a_delayed_direction_in_flight_resumes_exactly():
    """Cut after step CUT with ``delay`` 1 (tests/rank/test_checkpoint.py's harness): the momenta and the
    direction not yet applied are saved, and the resumed run ends bit for bit where the whole one did."""
    cfg = DeMoConfig(delay=1, topk=3, chunk=16)
    whole = train(FakeWorld(N), cfg, cut=CUT)
    saved = [_tensors(s) for _, s, _ in whole]
    assert all(s["rule"]["pending"][0].abs().max() > 0 for s in saved)
    resumed = train(FakeWorld(N), cfg, start=saved)
    for (p_whole, _, s_whole), (p_resumed, _, s_resumed) in zip(whole, resumed, strict=True):
        assert torch.equal(p_whole, p_resumed)
        for key in ("momentum", "pending"):
            assert all(torch.equal(a, b) for a, b in zip(s_whole[key], s_resumed[key], strict=True))
        assert s_whole["exchanges"] == s_resumed["exchanges"] == 8


def test_after_a_lost_worker_the_survivors_apply_the_direction_in_flight_then_their_own_mean():
    """3 workers take 2 steps with ``delay`` 1; workers 0 and 1 go on alone (their states taken into a world
    of 2, as the shrunk communicator gives them) and recover: the next step applies the direction the 3 had
    exchanged (in flight), and queues the sign of the 2 survivors' mean, computed from their own momenta."""
    cfg = DeMoConfig(delay=1, topk=3, chunk=16, beta=0.9)

    def before(comm):
        model = mlp()
        optimizer = sgd(model, lr=LR)
        rule = build(comm, cfg, model, optimizer)
        fit(rule, model, optimizer, shard(comm.rank)[:2])
        return model.state_dict(), rule.state_dict()

    states = FakeWorld(3).run(before)

    def after(comm):
        model = mlp()
        optimizer = sgd(model, lr=LR)
        rule = build(comm, cfg, model, optimizer)
        model.load_state_dict(states[comm.rank][0])
        rule.load_state_dict(states[comm.rank][1])
        rule.recover()
        x = params(model)
        kept = momentum(rule).clone()
        fit(rule, model, optimizer, [shard(comm.rank, 2)[2]])
        return x, kept, params(model), rule.buffers[0].pending[0].clone()

    survivors = FakeWorld(2).run(after)
    in_flight = states[0][1]["pending"][0][0]
    coded = []
    for r, (x, kept, _, _) in enumerate(survivors):
        assert torch.equal(kept, states[r][1]["momentum"][0]), "each momentum stays its own"
        m = cfg.beta * kept + local_grads(mlp_at(x), r, n=2, step=2)
        coded.append(one_bit(keep_largest(dct_by_hand(m, 16), 3), 3))
    queued = idct_by_hand(sum(coded) / 2, x.numel()).sign()
    for x, _, after_step, pending in survivors:
        assert torch.equal(x, survivors[0][0])
        assert_close(after_step, x - LR * in_flight)
        assert_close(pending, queued)


def mlp_at(x: torch.Tensor) -> torch.nn.Module:
    model = mlp()
    torch.nn.utils.vector_to_parameters(x.clone(), model.parameters())
    return model


def test_joining_workers_take_worker_0s_model_and_delayed_direction_with_an_empty_momentum():
    """2 workers train 2 steps (``delay`` 1), then 2 more join (built alone, given worker 0's states, as
    runner/rank/resilience/elastic.py does): the joined start with no momentum, the others keep theirs, all
    hold the same direction in flight, and they step together."""
    cfg = DeMoConfig(delay=1)

    def phase1(comm):
        model = mlp()
        optimizer = sgd(model, lr=0.01)
        rule = build(comm, cfg, model, optimizer)
        fit(rule, model, optimizer, shard(comm.rank, 2)[:2])
        return model.state_dict(), optimizer.state_dict(), rule.state_dict()

    states = FakeWorld(2).run(phase1)

    def grown(comm):
        joined = comm.rank >= 2
        model = mlp(seed=comm.rank)
        optimizer = sgd(model, lr=0.01)
        rule = cfg.build(RuleContext(comm, comm, model, optimizer, joined=True))  # (the others keep theirs)
        mine = states[0 if joined else comm.rank]
        model.load_state_dict(mine[0])
        optimizer.load_state_dict(mine[1])
        rule.load_state_dict(mine[2])
        rule.grow(joined)
        kept, pending = momentum(rule).clone(), rule.buffers[0].pending.clone()
        fit(rule, model, optimizer, [shard(comm.rank, 4)[2]])
        return kept, pending, params(model)

    ranks = FakeWorld(4).run(grown)
    for r, (kept, pending, x) in enumerate(ranks):
        assert torch.equal(kept, states[r][2]["momentum"][0] if r < 2 else torch.zeros_like(kept))
        assert torch.equal(pending, states[0][2]["pending"][0]) and torch.equal(x, ranks[0][2])


@pytest.mark.parametrize("delay", [0, 1])
def test_a_non_finite_gradient_on_one_worker_is_seen_by_all_and_changes_no_state(delay):
    """Worker 1's gradient is NaN (the loop's poisoned loss): every worker's applied direction is NaN, so the
    loop's guard skips the step (or stops) everywhere alike, also with ``delay``; momenta and directions in
    flight stay as they were."""

    def main(comm):
        model = mlp()
        optimizer = sgd(model, lr=0.01)
        rule = build(comm, DeMoConfig(delay=delay), model, optimizer)
        fit(rule, model, optimizer, shard(comm.rank)[:1])
        state = rule.state_dict()
        optimizer.zero_grad(set_to_none=False)
        poison = float("nan") if comm.rank == 1 else 1.0
        (
            F.cross_entropy(model(GLOBAL[1][0][comm.rank :: N]), GLOBAL[1][1][comm.rank :: N]) * poison
        ).backward()
        rule.after_backward(1)
        return state, rule.state_dict(), rule.grad_buffers()

    for state, after, grads in FakeWorld(N).run(main):
        assert all(g.isnan().all() for g in grads)
        for key in ("momentum", "pending"):
            assert all(torch.equal(a, b) for a, b in zip(state[key], after[key], strict=True)), key


# -- the schema ---------------------------------------------------------------------------------------------
SGD0 = ["optim.momentum=0", "optim.lr=0.001"]


@pytest.mark.parametrize(
    "overrides, key, hint",
    [
        (["rule.beta=1"], "rule.beta", "[0, 1)"),
        (["rule.chunk=0"], "rule.chunk", "1..32768"),
        (["rule.topk=65"], "rule.topk", "1..rule.chunk=64"),
        (["rule.bits=8"], "rule.bits", "1 (signs"),
        (["rule.delay=-1"], "rule.delay", ">= 0"),
        (["rule.comm_dtype=bf16"], "rule.comm_dtype", "rule.bits=32"),
    ],
)
def test_bad_values_name_their_key_and_the_fix(overrides, key, hint):
    with pytest.raises(ValueError, match=re.escape(key) + ".*" + re.escape(hint)):
        checked_config(["rule=demo", *SGD0, *overrides])


@pytest.mark.parametrize(
    "overrides, key",
    [
        ([], "optim.momentum=0.9"),
        (["optim=adam"], "optim='AdamConfig'"),
        (["optim.nesterov=true"], "momentum"),
    ],
)
def test_the_optimizer_must_be_plain_sgd_and_the_hint_says_how(overrides, key):
    """DeMo holds the momentum: the default job's SGD (momentum 0.9) is refused at launch, naming the fix."""
    with pytest.raises(ValueError, match=re.escape(key) + r".*optim=sgd optim.momentum=0.*optim.lr=0.001"):
        checked_config(["rule=demo", *overrides])


def test_defaults_validate_with_plain_sgd():
    checked = checked_config(["rule=demo", *SGD0, "optim.weight_decay=0.01"])
    rule = checked.rule
    assert isinstance(rule, DeMoConfig)
    assert (rule.beta, rule.chunk, rule.topk, rule.sign, rule.bits, rule.delay) == (0.999, 64, 8, True, 1, 0)
    assert checked_config(["rule=demo", *SGD0, "rule.bits=32", "rule.comm_dtype=bf16"]).rule.bits == 32


# -- mpirun job ---------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.mpi
def test_extract_all_settings_follow_bsp_under_mpirun(cli):
    """test_extracting_every_component_is_sgd_on_the_mean_gradient_as_bsp through the command line: 2 ranks,
    6 steps of the MLP, plain SGD; every rank's model as BSP's (float32 rounding)."""
    overrides = ["model=mlp", "devices=2", "train.batch_size=8", "train.save_model=all", "train.epochs=1"]
    overrides += ["train.max_steps=6", "optim.lr=0.1", "optim.momentum=0"]
    demo = cli("rule=demo", "rule.topk=64", "rule.bits=32", "rule.sign=false", *overrides)
    bsp = cli("rule=bsp", *overrides)
    assert demo.returncode == 0 and bsp.returncode == 0, demo.output + bsp.output
    assert demo.summary["exchanges"] == 6
    for name in ("model.pt", "model.rank0.pt", "model.rank1.pt"):
        assert_params_close(params_of(demo.dir / name), params_of(bsp.dir / name), atol=1e-6)
