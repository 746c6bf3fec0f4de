"""SparseLoCo: DiLoCo's rounds, each outer gradient sent as a chunked 2-bit top-k with error feedback.

SparseLoCo (Sarfi, Thérien, Lidin, Belilovsky 2025, arXiv 2508.15706; Templar's Covenant-72B was trained with
it over the internet). Training runs in DiLoCo's rounds (:mod:`runner.rules.diloco`) of ``inner_steps`` = H
steps of the loop's optimizer from the shared x_start, each worker i on its own batches, reaching x_i. Then
each worker folds its outer gradient Δ_i = x_start − x_i into its error feedback e_i (zero at the start),
sends the code C(e_i) of it and keeps what the code left out:

    e_i ← β·e_i + Δ_i;    ĉ_i = C(e_i);    e_i ← e_i − ĉ_i
    Δ = (1/N) Σ_i ĉ_i;    x_start ← x_start − outer_lr·Δ

and every worker sets its parameters to the new x_start. C is :class:`runner.comm.sparse.SparseCode`: the
flat parameters in chunks of ``chunk`` values, of each chunk its ``topk`` largest |values| at their
offsets, in ``bits`` bits (2: a sign and one of two levels per chunk, the mean |value| of the smaller and
of the larger half of the k; 1: signs and the chunk's mean |value|; 32: the values as they are). The codes
are all-gathered (:func:`runner.comm.sparse.sparse_allgather`) and every worker adds them in rank order,
so Δ and x_start are the same bits on all. β = ``ef_decay``. The outer step is DiLoCo's outer SGD with no
momentum (:func:`runner.rules.diloco.outer_sgd`, μ = 0): the error feedback takes the momentum's place,
each worker's own, as the paper proposes. With ``topk`` = ``chunk`` and ``bits: 32`` nothing is left out
(e_i stays 0, whatever β), and SparseLoCo is DiLoCo with ``outer_momentum: 0, nesterov: false``.
``period_schedule`` changes H from round to round as DiLoCo's does (runner/rules/period.py).

Defaults: the paper's code (chunks of 4,096, k = 64: 1.56% of the values, 2 bits), its β = 0.95 and its
outer lr 1 (x_start takes the mean of the codes as it is). H = 10 as DiLoCo's here, for short jobs (the
paper's runs are far longer). A very short job needs a denser code: 64 of 4,096 applies a few percent of
each round's progress, the rest waits in e_i (digits, 4 workers, 4 epochs at a cosine rate: 0.81; every
value in 2 bits, ``topk: 4096``: 0.94; the default job, 10 epochs: 0.99).

Bytes per round and worker: (N−1) × ``SparseCode.nbytes(numel)`` for the parameters, ⌈numel/chunk⌉ × (k ×
(2 bytes of offset, 1 for chunks up to 256) + ⌈k·bits/8⌉ + 8 bytes of float32 scales): 152 per 4,096
values at the defaults, against 2(N−1)/N × 16,384 for DiLoCo's float32 all-reduce (54× less at N = 4, 27×
at N = 8: an all-gather grows with N). BatchNorm statistics are averaged in float32 as DiLoCo does (an
all-reduce beside the codes); mid-round validation reports a copy set to the workers' dense mean, as DiLoCo
does. ``comm_dtype: bf16|fp16`` (``bits: 32`` only) sends the code's values in 16 bits (summed in that type;
the rounding of this worker's own values goes into its e_i). ``final_metrics`` reports ``exchange_bytes``:
what all workers sent in the outer steps (codes and statistics; without validations and broadcasts).

Lost workers (``hardware.fault_tolerance=continue``): the survivors take worker 0's x_start and count, end
the round with one dense outer step over themselves, and keep their error feedback
(:meth:`SparseLoCo.recover`). An exchange broken by the loss may have completed on some survivors only;
the dense step then applies the round's sparse mean once more or once less for them, at most one round's
code. What is lost is the lost worker's progress, which no one has. New workers (``fault_tolerance=heal``)
join at a round's start with worker 0's x_start and e_i = 0 (they have made no progress); the others keep
theirs (nothing was in flight). Checkpoints: DiLoCo's state, this worker's e_i and the bytes count.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from runner.comm.flat import float_buffers
from runner.comm.sparse import BITS, Chunked, SparseCode
from runner.lazy import lazy_import
from runner.rules.base import RuleContext, no_grad
from runner.rules.diloco import DiLoCo, DiLoCoConfig
from runner.rules.period import PeriodicConfig
from runner.schema import RuleConfig, require

if TYPE_CHECKING:
    import torch

else:
    torch = lazy_import("torch")

DILOCO_KEYS = {f.name for f in fields(DiLoCoConfig)}


@dataclass
class SparseLoCoConfig(PeriodicConfig, RuleConfig):
    inner_steps: int = 10
    outer_lr: float = 1.0
    ef_decay: float = 0.95
    chunk: int = 4096
    topk: int = 64
    bits: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.inner_steps >= 1,
            "inner_steps",
            self.inner_steps,
            "local steps per round (H), >= 1 (e.g. 10 for short jobs; the paper's rounds are tens of steps)",
        )
        require(self.outer_lr > 0, "outer_lr", self.outer_lr, "must be > 0 (the paper's 1)")
        require(
            0 <= self.ef_decay <= 1,
            "ef_decay",
            self.ef_decay,
            "the error feedback's decay β, in [0, 1] (the paper's 0.95; 1: nothing decays; 0: what a "
            "round does not send is dropped)",
        )
        require(
            self.bits in BITS,
            "bits",
            self.bits,
            "the values' width: 2 (sign and one of two levels per chunk, the paper's), 1 (signs), or 32",
        )
        require(
            1 <= self.chunk <= 32768,
            "chunk",
            self.chunk,
            "values per chunk, in [1, 32768] (the paper's 4096)",
        )
        require(
            1 <= self.topk <= self.chunk,
            "topk",
            self.topk,
            f"values sent per chunk, in [1, rule.chunk={self.chunk}] (the paper's 64 of 4096; equal to "
            "rule.chunk: every value)",
        )
        require(
            self.comm_dtype == "fp32" or self.bits == 32,
            "comm_dtype",
            self.comm_dtype,
            f"a {self.bits}-bit code has its own float32 scales: set rule.bits=32 to send the values in "
            f"{self.comm_dtype}, or leave rule.comm_dtype=fp32",
        )

    def diloco(self) -> DiLoCoConfig:
        """The settings DiLoCo's rounds run with.

        The keys the two share, and its outer SGD without momentum nor ``compress`` (the error feedback and
        the sparse code take their places)."""
        shared = {f.name: getattr(self, f.name) for f in fields(self) if f.name in DILOCO_KEYS}
        return DiLoCoConfig(**shared, outer_momentum=0.0, nesterov=False)

    def build(self, ctx: RuleContext) -> SparseLoCo:
        return SparseLoCo(self, ctx)


class ErrorFeedback(Chunked):
    """One flat buffer's decaying error feedback e and its sparse exchange: e ← β·e + Δ_i − ĉ_i.

    The encoding in place of DiLoCo's ``compress`` (:class:`runner.comm.sparse.Chunked`); its residuals are
    saved by :meth:`SparseLoCo.state_dict`, not by DiLoCo's."""

    def state(self) -> list[torch.Tensor]:
        return []


