"""The rules' update math, rank by rank, in milliseconds: every rank is a thread of this process and talks
through :class:`tests.helpers.fakecomm.FakeComm`, whose collectives really combine the ranks' tensors.

Models are tiny float64 MLPs or single weight vectors, so trajectories can be compared to 1e-12 and
exchanges checked against numbers computed by hand. ``fit`` follows ``Trainer.fit``'s hook order. Each
rule's tests (tests/test_<rule>.py) and the tests of what every rule shares (checkpoints, 16-bit exchange)
build their ranks with these.
"""

from __future__ import annotations

import threading

import torch
from torch import nn
from torch.nn import functional as F

from runner.rules.base import RuleContext, split_roles

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
    """Two flat parameter tensors agree to ``atol`` (1e-12 by default: float64 up to rounding)."""
    diff = (a - b).abs().max().item()
    assert diff <= atol, f"max |diff| {diff:.3g} > {atol}"


#: N ranks, B samples each per step, STEPS steps: rank r takes rows r::N of each of the GLOBAL batches.
N, B, STEPS = 3, 4, 4
GLOBAL = [batch(N * B, seed=s) for s in range(STEPS)]


def shard(rank: int, size: int = N):
    """Rank ``rank``'s equal share of every GLOBAL batch."""
    return [(x[rank::size], y[rank::size]) for x, y in GLOBAL]
