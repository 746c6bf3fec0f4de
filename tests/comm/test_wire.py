"""Half-precision exchange (``rule.comm_dtype``, runner/comm/wire.py), in-process: the 16-bit all-reduce's
exact result, and every rule sending half the bytes while training like its float32 self."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from runner.comm.wire import allreduce
from runner.rules.bsp import BSPConfig
from runner.schema import schema_of
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import batch, build, mlp, params, sgd
from tests.helpers.rules import variants


@pytest.mark.parametrize("wire", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [2, 3])
def test_16_bit_allreduce_sums_rounded_contributions_in_float32(wire, n):
    """Each contribution rounded to 16 bits once, summed in float32, the sum rounded once: the same bits
    on every rank, and 2(N−1)/N·2 bytes per value sent (the chunks padded to a multiple of N)."""

    def value(rank: int) -> torch.Tensor:
        return torch.linspace(-2, 2, 10) * (rank + 1) + 1 / 3

    def main(comm):
        t = value(comm.rank)
        allreduce(comm, t, wire)
        return t, comm.stats.bytes_sent

    expected = sum(value(r).to(wire).float() for r in range(n)).to(wire).float()
    exact = sum(value(r) for r in range(n))
    for got, sent in FakeWorld(n).run(main):
        assert torch.equal(got, expected)
        assert sent == 2 * (n - 1) * -(-10 // n) * 2
    assert not torch.equal(expected, exact), "the test must see 16-bit rounding"
    assert torch.allclose(expected, exact, rtol=2**-7 if wire == torch.bfloat16 else 2**-10, atol=1e-3)


def test_16_bit_allreduce_of_float64_accumulates_in_float64():
    def main(comm):
        t = torch.full((4,), 1.0, dtype=torch.float64) + comm.rank * 2**-20
        return allreduce(comm, t, torch.bfloat16)

    for got in FakeWorld(2).run(main):
        assert got.dtype == torch.float64 and torch.equal(got, torch.full((4,), 2.0, dtype=torch.float64))


#: Per rule (tests/helpers/rules.py discovers them) and variant: (the rule's settings, steps, whether every
#: worker ends holding the same parameters); a rule not named runs its defaults for 6 steps, asynchronous
#: (bytes only). Each exchanges every step or two: DiLoCo once per round, so rounds of 2 steps and 16 steps
#: (8 outer steps, against which worker 0's float32 broadcast at the start weighs little).
SETTINGS = {
    "bsp": {
        "grads": ({"overlap": "none"}, 6, True),
        "grads-thread": ({"overlap": "thread", "bucket_mb": 1e-4}, 6, True),
        "params": ({"mode": "params", "avg_freq": 1}, 6, True),
    },
    "easgd": {
        "sync": ({"alpha": 0.3, "tau": 1}, 6, True),
        "async": ({"alpha": 0.3, "tau": 1, "variant": "async"}, 6, False),
    },
    "gosgd": {"": ({"p": 1.0}, 6, False)},
    "asgd": {"": ({"n_push": 1, "n_fetch": 1}, 16, False)},  # 16: the fetches' headers carry the staleness
    "async_diloco": {"": ({"inner_steps": 1, "dynamic_steps": False}, 16, False)},
    "diloco": {"": ({"inner_steps": 2}, 16, True)},
    "streaming_diloco": {"": ({"inner_steps": 2, "fragments": 2}, 16, False)},  # staggered: never all alike
    "desloc": {"": ({"param_period": 2}, 16, True)},
    "demo": {"": ({"topk": 64, "bits": 32, "sign": False}, 6, True)},
    "sparseloco": {"": ({"inner_steps": 2, "chunk": 64, "topk": 64, "bits": 32}, 16, True)},
    "sparta": {"all": ({"fraction": 1.0}, 6, True), "half": ({"fraction": 0.5}, 16, False)},
}


def train(cfg, n: int = 3, steps: int = 6):
    """``steps`` steps on ``n`` ranks of a float32 MLP; per rank: (parameters, bytes sent, is server, the
    parameters every worker holds alike: BSP's model, sync EASGD's center replica)."""

    def main(comm):
        model = mlp().float()
        optimizer = sgd(model, lr=0.2)
        rule = build(comm, cfg, model, optimizer)
        if rule.is_server:
            rule.serve()
            return None, comm.stats.bytes_sent, True, None
        for step in range(steps):
            x, y = batch(8, seed=100 * comm.rank + step)
            rule.before_step(step)
            optimizer.zero_grad(set_to_none=False)
            (F.cross_entropy(model(x.float()), y) * rule.loss_scale).backward()
            rule.after_backward(step)
            optimizer.step()
            rule.after_step(step)
        out = params(model)
        shared = torch.cat([c.reshape(-1) for c in rule.center.buffers]) if hasattr(rule, "center") else out
        rule.finish()
        return out, comm.stats.bytes_sent, False, shared

    return FakeWorld(n).run(main)


@pytest.mark.parametrize("rule, setting", variants(SETTINGS, default=({}, 6, False)))
def test_bf16_exchange_halves_the_bytes_and_follows_fp32(rule, setting):
    """The same steps with comm_dtype fp32 and bf16: the bytes every rank sent halve (up to the float64
    headers, weights and padding); the synchronous rules' parameters stay within bf16's rounding of the
    fp32 run (the asynchronous ones follow the threads' timing, so their trajectories differ anyway)."""
    kwargs, steps, synchronous = setting
    schema = schema_of("rule", rule)
    full = train(schema(**kwargs), steps=steps)
    half = train(schema(**kwargs, comm_dtype="bf16"), steps=steps)
    sent_full, sent_half = sum(r[1] for r in full), sum(r[1] for r in half)
    assert 0.45 <= sent_half / sent_full <= 0.56, (sent_half, sent_full)
    if synchronous:
        for (x_full, *_), (x_half, *_) in zip(full, half, strict=True):
            assert not torch.equal(x_full, x_half), "bf16 must change the exchange"
            assert torch.allclose(x_half, x_full, atol=2e-2), (x_half - x_full).abs().max()
        workers = [r[3] for r in half if not r[2]]
        assert all(torch.equal(workers[0], w) for w in workers), "synchronous replicas must stay identical"


def test_comm_dtype_is_checked():
    with pytest.raises(ValueError, match="comm_dtype='fp8'.*fp32, bf16, fp16"):
        BSPConfig(comm_dtype="fp8")
    with pytest.raises(ValueError, match="overlap='nonblocking'.*rule.overlap=thread"):
        BSPConfig(comm_dtype="bf16", overlap="nonblocking")


@pytest.mark.slow
@pytest.mark.mpi
def test_default_job_with_bf16_exchange_reaches_97_percent_on_half_the_bytes(cli):
    """The default job (BSP, 2 ranks, CNN on digits) with 16-bit gradients: float32 would send
    2(N−1)/N · 4 bytes per parameter per step and rank, bf16 about half (plus the initial broadcast)."""
    from tests.conftest import checked_config

    run = cli("rule.comm_dtype=bf16", timeout=300)
    assert run.returncode == 0, run.output
    s = run.summary
    assert s["final_val_acc"] >= 0.97, s["final_val_acc"]
    n = s["devices"]
    parameters = sum(p.numel() for p in checked_config([]).model.build().parameters())
    fp32 = n * 2 * (n - 1) / n * 4 * parameters * s["steps"]
    assert 0.45 * fp32 <= s["bytes_sent"] <= 0.55 * fp32, (s["bytes_sent"], fp32)