class SparseLoCo(DiLoCo):
    """DiLoCo whose outer gradients travel as chunked top-k codes, with error feedback instead of momentum."""

    def __init__(self, cfg: SparseLoCoConfig, ctx: RuleContext):
        self.sparse = cfg  # (``self.cfg``: DiLoCo's settings, :meth:`SparseLoCoConfig.diloco`)
        super().__init__(cfg.diloco(), ctx)
        self.exchange_bytes = 0

    def _compressors(self) -> list[ErrorFeedback]:
        """Fresh (zero) error feedback per flat buffer: DiLoCo's outer step sends through it."""
        cfg = self.sparse
        code = SparseCode(cfg.chunk, cfg.topk, cfg.bits)
        return [ErrorFeedback(b, code, decay=cfg.ef_decay, wire=self.wire) for b in self.flat.buffers]

    def outer_step(self) -> None:
        """DiLoCo's (its sums encoded by :class:`ErrorFeedback`), its bytes counted."""
        before = self.workers.stats.bytes_sent
        super().outer_step()
        self.exchange_bytes += self.workers.stats.bytes_sent - before

    def metrics(self) -> dict[str, float]:
        """DiLoCo's, and the norm of worker 0's error feedback (its own: the workers' differ)."""
        norm = sum(
            float(torch.linalg.vector_norm(c.residual, dtype=torch.float64)) ** 2 for c in self.compressed
        )
        return {**super().metrics(), "residual_norm": norm**0.5}

    def final_metrics(self) -> dict[str, object]:
        """DiLoCo's, and the bytes all workers sent in the outer steps (collective)."""
        total = self.workers.allreduce_values([float(self.exchange_bytes)])[0]
        return {**super().final_metrics(), "exchange_bytes": int(total)}

    def state_dict(self) -> dict[str, Any]:
        """DiLoCo's, this worker's error feedback and the bytes count."""
        own = {
            "residuals": [c.residual.clone() for c in self.compressed],
            "exchange_bytes": self.exchange_bytes,
        }
        return {**super().state_dict(), **own}

    @no_grad
    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.exchange_bytes = state["exchange_bytes"]
        for c, saved in zip(self.compressed, state["residuals"], strict=True):
            c.residual.copy_(saved)

    @no_grad
    def recover(self) -> None:
        """The survivors end the round densely, once, and keep their error feedback.

        Worker 0's x_start and counts first, as DiLoCo's recovery; then x_start ← x_start − outer_lr ·
        mean_i(x_start − x_i), the round's outer step over the survivors, uncompressed (one all-reduce a loss)
        and every survivor takes it and starts a new round. Each keeps its e_i, its own and full-size,
        which later rounds send as before. DiLoCo instead restarts the round and zeroes the error
        feedback, which early in a SparseLoCo run is most of a worker's progress (digits, 2 epochs:
        validation accuracy 0.21 against 0.67, which the collapse guard ended). Folding e_i in at once
        overshoots instead: it holds overlapping rounds' remainders, and two of four workers lost at once
        ended at a validation loss above chance."""
        self._take_worker_0s_rounds()  # (no outer momentum here: x_start and the counts)
        k, stats = len(self.start), float_buffers(self.model)
        deltas = [x0 - x for x0, x in zip(self.start, self.flat.buffers, strict=True)]
        means = self._mean_of_workers(deltas) + self._mean_of_workers(stats)
        for x0, x, m in zip(self.start, self.flat.buffers, means[:k], strict=True):
            x0.sub_(m, alpha=self.cfg.outer_lr)
            x.copy_(x0)
        for b, m in zip(stats, means[k:], strict=True):
            b.copy_(m)
        self.round_step = 0

    def grow(self, joined: bool) -> None:
        """A new worker's error feedback and bytes count start at zero; the others keep theirs.

        (It came with worker 0's.)"""
        kept = self.compressed
        super().grow(joined)  # (DiLoCo's: fresh error feedback)
        if joined:
            self.exchange_bytes = 0
        else:
            self.compressed = kept
