"""BSP: bulk-synchronous parallel SGD over MPI allreduce.

``mode: grads`` (synchronous data parallelism, as in Goyal et al. 2017, arXiv 1706.02677): every step each of
the N ranks computes its gradient g_i on its own batch of b samples and all ranks step with the mean

    g = (1/N) Σ_i g_i,

which is the gradient of the mean loss over the global batch of N·b samples: N ranks with batch b follow
exactly the trajectory of one process with batch N·b. The 1/N is folded into the loss (``loss_scale``), so
backward produces g_i/N directly into buckets of ``bucket_mb`` megabytes (the gradients are views of the
buckets from the second step on) and the buckets are summed by all-reduce: no pass over the gradients
besides the all-reduce itself. With ``overlap: thread`` each
bucket's all-reduce starts, on a communication thread, as soon as backward has produced all of its gradients,
so communication overlaps the rest of backward; ``nonblocking`` uses MPI's non-blocking all-reduce instead,
``none`` all-reduces after backward, and ``auto`` picks by the hardware (see ``BSP.auto_overlap``).

``mode: params`` (model averaging / local SGD, Zinkevich et al. 2010; Lin et al. 2020, arXiv 1808.07217):
each rank steps on its own gradient and every ``avg_freq`` steps all ranks replace their parameters with the
mean x ← (1/N) Σ_i x_i. With ``avg_freq: 1`` and plain SGD this equals ``mode: grads``.

``comm_dtype: bf16|fp16`` sends the gradients (or parameters) in 16 bits with float32 sums
(runner/comm/wire.py): half the bytes; validation's averages stay in float32.

``compress: int8|topk|topk_2bit|sign`` (``mode: grads`` only) sends each bucket compressed, with error
feedback (runner/comm/encodings/): each worker adds its residual e_i to its bucket a_i = g_i/N + e_i, sends
c(a_i) and keeps e_i ← a_i − c(a_i), and every worker steps with Σ_i c(a_i). ``int8``: blocks of 256 values
with one float32 scale each, summed by a reduce-scatter with re-quantization (an all-to-all of the int8
chunks, each rank sums its chunk and quantizes the sum again, keeping that rounding as its own residual, an
all-gather): 2(N−1)/N·(1 + 4/256) bytes per value, 0.254 of float32's. ``topk``: the k =
⌈``topk_ratio``·numel⌉ largest |values| of each bucket (the bucket, not each tensor: one message a bucket, and
error feedback gives the layers that lose now their turn later), by all-gather of int32 indices and float32
values: N·ratio of float32's bytes. ``topk_2bit`` (per chunk of 4,096 its ⌈ratio·4096⌉ largest, 2-bit values)
and ``sign`` (1-bit signs, a scale per 256 values) travel as chunked codes by all-gather
(runner/comm/sparse.py). ``error_feedback: false`` drops what was not sent. A compressed bucket is exchanged
after backward (``overlap: none``; ``auto`` resolves to it), with the blocking calls.

``lr_scaling: linear`` multiplies the learning rate by N (the global batch is N times larger), reached by a
linear warm-up from the base rate over ``warmup_epochs`` epochs (Goyal et al. 2017): :meth:`BSP.lr_factor`,
which the loop multiplies into the ``schedule``'s rate. With ``train.accumulate: k`` the buckets are
all-reduced once per step, during the last micro-batch's backward (:meth:`BSP.micro_batch`). In both modes the
BatchNorm running statistics (and, in ``params`` mode, the parameters) are averaged before each validation,
so every rank validates the same model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runner.comm.encodings import compressors, feedback_state, load_feedback
from runner.comm.flat import FlatTensors, float_buffers, message_buffer
from runner.lazy import lazy_import
from runner.rules.base import Rule, RuleContext, check_compress
from runner.rules.period import PeriodicConfig, Periods, rate
from runner.schema import RuleConfig, one_of, require

if TYPE_CHECKING:
    import torch

    from runner.comm import BackgroundRequest, DistRequest, Request
    from runner.comm.encodings.base import Encoding
else:
    torch = lazy_import("torch")


@dataclass
class BSPConfig(PeriodicConfig, RuleConfig):
    mode: str = "grads"
    bucket_mb: float = 4.0
    overlap: str = "auto"
    avg_freq: int = 1
    lr_scaling: str = "none"
    warmup_epochs: float = 0.0
    compress: str = "none"
    topk_ratio: float = 0.01
    error_feedback: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_compress(self.compress, self.topk_ratio, self.comm_dtype)
        require(
            self.compress == "none" or self.mode == "grads",
            "compress",
            self.compress,
            "compresses mode=grads' gradients: set rule.mode=grads, or rule.compress=none to average "
            "parameters",
        )
        require(
            self.compress == "none" or self.overlap in ("auto", "none"),
            "overlap",
            self.overlap,
            f"compress={self.compress} exchanges the buckets after backward: set rule.overlap=none (or auto)",
        )
        one_of("mode", self.mode, ("grads", "params"))
        one_of("lr_scaling", self.lr_scaling, ("none", "linear"))
        one_of("overlap", self.overlap, ("auto", "thread", "nonblocking", "none"))
        require(self.bucket_mb > 0, "bucket_mb", self.bucket_mb, "bucket size in MB must be > 0 (e.g. 4)")
        require(self.avg_freq >= 1, "avg_freq", self.avg_freq, "average every N >= 1 steps")
        if self.mode == "grads":
            self.fixed_period(
                "mode=grads averages the gradients every step (the period is rule.mode=params' avg_freq)"
            )
        require(self.warmup_epochs >= 0, "warmup_epochs", self.warmup_epochs, "must be >= 0")
        require(
            self.comm_dtype == "fp32" or self.overlap != "nonblocking",
            "overlap",
            self.overlap,
            f"comm_dtype={self.comm_dtype} runs on the communication thread or after backward: "
            "set rule.overlap=thread, none or auto",
        )

    def build(self, ctx: RuleContext) -> BSP:
        return BSP(self, ctx)


class _Bucket:
    """Gradients of a few parameters packed into one flat buffer, all-reduced as one message."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.buffer = message_buffer(
            sum(p.numel() for p in params), params[0].dtype, params[0].device, zero=True
        )
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.packed: set[int] = set()
        self.request: Request | BackgroundRequest | DistRequest | None = None


