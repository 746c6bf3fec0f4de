"""Streaming DiLoCo: DiLoCo with overlapping communication (Douillard et al. 2025, arXiv 2501.18512).

DiLoCo (:mod:`runner.rules.diloco`) with its one exchange per round cut in three ways:

* **Fragments.** Each flat parameter buffer is split into ``fragments`` = F contiguous ranges of equal size
  (by parameter order; a range may cut a tensor, so that every exchange is 1/F of the model to one element).
  ``fragment_by: blocks`` cuts it by the model's repeated blocks instead, as the paper does, strided:
  fragment p holds blocks p, p+F, p+2F, ... and fragment 0 also every parameter outside the blocks
  (:mod:`runner.rules.fragments`). The flat buffers are then laid out fragment by fragment (the model's
  order within each), so that each fragment is still one contiguous range of each buffer, of its own size.
  Fragment p is synchronized every ``inner_steps`` = H steps, after c steps where c ≡ o_p (mod H), c > 0, at
  the staggered offset o_p = ⌊p·H/F⌋ (``stagger: false``: o_p = 0, all fragments at DiLoCo's round ends).
* **Overlap and delay.** At its sync each worker starts the fragment's all-reduce in the background and
  trains on; ``delay`` = τ steps later (0 ≤ τ < H) it waits for it and applies the outer step to the
  fragment's x_start_p, DiLoCo's outer SGD (Nesterov) with the fragment's share of the momentum buffer,
  imported from DiLoCo (:func:`runner.rules.diloco.outer_sgd`):

      Δ_p = x_start_p − (1/N) Σ_i x_i,p(sync);   x_start_p ← outer_sgd(x_start_p, Δ_p)

  and merges it with the τ steps taken meanwhile, ``fragment_alpha`` = α:

      x_i,p ← α·x_i,p(now) + (1 − α)·x_start_p      (α = 0: x_i,p ← x_start_p, as DiLoCo does)

* **Quantized outer gradients** (``quantize: int8``). Each worker sends Δ_i,p = x_start_p − x_i,p in 8 bits:
  blocks of :data:`BLOCK` values share one float32 scale (the block's largest |value| / 127), rounded to
  the nearest step. As the 16-bit exchange does (:mod:`runner.comm.wire`), an all-to-all gives rank r the
  r-th chunk of every worker's Δ, rank r sums them in float32 (in rank order), quantizes the sum once
  more, and an all-gather gives every worker the same bits: each worker sends 2(N−1)/N·(1 + 4/BLOCK) bytes
  per value, against 2(N−1)/N·4 for DiLoCo's float32. The paper goes as low as 4-bit floats; int8 with
  per-block scales is chosen here because it needs no float8 type on the wire (numpy and MPI have none),
  its rounding error is at most half a step (|Δ|max/254 per block) and unbiased in sign, and blocks keep
  one large value from flattening a whole fragment. ``quantize: none`` sends the parameters themselves,
  exactly as DiLoCo (and in ``comm_dtype``), so that it equals DiLoCo bit for bit where the schedules match.

BatchNorm statistics travel with fragment 0's exchange and are set to the workers' mean when it is applied.
The exchanges run on a communicator of their own (split from the workers', sharing their counts and links)
and its background thread, in the order they were started, so that the loop's own collectives never meet
them; the communicator prices and counts them as it does every all-reduce. ``final_metrics`` reports
``sync_bytes_peak``: the most bytes one worker sent in one fragment's exchange (statistics included).

Checkpoints (and growth, and the end of training) complete the exchanges in flight and keep their results
to be applied at their step, so a resumed run is bit for bit the uninterrupted one and new workers take the
pending results with worker 0's state. A lost worker: the survivors take worker 0's x_start, momentum and
counts, forget the exchanges in flight, and every fragment restarts from x_start (statistics averaged).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runner.comm.encodings.int8 import Int8
from runner.comm.flat import FlatTensors, float_buffers
from runner.lazy import lazy_import
from runner.rules.base import RuleContext, no_grad
from runner.rules.diloco import DiLoCo, DiLoCoConfig, outer_sgd
from runner.rules.fragments import block_fragments, layout
from runner.schema import ModelConfig, one_of, require

if TYPE_CHECKING:
    import torch

    from runner.comm.face import CommLike, RequestLike
else:
    torch = lazy_import("torch")

#: Values per float32 scale in the 8-bit exchange (4/128: 3% more bytes than the 8-bit values alone);
#: the encoding is runner/comm/encodings/int8.py's, which BSP's and DiLoCo's ``rule.compress=int8`` use too.
BLOCK = 128


@dataclass
class StreamingDiLoCoConfig(DiLoCoConfig):
    fragments: int = 4
    delay: int = 1
    fragment_alpha: float = 0.0
    quantize: str = "none"
    stagger: bool = True
    fragment_by: str = "size"

    def check_model(self, model: ModelConfig) -> None:
        """``fragment_by: blocks``: check that the model has blocks, at least one per fragment.

        The model is built on the meta device (no memory, no data). A model that cannot be built so is checked
        by the ranks, at build."""
        if self.fragment_by != "blocks":
            return
        try:
            with torch.device("meta"):
                built = model.build()
        except Exception:  # noqa: BLE001 (its own code may need data or a device: the ranks check it then)
            return
        block_fragments(built, self.fragments)

    def __post_init__(self) -> None:
        super().__post_init__()
        one_of("fragment_by", self.fragment_by, ("size", "blocks"))
        require(
            1 <= self.fragments <= self.inner_steps,
            "fragments",
            self.fragments,
            f"parts of the model synchronized in turn, 1 to inner_steps={self.inner_steps} (1: DiLoCo's one "
            "exchange per round)",
        )
        require(
            0 <= self.delay < self.inner_steps,
            "delay",
            self.delay,
            f"steps an exchange overlaps before it is applied, 0 to inner_steps-1={self.inner_steps - 1} "
            "(one exchange per fragment in flight)",
        )
        require(
            0 <= self.fragment_alpha < 1,
            "fragment_alpha",
            self.fragment_alpha,
            "the share of the local parameters kept at a merge, in [0, 1) (0: take the outer result)",
        )
        self.fixed_period(
            "Streaming DiLoCo places its fragments' exchanges within a fixed period of inner_steps"
        )
        require(
            self.outer_momentum_warmup == 0,
            "outer_momentum_warmup",
            self.outer_momentum_warmup,
            "Streaming DiLoCo's fragments take their outer steps in turn with the configured momentum: set "
            "rule.outer_momentum_warmup=0 (rule=diloco takes it)",
        )
        one_of("quantize", self.quantize, ("none", "int8"))
        require(
            self.compress == "none",
            "compress",
            self.compress,
            "Streaming DiLoCo quantizes its fragments' outer gradients with rule.quantize=int8: set "
            "rule.compress=none (rule=diloco and rule=bsp take rule.compress)",
        )
        require(
            self.quantize == "none" or self.comm_dtype == "fp32",
            "quantize",
            self.quantize,
            f"8-bit outer gradients are not also sent in comm_dtype={self.comm_dtype}: set "
            "rule.comm_dtype=fp32, or rule.quantize=none to send the parameters in 16 bits as DiLoCo does",
        )

    def build(self, ctx: RuleContext) -> StreamingDiLoCo:
        return StreamingDiLoCo(self, ctx)


@dataclass
class Exchange:
    """One fragment's exchange, from its start to its apply.

    It holds the tensors being summed over ``size`` workers (the fragment's parameters, or Δ with ``int8``;
    then the statistics), their requests (empty once complete), the step count it is applied at, and the bytes
    this worker sent for it."""

    fragment: int
    due: int
    size: int
    sums: list[torch.Tensor]
    requests: list[RequestLike] = field(default_factory=list)
    sent: int = 0


class StreamingDiLoCo(DiLoCo):
    """DiLoCo's outer step, fragment by fragment in a staggered schedule, overlapped and applied late."""

    def __init__(self, cfg: StreamingDiLoCoConfig, ctx: RuleContext):
        # fragment_by=blocks: the model's blocks are checked first, before any collective call
        fragment_of = block_fragments(ctx.model, cfg.fragments) if cfg.fragment_by == "blocks" else None
        super().__init__(cfg, ctx)
        self.cfg: StreamingDiLoCoConfig = cfg
        if fragment_of is None:
            F = cfg.fragments
            self.bounds = [[(len(b) * k) // F for k in range(F + 1)] for b in self.start]
        else:
            self._lay_out_by_blocks(fragment_of)
        self.offsets = [
            (p * cfg.inner_steps) // cfg.fragments if cfg.stagger else 0 for p in range(cfg.fragments)
        ]
        self.steps = 0  # optimizer steps taken (the schedule's clock)
        self.pending: list[Exchange] = []  # started, not yet applied, in the order started
        self.sync_bytes_peak = 0
        self.link: CommLike | None = None  # the exchanges' communicator (joined: made in grow)
        # Δ's encoding (without feedback it keeps no state, so one serves every exchange)
        self.int8 = Int8(torch.zeros(0), 1, feedback=False, block=BLOCK) if cfg.quantize == "int8" else None
        if not self.joined:
            self._new_link()

    def _lay_out_by_blocks(self, fragment_of: list[int]) -> None:
        """``fragment_by: blocks``: the flat buffers made anew with the parameters fragment by fragment.

        They hold worker 0's values, taken at build; x_start and the momentum buffer are made anew with them.
        Every worker (and a resumed or joined one) builds the same layout from the same model, so the flat
        order of x_start, momentum and pending sums in a checkpoint is the order they are restored into."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        ordered, self.bounds = layout(params, fragment_of, self.cfg.fragments)
        self.start = self.momentum = []  # (DiLoCo's, in the model's order: freed before new ones are made)
        self.flat = FlatTensors(ordered)
        self.start = [x.clone() for x in self.flat.buffers]
        self.momentum = [torch.zeros_like(x) for x in self.start] if self.cfg.outer_momentum > 0 else []
        self.compressed = self._compressors()

    def _new_link(self) -> None:
        """Collective over the workers: the exchanges' own communicator, whose background thread runs them.

        The workers' counts and links are its own (a split shares them)."""
        if self.link is not None:
            self.link.end_background()  # (idle: the exchanges in flight completed, or were abandoned)
        self.link = self.workers.split(0)

    def _views(self, tensors: list[torch.Tensor], p: int) -> list[torch.Tensor]:
        """Fragment ``p``'s range of each flat buffer of ``tensors`` (parameters, x_start or momentum)."""
        return [t[b[p] : b[p + 1]] for t, b in zip(tensors, self.bounds, strict=True)]

    def after_step(self, step: int) -> None:
        """Start the exchanges of the fragments due now, then apply those whose delay is over."""
        self.steps += 1
        H = self.cfg.inner_steps
        for p, offset in enumerate(self.offsets):
            if (self.steps - offset) % H == 0:
                self._start(p)
        while self.pending and self.pending[0].due == self.steps:
            self._apply(self.pending.pop(0))
        self.round_step = self.steps % H

    @no_grad
    def _start(self, p: int) -> None:
        """Start fragment ``p``'s exchange, which sums its tensors in the background.

        The tensors: the fragment's parameters (``int8``: Δ_i,p) and, for fragment 0, the BatchNorm
        statistics."""
        x = self._views(self.flat.buffers, p)
        if self.cfg.quantize == "int8":
            sums = [x0 - xi for x0, xi in zip(self._views(self.start, p), x, strict=True)]
        else:
            sums = [xi.clone() for xi in x]
        stats = [b.clone() for b in float_buffers(self.model)] if p == 0 else []
        exchange = Exchange(p, self.steps + self.cfg.delay, self.link.size, sums + stats)
        for i, t in enumerate(exchange.sums):
            if i < len(sums):
                wire = None if self.int8 else self.wire
                request = self.link.allreduce_background(t, wire=wire, encoding=self.int8)
            else:  # statistics: float32 sums, as DiLoCo's
                request = self.link.allreduce_background(t)
            exchange.requests.append(request)
        self.pending.append(exchange)  # every exchange waits the same delay: pending is in order of due

    def _complete(self, exchange: Exchange) -> None:
        """Wait for ``exchange``'s sums (a lost worker raises here); keep the peak of its bytes."""
        if not exchange.requests:
            return
        for request in exchange.requests:
            request.wait()
        exchange.sent = sum(request.sent for request in exchange.requests)
        exchange.requests = []
        self.sync_bytes_peak = max(self.sync_bytes_peak, exchange.sent)

    @no_grad
    def _apply(self, exchange: Exchange) -> None:
        """The outer step of ``exchange``'s fragment on x_start_p, then the merge into the parameters."""
        self._complete(exchange)
        p, k = exchange.fragment, len(self.start)
        means = [t.div_(exchange.size) for t in exchange.sums]
        start = self._views(self.start, p)
        if self.cfg.quantize == "int8":
            deltas = means[:k]
        else:
            deltas = [x0 - m for x0, m in zip(start, means[:k], strict=True)]
        outer_sgd(self.cfg, start, self._views(self.momentum, p) if self.momentum else [], deltas)
        alpha = self.cfg.fragment_alpha
        for x, x0 in zip(self._views(self.flat.buffers, p), start, strict=True):
            if alpha == 0:
                x.copy_(x0)
            else:
                x.mul_(alpha).add_(x0, alpha=1 - alpha)
        for b, m in zip(float_buffers(self.model) if p == 0 else [], means[k:], strict=True):
            b.copy_(m)
        self.outer_steps += 1
        self.delta_norm = (
            sum(float(torch.linalg.vector_norm(d, dtype=torch.float64)) ** 2 for d in deltas) ** 0.5
        )

    def _complete_all(self) -> None:
        """Complete every exchange in flight; their results wait for their step."""
        for exchange in self.pending:
            self._complete(exchange)

    def before_checkpoint(self, step: int) -> None:
        self._complete_all()

    def before_grow(self) -> None:
        self._complete_all()

    def finish(self) -> None:
        """Complete the exchanges in flight; the background thread ends."""
        self._complete_all()
        if self.link is not None:
            self.link.end_background()

    @no_grad
    def eval_models(self) -> dict[str, torch.nn.Module]:
        """The workers' model if every fragment equals x_start on all of them, else a copy set to their mean.

        Every fragment does before the first step, and at the end of a round where the fragments synchronize
        together (DiLoCo's round)."""
        together = not self.cfg.stagger or self.cfg.fragments == 1
        boundary = self.steps == 0 or (together and self.round_step == 0 and self.cfg.fragment_alpha == 0)
        if self.workers.size == 1 or (boundary and not self.pending):
            return {"": self.model}
        if self._mean is None:  # the mean's copy, its flat buffers laid out as this worker's (fragment_by)
            clone = copy.deepcopy(self.model)
            index = {id(p): i for i, p in enumerate(self.model.parameters())}
            theirs = list(clone.parameters())
            self._mean = clone, FlatTensors(theirs[index[id(t)]] for t in self.flat.tensors)
        return {"": self._workers_mean(self.flat, 1.0 / self.workers.size)[0]}

    def metrics(self) -> dict[str, float]:
        """DiLoCo's (outer steps: one per fragment synchronized) and the peak bytes of one exchange."""
        return {**super().metrics(), "sync_bytes_peak": self.sync_bytes_peak}

    def final_metrics(self) -> dict[str, object]:
        return {**super().final_metrics(), "sync_bytes_peak": self.sync_bytes_peak}

    def state_dict(self) -> dict[str, Any]:
        """DiLoCo's, the step count, the peak and the pending exchanges' results.

        The results are complete: see :meth:`before_checkpoint`."""
        assert all(not e.requests for e in self.pending), "an exchange in flight at a checkpoint"
        pending = [
            {
                "fragment": e.fragment,
                "due": e.due,
                "size": e.size,
                "sums": [t.clone() for t in e.sums],
                "sent": e.sent,
            }
            for e in self.pending
        ]
        return {**super().state_dict(), "steps": self.steps, "peak": self.sync_bytes_peak, "pending": pending}

    @no_grad
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.steps, self.sync_bytes_peak = state["steps"], state["peak"]
        self.pending = [Exchange(**{**e, "sums": [t.clone() for t in e["sums"]]}) for e in state["pending"]]

    @property
    def ready_to_grow(self) -> bool:
        """Workers may join at any step.

        The exchanges in flight complete first and the new workers take their results with worker 0's
        state."""
        return True

    def grow(self, joined: bool) -> None:
        """Collective over all workers once new ones joined: the exchanges' communicator anew."""
        super().grow(joined)
        self._new_link()

    def abandon(self) -> None:
        """A worker was lost: wait for the exchanges in flight to fail or end; recover forgets them."""
        for exchange in self.pending:
            for request in exchange.requests:
                try:
                    request.wait()
                except Exception:  # noqa: BLE001 (PeerLost, or the revoked communicator's own error)
                    pass
            exchange.requests = []

    @no_grad
    def recover(self) -> None:
        """The survivors take worker 0's x_start, momentum buffer and counts.

        They forget the exchanges in flight (their results may have reached some survivors only), and every
        fragment restarts from x_start, BatchNorm statistics averaged. The inner optimizers' states stay their
        own."""
        for t in [*self.start, *self.momentum]:
            self.workers.broadcast(t, root=0)
        self.steps, self.outer_steps, self.delta_norm = self.workers.broadcast_object(
            (self.steps, self.outer_steps, self.delta_norm), root=0
        )
        self.pending, self._sent = [], {}
        stats = float_buffers(self.model)
        for b, m in zip(stats, self._mean_of_workers(stats), strict=True):
            b.copy_(m)
        for x, x0 in zip(self.flat.buffers, self.start, strict=True):
            x.copy_(x0)
        self.round_step = self.steps % self.cfg.inner_steps
        self._new_link()
