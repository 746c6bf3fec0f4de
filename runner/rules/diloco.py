"""DiLoCo: distributed low-communication training (Douillard et al. 2023, arXiv 2311.08105).

Training runs in rounds of ``inner_steps`` = H steps. A round starts with every worker holding the same
parameters x_start; each worker takes H steps of the loop's (inner) optimizer (``optim=``) on its own
batches, reaching x_i. Then, in one exchange, the workers form the pseudo-gradient

    Δ = x_start − (1/N) Σ_i x_i

and apply an outer SGD step to x_start with Δ as its gradient, as ``torch.optim.SGD(lr=outer_lr,
momentum=μ, nesterov=nesterov)`` does (dampening 0; the momentum buffer b starts at 0):

    b ← μ·b + Δ;    s = Δ + μ·b if nesterov else b;    x_start ← x_start − outer_lr·s

(μ = 0: s = Δ, no buffer). Every worker then sets its parameters to the new x_start. All workers compute the
same Δ, so b and x_start are identical on all of them. The inner optimizer's state (e.g. SGD momentum) stays
each worker's own. With one worker the outer step applies to its own progress (Δ = x_start − x_1), the
paper's single-replica case.

With ``outer_lr: 1, outer_momentum: 0, nesterov: false`` a round ends at x_start − Δ = mean_i x_i: local SGD,
``rule=bsp rule.mode=params rule.avg_freq=H`` (up to the rounding of x_start − (x_start − mean)).

Defaults: the paper's outer optimizer is Nesterov with outer lr 0.7 and momentum 0.9, for long runs (H = 500,
hundreds of rounds). Here the defaults keep Nesterov and lr 0.7 but take momentum 0.5 and H = 10, for short
jobs at a constant inner lr: with μ = 0.9 the buffer remembers about 10 rounds, as many as the default job
has (12), and its steps, up to outer_lr/(1 − μ) = 7 times Δ, overshoot (digits, 4 workers, seeds 0-2: final
accuracy 0.88-0.97 with μ = 0.9, 0.98-1.00 with μ = 0.5).

BatchNorm statistics are averaged over the workers at every outer step. Validation at a round boundary
reports the workers' (identical) model; mid-round, a separate copy set to the workers' mean (parameters and
statistics), so that validating does not change the training trajectory.

Exchange: every mean of the workers goes through :meth:`Rule._mean_of_workers`; with ``comm_dtype:
bf16|fp16`` the outer step's parameters travel in 16 bits (float32 sums, the same bits on every worker).
``compress: int8|topk|topk_2bit|sign`` sends each worker's outer gradient Δ_i = x_start − x_i compressed
instead, with error feedback (runner/comm/encodings/): the worker adds its residual e_i, sends c(Δ_i + e_i),
keeps e_i ← Δ_i + e_i − c(Δ_i + e_i), and every worker takes Δ = (1/N) Σ_i c(Δ_i + e_i). ``int8``: blocks of
256 values with one float32 scale each, summed by a reduce-scatter with re-quantization (all-to-all of the
int8 chunks, each rank sums its chunk, quantizes the sum again and keeps that rounding as its own residual,
all-gather): 2(N−1)/N·(1 + 4/256) bytes per value, 0.254 of float32's. ``topk``: the k =
⌈``topk_ratio``·numel⌉ largest |values| of each flat buffer (the whole model, one message), by all-gather of
int32 indices and float32 values: N·ratio of float32's bytes. ``topk_2bit`` and ``sign``: chunked codes by
all-gather (runner/comm/sparse.py; rule=sparseloco is DiLoCo with the former and a decaying error feedback in
place of the outer momentum). ``error_feedback: false`` drops what was not sent. The BatchNorm statistics and
mid-round validation's means still travel in float32.
The only other parameter traffic is two exact broadcasts from worker 0: at build (all workers start from
worker 0's model, whatever ``train.same_init``) and on recovery.

``outer_momentum_warmup: W`` raises μ linearly from 0 over the first W outer steps (μ·r/W at step r, 0-based;
Pier, arXiv 2511.17849: a momentum that starts full amplifies the first, largest pseudo-gradients).
``period_schedule: qsr|list`` changes H from round to round (runner/rules/period.py: QSR's
H = max(H_base, ⌊(α/η)²⌋) as the rate decays, or listed lengths); ``inner_steps`` is H_base.

Lost workers (``hardware.fault_tolerance=continue``): the survivors take worker 0's x_start, momentum buffer
and outer-step count (an exchange may have completed on some survivors only). If all of them had finished
the round's H steps (the loss broke its exchange), they take the outer step over themselves; otherwise they
restart the round from x_start, each discarding its local steps of the round (fewer than H).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runner.comm.encodings import compressors, feedback_state, load_feedback
from runner.comm.flat import FlatTensors, float_buffers
from runner.lazy import lazy_import
from runner.rules.base import Rule, RuleContext, check_compress, no_grad
from runner.rules.period import PeriodicConfig, Periods, rate
from runner.schema import RuleConfig, require

if TYPE_CHECKING:
    import torch

    from runner.comm.encodings.base import Encoding
else:
    torch = lazy_import("torch")


@dataclass
class DiLoCoConfig(PeriodicConfig, RuleConfig):
    inner_steps: int = 10
    outer_lr: float = 0.7
    outer_momentum: float = 0.5
    nesterov: bool = True
    outer_momentum_warmup: int = 0
    compress: str = "none"
    topk_ratio: float = 0.01
    error_feedback: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_compress(self.compress, self.topk_ratio, self.comm_dtype)
        require(
            self.inner_steps >= 1,
            "inner_steps",
            self.inner_steps,
            "local steps per round (H), >= 1 (e.g. 10 for short jobs; the paper uses 500)",
        )
        require(
            self.outer_lr > 0,
            "outer_lr",
            self.outer_lr,
            "must be > 0 (the paper's 0.7; 1 with no momentum: local SGD)",
        )
        require(
            0 <= self.outer_momentum < 1,
            "outer_momentum",
            self.outer_momentum,
            "must be in [0, 1) (the paper's 0.9 for long jobs)",
        )
        require(
            not self.nesterov or self.outer_momentum > 0,
            "outer_momentum",
            self.outer_momentum,
            "Nesterov momentum (rule.nesterov=true, the default) needs outer_momentum > 0; "
            "set rule.nesterov=false for outer SGD without momentum",
        )

        require(
            self.outer_momentum_warmup >= 0 and (self.outer_momentum_warmup == 0 or self.outer_momentum > 0),
            "outer_momentum_warmup",
            self.outer_momentum_warmup,
            "outer steps over which the outer momentum rises from 0 to rule.outer_momentum (> 0), >= 0 "
            "(0: from the first)",
        )

    def momentum_at(self, outer_steps: int) -> float:
        """μ of the outer step after ``outer_steps`` earlier ones.

        It is ``outer_momentum``, reached linearly from 0 over ``outer_momentum_warmup`` steps (Pier, arXiv
        2511.17849)."""
        warmup = self.outer_momentum_warmup
        return self.outer_momentum * min(1.0, outer_steps / warmup) if warmup else self.outer_momentum

    def build(self, ctx: RuleContext) -> DiLoCo:
        return DiLoCo(self, ctx)


@no_grad
def outer_sgd(
    cfg: DiLoCoConfig,
    start: list[torch.Tensor],
    momentum: list[torch.Tensor],
    deltas: list[torch.Tensor],
    mu: float | None = None,
) -> None:
    """The outer step in place: each x_start of ``start`` takes Δ of ``deltas`` as its gradient.

    Each uses its buffer of ``momentum`` (empty when μ = 0), as torch.optim.SGD does (the module's docstring);
    ``mu``: this step's μ, if not ``outer_momentum`` (a warm-up)."""
    mu = cfg.outer_momentum if mu is None else mu
    for i, (x0, delta) in enumerate(zip(start, deltas, strict=True)):
        step = delta
        if mu > 0:
            buf = momentum[i].mul_(mu).add_(delta)
            step = delta.add(buf, alpha=mu) if cfg.nesterov else buf
        x0.add_(step, alpha=-cfg.outer_lr)


class DiLoCo(Rule):
    """H local steps per round, then one outer SGD (Nesterov) step on the mean pseudo-gradient."""

    def __init__(self, cfg: DiLoCoConfig, ctx: RuleContext):
        super().__init__(ctx, comm_dtype=cfg.comm_dtype)
        self.cfg = cfg
        self.flat = FlatTensors(p for p in self.model.parameters() if p.requires_grad)
        self._take_worker_0_model()
        self.start = [x.clone() for x in self.flat.buffers]
        self.momentum = [torch.zeros_like(x) for x in self.start] if cfg.outer_momentum > 0 else []
        self.round_step = 0
        self.periods = Periods(cfg, cfg.inner_steps)  # (``rule.period_schedule``: this round's length)
        self.periods.length(rate(self.optimizer))
        self.outer_steps = 0
        self.delta_norm = 0.0
        self.compressed = self._compressors()

    def _compressors(self) -> list[Encoding]:
        """One compressed exchange per flat buffer (``rule.compress``), with fresh error feedback."""
        return compressors(self.cfg, self.flat.buffers, self.workers.size)

    @no_grad
    def _take_worker_0_model(self) -> None:
        """All workers start from worker 0's parameters and buffers (x_start is shared by definition)."""
        if self.workers.size > 1 and not self.joined:  # joined: worker 0's model comes with the state
            for t in [*self.model.parameters(), *self.model.buffers()]:
                self.workers.broadcast(t.data, root=0)

    def after_step(self, step: int) -> None:
        self.round_step += 1
        if self.round_step == self.periods.current:
            self.outer_step()

    @no_grad
    def outer_step(self) -> None:
        """End the round: all communication first, then the update, so a failed exchange changes nothing."""
        stats = float_buffers(self.model)
        k = len(self.flat.buffers)
        if self.compressed:
            deltas = self._compressed_deltas()
            means = deltas + self._mean_of_workers(stats)
        else:
            means = self._mean_of_workers(self.flat.buffers, self.wire) + self._mean_of_workers(stats)
            deltas = [x0 - m for x0, m in zip(self.start, means[:k], strict=True)]
        outer_sgd(self.cfg, self.start, self.momentum, deltas, self.cfg.momentum_at(self.outer_steps))
        for x, x0 in zip(self.flat.buffers, self.start, strict=True):
            x.copy_(x0)
        for b, m in zip(stats, means[k:], strict=True):
            b.copy_(m)
        self.round_step = 0
        self.periods.length(rate(self.optimizer))
        self.outer_steps += 1
        self.delta_norm = (
            sum(float(torch.linalg.vector_norm(d, dtype=torch.float64)) ** 2 for d in deltas) ** 0.5
        )

    @no_grad
    def _compressed_deltas(self) -> list[torch.Tensor]:
        """Δ = (1/N) Σ_i c(Δ_i + e_i), each worker's outer gradient compressed with its error feedback."""
        deltas = []
        for x0, x, c in zip(self.start, self.flat.buffers, self.compressed, strict=True):
            d = x0 - x
            self.workers.allreduce(d, encoding=c)
            deltas.append(d.div_(self.workers.size))
        return deltas

    @no_grad
    def eval_models(self) -> dict[str, torch.nn.Module]:
        """At a round boundary the workers' model; mid-round a copy set to the workers' mean."""
        if self.round_step == 0 or self.workers.size == 1:
            return {"": self.model}
        return {"": self._workers_mean_copy(self.flat)[0]}

    def metrics(self) -> dict[str, float]:
        """Outer steps so far, the norm of the last pseudo-gradient Δ and the current round's length.

        The norm is equal on all workers; the round's length is reported with a period schedule only."""
        scheduled = {"period": self.periods.current} if self.cfg.period_schedule != "constant" else {}
        return {"outer_steps": self.outer_steps, "pseudo_grad_norm": self.delta_norm, **scheduled}

    def final_metrics(self) -> dict[str, object]:
        return {"outer_steps": self.outer_steps}

    def state_dict(self) -> dict[str, Any]:
        """x_start, the outer momentum buffer, the position in the round.

        The local parameters and the inner optimizer are saved with the model and the optimizer."""
        state = {
            "start": [x0.clone() for x0 in self.start],
            "momentum": [b.clone() for b in self.momentum],
            "round_step": self.round_step,
            "periods": self.periods.state_dict(),
            "outer_steps": self.outer_steps,
            "delta_norm": self.delta_norm,
        }
        return {**state, **feedback_state(self.compressed, self.workers.size)}  # this worker's residuals

    @no_grad
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for mine, saved in zip(
            [*self.start, *self.momentum], [*state["start"], *state["momentum"]], strict=True
        ):
            mine.copy_(saved)
        self.round_step, self.outer_steps = state["round_step"], state["outer_steps"]
        self.periods.load_state_dict(state.get("periods"))
        self.delta_norm = state["delta_norm"]
        load_feedback(self.compressed, state, self.workers.size)

    @property
    def ready_to_grow(self) -> bool:
        """New workers join at the start of a round (they take worker 0's x_start and momentum)."""
        return self.round_step == 0

    def grow(self, joined: bool) -> None:
        """``compress``: the error feedback starts anew on every worker.

        A residual is one worker's, and the chunks of the sums have other owners now."""
        super().grow(joined)
        self.compressed = self._compressors()

    def _take_worker_0s_rounds(self) -> None:
        """Collective over the survivors of a loss: worker 0's x_start, outer momentum, counts and periods."""
        for t in [*self.start, *self.momentum]:
            self.workers.broadcast(t, root=0)
        self.outer_steps, self.delta_norm, periods = self.workers.broadcast_object(
            (self.outer_steps, self.delta_norm, self.periods.state_dict()), root=0
        )
        self.periods.load_state_dict(periods)

    def recover(self) -> None:
        """Make the survivors' round state worker 0's.

        An outer step may have completed on some of them only. If every survivor had finished the round's H
        steps (its exchange failed), take the outer step over them; otherwise restart the round from x_start,
        BatchNorm statistics averaged. The inner optimizers' states stay their own. From now on the mean is
        over the survivors; ``compress``'s error feedback starts anew."""
        self.compressed = self._compressors()
        self._take_worker_0s_rounds()
        if self.workers.allreduce_values([self.round_step], "min")[0] == self.periods.current:
            self.outer_step()
            return
        stats = float_buffers(self.model)
        for b, m in zip(stats, self._mean_of_workers(stats), strict=True):
            b.copy_(m)
        for x, x0 in zip(self.flat.buffers, self.start, strict=True):
            x.copy_(x0)
        self.round_step = 0
