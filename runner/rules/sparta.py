"""SPARTA: sparse parameter averaging, a random share of the entries averaged every few steps.

SPARTA (exo, "SPARTA: sparse parameter averaging", 2025). Every worker trains its own parameters x_i with the
loop's optimizer on its own batches; after every ``interval`` steps (global steps s with (s + 1) mod
``interval`` = 0) the workers average a random set M of the entries of their flat parameters:

    x_i[j] ← (1/N) Σ_w x_w[j]   for j ∈ M;      x_i[j] unchanged for j ∉ M.

M has k = ⌈``fraction``·n⌉ entries of a flat buffer of n (per buffer: one per dtype and device). Every worker
draws the same M from the same generator, ``torch.Generator().manual_seed(seed · 2654435761 + c)`` where c is
the number of exchanges so far (0, 1, ...): no byte is spent to agree on it, and a run resumed from a
checkpoint (which holds c) replays the same masks. The indices are ``torch.randint(n, (k,))`` when
k ≤ n/16, drawn with replacement so that no permutation of the whole model is made each step (a repeated
index is averaged once, harmlessly: about k²/2n repeats, at most 1/32 of the draws), else the first k of
``torch.randperm(n)``; ``fraction: 1`` takes every entry without drawing, and then equals
``rule=bsp rule.mode=params rule.avg_freq=interval`` (the same sum and the same 1/N: bit for bit in process).
The chosen entries are gathered into one dense vector, all-reduced (in ``comm_dtype``'s 16 bits with
``bf16|fp16``) and written back: each worker sends k · 4 bytes · 2(N−1)/N per exchange in float32,
``fraction`` of BSP's parameter averaging.

Defaults: the paper's, ``fraction`` 0.005 (0.5%: 1/200 of BSP's parameter-averaging bytes) every step
(``interval`` 1). On the default job (digits, the small CNN, 4 workers, 120 steps) the workers' mean model
reaches 0.983-0.989 (seeds 0-2; 0.986-0.997 at 0.05), on the blobs of examples/my_project 0.99. Such short
jobs barely need the averaging (a mask of 2 entries still ends at 0.97-0.98: the mean of models trained from
one start for 120 steps is good); longer ones do: 40 epochs at ``optim.lr=0.1`` end at 0.94 with 2 entries
(spread 7.6), 0.99 at 0.005 (spread 3.8), 1.00 at 0.05 (spread 0.8). ``seed`` 0 as GoSGD's: a rule is not
given the job's seed, so sweep ``rule.seed`` with ``train.seed`` for independent masks.

All workers start from worker 0's parameters and buffers (one broadcast at build, whatever
``train.same_init``). BatchNorm statistics are never exchanged in training (they stay each worker's, from
its own batches): validation averages them, with the parameters, in a copy. ``eval_models`` reports that
copy, the workers' mean model (parameters and statistics), leaving every worker's own model as it was, and
measures the workers' spread around the mean, sqrt((1/N) Σ_i |x_i − x̄|²).

``period_schedule: qsr|list`` changes the interval from exchange to exchange (runner/rules/period.py;
``interval`` is the base).

Lost workers (``hardware.fault_tolerance=continue``): the survivors take worker 0's exchange count (an
exchange may have completed on some survivors only), so they draw the same masks again; their models stay
their own (SPARTA's workers are never identical). New workers (``fault_tolerance=heal``) take worker 0's
model, optimizer and exchange count. Checkpoints: the exchange count (each worker's model and optimizer are
saved with it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runner.comm.flat import FlatTensors
from runner.lazy import lazy_import
from runner.rules.base import Rule, RuleContext, no_grad
from runner.rules.period import PeriodicConfig, Periods, rate
from runner.schema import RuleConfig, require

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")

#: Mixes ``seed`` with the exchange count into one generator seed (Knuth's multiplicative constant): seeds
#: and counts below 2^31 give distinct generator seeds.
SEED_STRIDE = 2654435761
#: Indices are drawn with replacement up to k = n / REPLACEMENT_LIMIT, by a permutation above it.
REPLACEMENT_LIMIT = 16


@dataclass
class SpartaConfig(PeriodicConfig, RuleConfig):
    fraction: float = 0.005
    interval: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            0 < self.fraction <= 1,
            "fraction",
            self.fraction,
            "the share of the parameters' entries averaged per exchange, in (0, 1] (e.g. the paper's 0.005; "
            "1: every entry, as rule=bsp rule.mode=params)",
        )
        require(
            self.interval >= 1, "interval", self.interval, "steps between exchanges, >= 1 (1: every step)"
        )
        require(
            0 <= self.seed < 2**31,
            "seed",
            self.seed,
            "the masks' seed, in [0, 2^31) (e.g. rule.seed=0; every worker uses the same one)",
        )

    def build(self, ctx: RuleContext) -> Sparta:
        return Sparta(self, ctx)


def mask_size(fraction: float, numel: int) -> int:
    """k = ⌈fraction · numel⌉ (rounded first to 9 digits, so that 0.07 · 100 is 7, not 8), at least 1."""
    return min(numel, max(1, math.ceil(round(fraction * numel, 9))))


def draw_masks(fraction: float, sizes: list[int], seed: int, exchange: int) -> list[torch.Tensor | None]:
    """The indices averaged at exchange number ``exchange``, per flat buffer of ``sizes`` entries.

    Drawn in order from one generator of (``seed``, ``exchange``); None for a buffer averaged whole."""
    generator = torch.Generator().manual_seed(seed * SEED_STRIDE + exchange)
    masks: list[torch.Tensor | None] = []
    for n in sizes:
        k = mask_size(fraction, n)
        if k == n:
            masks.append(None)
        elif k * REPLACEMENT_LIMIT <= n:
            masks.append(torch.randint(n, (k,), generator=generator))
        else:
            masks.append(torch.randperm(n, generator=generator)[:k])
    return masks


class Sparta(Rule):
    """Every ``interval`` steps, the workers' mean of a random ``fraction`` of the parameters' entries."""

    def __init__(self, cfg: SpartaConfig, ctx: RuleContext):
        super().__init__(ctx, comm_dtype=cfg.comm_dtype)
        self.cfg = cfg
        self.flat = FlatTensors(p for p in self.model.parameters() if p.requires_grad)
        self._take_worker_0_model()
        self.entries = sum(mask_size(cfg.fraction, b.numel()) for b in self.flat.buffers)
        self.exchanges = 0
        self.periods = Periods(cfg, cfg.interval)  # (``rule.period_schedule`` of interval)
        self.spread = float("nan")

    @no_grad
    def _take_worker_0_model(self) -> None:
        """All workers start from worker 0's parameters and buffers.

        SPARTA would pull models that start apart together only slowly."""
        if self.workers.size > 1 and not self.joined:  # joined: worker 0's model comes with the state
            for t in [*self.model.parameters(), *self.model.buffers()]:
                self.workers.broadcast(t.data, root=0)

    def masks(self, exchange: int) -> list[torch.Tensor | None]:
        """The indices of exchange number ``exchange`` in each flat buffer (None: all of it)."""
        return draw_masks(self.cfg.fraction, [b.numel() for b in self.flat.buffers], self.cfg.seed, exchange)

    def after_step(self, step: int) -> None:
        if self.periods.due(step, rate(self.optimizer)):
            self.exchange()

    @no_grad
    def exchange(self) -> None:
        """Average this exchange's entries.

        All communication first, then the writes, so that a failed all-reduce (a lost worker) changes
        nothing."""
        n = self.workers.size
        if n > 1:
            masks = self.masks(self.exchanges)
            sums = []
            for x, idx in zip(self.flat.buffers, masks, strict=True):
                chosen = x.clone() if idx is None else x.index_select(0, idx.to(x.device))
                self.workers.allreduce(chosen, wire=self.wire)
                sums.append(chosen)
            for x, idx, total in zip(self.flat.buffers, masks, sums, strict=True):
                mean = total.div_(n)
                if idx is None:
                    x.copy_(mean)
                else:
                    x.index_copy_(0, idx.to(x.device), mean)  # a repeated index: the same mean twice
        self.exchanges += 1

    @no_grad
    def eval_models(self) -> dict[str, torch.nn.Module]:
        """A copy set to the workers' mean, parameters and BatchNorm statistics; also the spread."""
        n = self.workers.size
        if n == 1:
            return {"": self.model}
        model, mean = self._workers_mean_copy(self.flat)
        sq = sum(
            float((x.double() - m.double()).pow(2).sum())
            for x, m in zip(self.flat.buffers, mean.buffers, strict=True)
        )
        self.spread = (self.workers.allreduce_values([sq])[0] / n) ** 0.5
        return {"": model}

    def metrics(self) -> dict[str, float]:
        """Exchanges so far, entries averaged per exchange, the spread at the last validation."""
        return {"exchanges": self.exchanges, "mask_entries": self.entries, "spread": self.spread}

    def final_metrics(self) -> dict[str, object]:
        return {"exchanges": self.exchanges, "mask_entries": self.entries}

    def state_dict(self) -> dict[str, Any]:
        """The exchange count (the masks to come) and where the period schedule stands.

        The model and optimizer are saved with them."""
        return {"exchanges": self.exchanges, "periods": self.periods.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.exchanges = state["exchanges"]
        self.periods.load_state_dict(state.get("periods"))

    def grow(self, joined: bool) -> None:
        """The new workers took worker 0's model and state; all take its exchange count once more."""
        super().grow(joined)
        self.exchanges = self.workers.broadcast_object(self.exchanges, root=0)

    def recover(self) -> None:
        """The survivors take worker 0's exchange count and period schedule, so they draw the same masks.

        An exchange may have completed on some only. Each keeps its own model; from now on the mean is over
        them."""
        self.exchanges, periods = self.workers.broadcast_object(
            (self.exchanges, self.periods.state_dict()), root=0
        )
        self.periods.load_state_dict(periods)