class BSP(Rule):
    """Synchronous data parallelism: mean of gradients each step, or of parameters every ``avg_freq``."""

    def __init__(self, cfg: BSPConfig, ctx: RuleContext):
        super().__init__(ctx, comm_dtype=cfg.comm_dtype)
        self.cfg = cfg
        self.alone = self.comm.size == 1
        params = [p for p in self.model.parameters() if p.requires_grad]
        device = params[0].device if params else torch.device("cpu")
        self.overlap = self.auto_overlap(device) if cfg.overlap == "auto" else cfg.overlap
        if cfg.compress != "none":
            self.overlap = "none"
        self.flat = FlatTensors(params) if cfg.mode == "params" and not self.alone else None
        grads = cfg.mode == "grads" and not self.alone
        self.buckets = self._make_buckets(params, int(cfg.bucket_mb * 2**20)) if grads else []
        self.slot = {id(p): (b, i) for b in self.buckets for i, p in enumerate(b.params)}
        for bucket in self.buckets:
            self.comm.keep(bucket.buffer)
        self.compressed = self._compressors()
        self.next_launch = 0
        self.periods = Periods(cfg, cfg.avg_freq)  # mode=params: ``rule.period_schedule`` of avg_freq
        self.hold = False  # a micro-batch before the last of an accumulated step: gradients stay local
        if grads and self.overlap != "none":
            for p in params:
                p.register_post_accumulate_grad_hook(self._grad_ready)

    def _compressors(self) -> list[Encoding]:
        """One compressed exchange per bucket (``rule.compress``), with fresh error feedback."""
        return compressors(self.cfg, (b.buffer for b in self.buckets), self.comm.size)

    @staticmethod
    def auto_overlap(device: torch.device) -> str:
        """``thread`` where the all-reduce can run beside the backward pass, else ``none``.

        It can with a GPU, or two or more cores for this rank; on one core the communication thread only
        competes with compute (benchmarks/README.md, "Numbers behind design choices")."""
        return "thread" if device.type == "cuda" or len(os.sched_getaffinity(0)) >= 2 else "none"

    @staticmethod
    def _make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[_Bucket]:
        """Buckets in reverse registration order, the order in which backward produces gradients."""
        buckets: list[_Bucket] = []
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed(params):
            if current and (
                size + p.numel() * p.element_size() > bucket_bytes
                or (p.dtype, p.device) != (current[0].dtype, current[0].device)
            ):
                buckets.append(_Bucket(current))
                current, size = [], 0
            current.append(p)
            size += p.numel() * p.element_size()
        if current:
            buckets.append(_Bucket(current))
        return buckets

    # -- learning-rate scaling -------------------------------------------------------------------------
    def lr_factor(self, step: int) -> float:
        """Multiplier of the base learning rate at ``step``: 1, or N after a linear warm-up."""
        if self.cfg.lr_scaling == "none" or self.comm.size == 1:
            return 1.0
        n, warmup = self.comm.size, self.cfg.warmup_epochs
        epoch = step / max(1, self.steps_per_epoch)
        if warmup > 0 and epoch < warmup:
            return 1.0 + (n - 1) * epoch / warmup
        return float(n)

    def micro_batch(self, last: bool) -> None:
        self.hold = not last

    # -- mode: grads -----------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> float:
        return 1.0 / self.comm.size if self.buckets else 1.0

    def grad_buffers(self) -> list[torch.Tensor]:
        return [b.buffer for b in self.buckets]

    def _pack(self, bucket: _Bucket, i: int, grad: torch.Tensor | None) -> None:
        """Put gradient ``i`` of ``bucket`` into the bucket's buffer, unless backward wrote it there.

        The gradient is already divided by N through the loss."""
        view = bucket.views[i]
        if grad is None:
            view.zero_()
        elif grad is not view and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)

    def _grad_ready(self, p: torch.nn.Parameter) -> None:
        if self.hold:
            return
        bucket, i = self.slot[id(p)]
        self._pack(bucket, i, p.grad)
        bucket.packed.add(i)
        while self.next_launch < len(self.buckets) and len(self.buckets[self.next_launch].packed) == len(
            self.buckets[self.next_launch].params
        ):
            bucket = self.buckets[self.next_launch]
            if self.overlap == "thread":
                bucket.request = self.comm.allreduce_background(bucket.buffer, wire=self.wire)
            else:
                bucket.request = self.comm.iallreduce(bucket.buffer)
            self.next_launch += 1
        if self.overlap == "nonblocking":
            for b in self.buckets[: self.next_launch]:
                b.request.test()

    def after_backward(self, step: int) -> None:
        """Finish the mean of gradients: all-reduce the buckets not yet started, wait for the others.

        Buckets not started during backward (a parameter got no gradient, or ``overlap: none``) use the
        blocking all-reduce, about twice as fast as Open MPI's non-blocking algorithms
        (benchmarks/allreduce.py); with ``overlap: thread`` they are queued behind the started ones on the
        communication thread instead, since two threads must not run collectives on one communicator.
        """
        if not self.buckets:
            return
        for j, bucket in enumerate(self.buckets[self.next_launch :], start=self.next_launch):
            for i, (p, view) in enumerate(zip(bucket.params, bucket.views, strict=True)):
                if p.grad is not view and i not in bucket.packed:
                    self._pack(bucket, i, p.grad)
            if self.overlap == "thread":
                bucket.request = self.comm.allreduce_background(bucket.buffer, wire=self.wire)
            elif self.compressed:
                self.comm.allreduce(bucket.buffer, encoding=self.compressed[j])
            else:
                self.comm.allreduce(bucket.buffer, wire=self.wire)
        for bucket in self.buckets:
            if bucket.request is not None:
                bucket.request.wait()
            bucket.request = None
            bucket.packed.clear()
            for p, view in zip(bucket.params, bucket.views, strict=True):
                if p.grad is not view:
                    p.grad = view
        self.next_launch = 0

    # -- mode: params ----------------------------------------------------------------------------------
    def after_step(self, step: int) -> None:
        if self.flat is not None and self.periods.due(step, rate(self.optimizer)):
            self._average(self.flat.buffers, self.wire)

    def eval_models(self) -> dict[str, torch.nn.Module]:
        if self.alone:
            return {"": self.model}
        if self.flat is not None:
            self._average(self.flat.buffers)
        self._average(float_buffers(self.model))
        return {"": self.model}

    # -- error feedback in checkpoints ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``compress``'s error feedback and, with ``mode: params``, where the period schedule stands.

        The error feedback is this worker's residuals (and its chunks' of the sums), with the number of
        workers they were made for."""
        return {**feedback_state(self.compressed, self.comm.size), "periods": self.periods.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the saved residuals where they fit (the same compression and number of workers).

        Else start from none, as after a change of workers."""
        load_feedback(self.compressed, state, self.comm.size)
        self.periods.load_state_dict(state.get("periods"))

    # -- lost workers --------------------------------------------------------------------------------------
    def abandon(self) -> None:
        """Let the bucket all-reduces in flight fail (the gradients are recomputed: the step is redone)."""
        from runner.comm import PeerLost

        for bucket in self.buckets:
            if bucket.request is not None:
                try:
                    bucket.request.wait()
                except PeerLost:
                    pass
            bucket.request = None
            bucket.packed.clear()
        self.next_launch = 0

    def grow(self, joined: bool) -> None:
        """Nothing to do: the new workers took worker 0's parameters and optimizer.

        From now on the mean (and ``lr_scaling``) is over all workers. A run started alone has no buckets to
        grow from."""
        super().grow(joined)
        if self.alone and self.comm.size > 1:
            raise ValueError("rule=bsp started with devices=1 cannot take joining workers: start with 2")
        self.compressed = self._compressors()  # each residual was this worker's, its chunks over N before

    def recover(self) -> None:
        """Make the survivors' state consistent again, as the mode requires.

        ``grads``: nothing (from now on the mean is over the survivors, and ``lr_scaling`` scales by their
        number). ``params``: the survivors average their parameters at once, so all start equal again.
        ``compress``: the error feedback starts anew (the chunks of the sums have other owners now)."""
        self.compressed = self._compressors()
        if self.flat is not None:
            self._average(self.flat.buffers)
