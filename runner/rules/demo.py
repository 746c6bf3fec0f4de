"""DeMo: decoupled momentum, each step's fast components exchanged as a few DCT coefficients per chunk.

Decoupled Momentum Optimization (Peng, Quesnelle, Kingma 2024, arXiv 2411.19870; Nous Psyche's DisTrO). Each
worker i keeps its own momentum m_i over the model's flat gradient buffer (one per dtype and device). At each
step t, with g_i its local gradient, D the orthonormal DCT-II of ``chunk`` = C values (D·Dᵀ = I) and the
buffer cut in chunks of C (the last padded with zeros):

    m_i ← β·m_i + g_i
    c_i = D·m_i per chunk;   ĉ_i = the ``topk`` = k largest |c_i| of each chunk (the others 0)
    m_i ← m_i − Dᵀ·ĉ_i                    (what is extracted leaves the momentum)
    Q = Dᵀ·(1/N) Σ_j code(ĉ_j)             (the same on every worker)
    θ ← θ − lr·sign(Q)  with ``sign: true``;  θ ← θ − lr·Q  without

code(ĉ) is ĉ as it travels (runner/comm/sparse.py): ``bits: 32`` exactly (``comm_dtype: bf16|fp16``: in 16
bits, summed in that type), ``bits: 1`` the signs with one float32 scale per chunk (the mean |ĉ| of its k),
as Psyche sends them, ``bits: 2`` sign and one of two levels. What leaves the momentum is ĉ itself, not its
code, as in the paper's reference code (the quantization error is not fed back). The chunks are those of the
flat buffer, not of each tensor (the paper cuts each tensor, matrices in 2-D blocks of C × C): one DCT and
one message for the whole model, and a chunk may straddle two tensors. The update direction is written into
``p.grad`` and the loop's optimizer steps, which must be plain SGD (``optim=sgd optim.momentum=0``: DeMo holds
the momentum); SGD's ``weight_decay`` w then decays decoupled, θ ← θ − lr·(sign(Q) + w·θ), as the reference
code does. With k = C, ``bits: 32`` and no sign, every component is extracted each step (m is emptied) and
the update is SGD on the workers' mean gradient, ``rule=bsp`` with plain SGD (equal to rounding).

``delay: d`` applies Q of step t − d at step t, as Psyche does with d = 1 so that the exchange overlaps the
next step's computation; the first d steps apply nothing (the zero direction: only SGD's weight decay acts),
and the last d directions are never applied. The communicator has no non-blocking all-gather, so here the
exchange is made at once and only its application is late: the semantics, not the overlap.

Defaults: β = 0.999, C = 64, 1-bit signs, sign updates (the paper's and Psyche's); k = 8 of 64 and d = 0.
The paper keeps 32 of each 64 × 64 block (1/128), for long runs of large models; the default job's small CNN
(digits, 4 workers, 5 epochs, seeds 0-2) ends at 0.975/0.956/0.983 with k = 4, 0.992/0.969/0.981 with k = 8,
0.992/0.964/0.989 with k = 16 (0.953 with k = 1). Sign updates move every parameter by lr each step: a rate
near 1/50 of SGD's (``optim.lr=0.001`` on the default job; at 0.003 its last epochs swing to 0.75-0.88;
``sign: false`` takes SGD's usual rates).

Bytes per step and worker, for a buffer of R = ⌈P/C⌉ chunks: (N − 1) · (R·k·b + v), with b = 1 byte per
offset (C ≤ 256; 2 above; none when k = C) and v = ⌈R·k/8⌉ + 4R with ``bits: 1`` (the signs packed, a
float32 scale a chunk), ⌈R·k/4⌉ + 8R with 2, R·k times the value's size with 32: an all-gather, so it grows
with N, where BSP's all-reduce sends 2(N − 1)/N · 4 bytes per value. The defaults: 13 bytes per 64 values
(float32: 256); the default job's CNN (56,554 values) 11,492 bytes a step to each other worker, with 4
workers 34,476 against BSP's 339,324 (9.8× less; with 2 workers 19.7×). Also worker 0's model broadcast at
build (all workers start from it, whatever ``train.same_init``) and each validation's mean of the BatchNorm
statistics (a float32 all-reduce).

Every worker applies the same update, so the parameters stay identical; BatchNorm statistics stay each
worker's own (from its batches) and are averaged before each validation. Lost workers
(``hardware.fault_tolerance=continue``): nothing to repair, the means are over the survivors from then on;
the parameters and the delayed directions (the means of exchanges that completed before the loss, the lost
worker's part included) are identical on all survivors and are applied as planned; an exchange the loss
broke committed nothing, and the step is redone; each momentum stays its worker's (a survivor whose exchange
failed where another's completed takes that one's whole state, momentum included, from the loop's recovery).
New workers (``heal``) join at any step with worker 0's model and delayed directions and an empty momentum
of their own. A worker whose step is not finite poisons the exchange, so every worker skips it alike
(``train.on_nonfinite=skip``, with ``delay`` too) and its state stays as before. Checkpoints: each worker's
momentum, the delayed directions and the exchange count. One worker alone extracts and codes its momentum
the same way and sends nothing. ``train.precision=fp16`` is not supported (the gradient scaler would divide
the direction by its scale), and ``train.grad_clip`` clips the direction (norm √P with sign updates).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runner.comm.flat import float_buffers
from runner.comm.sparse import BITS, SparseCode, sparse_allgather
from runner.lazy import lazy_import
from runner.rules.base import Rule, RuleContext, no_grad
from runner.schema import RuleConfig, require

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")

OPTIM_HINT = (
    "rule=demo keeps the momentum itself (rule.beta) and writes its update into the gradients for plain SGD "
    "to apply: set optim=sgd optim.momentum=0 (SGD's weight decay stays, decoupled), and a rate for sign "
    "updates, about 1/50 of SGD's (optim.lr=0.001 on the default job; rule.sign=false takes SGD's rates)"
)


@dataclass
class DeMoConfig(RuleConfig):
    beta: float = 0.999
    chunk: int = 64
    topk: int = 8
    sign: bool = True
    bits: int = 1
    delay: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        require(0 <= self.beta < 1, "beta", self.beta, "the momentum's decay, in [0, 1) (the paper's 0.999)")
        require(
            1 <= self.chunk <= 32768,
            "chunk",
            self.chunk,
            "values per DCT chunk, 1..32768 (the paper's 64)",
        )
        require(
            1 <= self.topk <= self.chunk,
            "topk",
            self.topk,
            f"coefficients kept per chunk, 1..rule.chunk={self.chunk} (e.g. 8; rule.topk={self.chunk}: all)",
        )
        require(
            self.bits in BITS,
            "bits",
            self.bits,
            "bits per coefficient sent: 1 (signs and a scale per chunk, Psyche's), 2, or 32 (exact)",
        )
        require(
            self.comm_dtype == "fp32" or self.bits == 32,
            "comm_dtype",
            self.comm_dtype,
            f"rule.bits={self.bits} sends {self.bits}-bit codes already; 16-bit coefficients need "
            "rule.bits=32",
        )
        require(self.delay >= 0, "delay", self.delay, "steps the update is applied late, >= 0 (Psyche's 1)")

    def check_optim(self, optim: Any) -> None:
        """Plain SGD only: DeMo's momentum replaces the optimizer's."""
        from runner.optim.sgd import SGDConfig

        if not isinstance(optim, SGDConfig):
            require(False, "optim", getattr(optim, "path", type(optim).__name__), OPTIM_HINT)
            return
        require(optim.momentum == 0, "optim.momentum", optim.momentum, OPTIM_HINT)
        require(not optim.nesterov, "optim.nesterov", optim.nesterov, OPTIM_HINT)

    def build(self, ctx: RuleContext) -> DeMo:
        return DeMo(self, ctx)


def dct_matrix(n: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """The orthonormal DCT-II of ``n`` values as an n × n matrix D (c = D·x; x = Dᵀ·c), made in float64."""
    k = torch.arange(n, dtype=torch.float64)[:, None]
    j = torch.arange(n, dtype=torch.float64)[None, :]
    d = torch.cos(math.pi * (2 * j + 1) * k / (2 * n)) * math.sqrt(2 / n)
    d[0] /= math.sqrt(2)
    return d.to(dtype=dtype, device=device)


class _Buffer:
    """The gradients of one dtype and device in one flat buffer, this worker's momentum, pending directions.

    ``p.grad`` are views of the buffer from the first step on; the directions are those not yet applied."""

    def __init__(self, params: list[torch.nn.Parameter], chunk: int, delay: int):
        self.params = params
        first = params[0]
        self.numel = sum(p.numel() for p in params)
        self.grad = torch.zeros(self.numel, dtype=first.dtype, device=first.device)
        self.views: list[torch.Tensor] = []
        offset = 0
        for p in params:
            self.views.append(self.grad[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        self.rows = -(-self.numel // chunk)
        self.momentum = torch.zeros_like(self.grad)
        self.pending = torch.zeros(delay, self.numel, dtype=first.dtype, device=first.device)
        self.dct = dct_matrix(chunk, first.dtype, first.device)

    @no_grad
    def pack(self) -> None:
        """Make ``p.grad`` the views of the flat buffer, copying the gradients autograd put elsewhere."""
        for p, view in zip(self.params, self.views, strict=True):
            if p.grad is None:
                view.zero_()
            elif p.grad is not view:
                if p.grad.data_ptr() != view.data_ptr():
                    view.copy_(p.grad)
                p.grad = view

    def chunks(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` as rows of one chunk each, the last padded with zeros (a copy)."""
        rows = torch.zeros(self.rows * self.dct.shape[0], dtype=flat.dtype, device=flat.device)
        rows[: self.numel] = flat
        return rows.view(self.rows, -1)

    def inverse(self, coefficients: torch.Tensor) -> torch.Tensor:
        """Dᵀ·c of each chunk of ``coefficients`` (rows × chunk), flat, the padding dropped."""
        return (coefficients @ self.dct).reshape(-1)[: self.numel]


class DeMo(Rule):
    """Sign-SGD on the workers' mean of the momenta's largest DCT components, extracted each step."""

    def __init__(self, cfg: DeMoConfig, ctx: RuleContext):
        super().__init__(ctx, comm_dtype=cfg.comm_dtype)
        self.cfg = cfg
        self.code = SparseCode(cfg.chunk, cfg.topk, cfg.bits)
        groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in self.model.parameters():
            if p.requires_grad:
                groups.setdefault((p.dtype, p.device), []).append(p)
        self.buffers = [_Buffer(ps, cfg.chunk, cfg.delay) for ps in groups.values()]
        self._take_worker_0_model()
        self.exchanges = 0
        self.code_bytes = self._code_bytes()

    @no_grad
    def _take_worker_0_model(self) -> None:
        """All workers start from worker 0's parameters and buffers, and apply the same updates from there."""
        if self.workers.size > 1 and not self.joined:  # joined: worker 0's model comes with the state
            for t in [*self.model.parameters(), *self.model.buffers()]:
                self.workers.broadcast(t.data, root=0)

    def _code_bytes(self) -> int:
        """Bytes of one worker's code per step (all buffers; 32-bit codes in ``comm_dtype``'s width).

        Each worker sends it to the N − 1 others."""
        wire = None if self.wire is None else self.wire.itemsize
        return sum(self.code.nbytes(b.numel, wire or b.grad.element_size()) for b in self.buffers)

    def grad_buffers(self) -> list[torch.Tensor]:
        return [b.grad for b in self.buffers]

    @no_grad
    def after_backward(self, step: int) -> None:
        """Exchange this step's extracted components, then write the direction into the gradients.

        All communication comes first: a failed exchange (a lost worker) leaves the momenta as they were."""
        results = [self._exchange(b) for b in self.buffers]
        for b, (momentum, direction, ok) in zip(self.buffers, results, strict=True):
            b.momentum.copy_(torch.where(ok, momentum, b.momentum))
            if self.cfg.delay:
                queued = torch.cat([b.pending[1:], direction[None]])
                direction = b.pending[0].clone()
                b.pending.copy_(torch.where(ok, queued, b.pending))
            # not finite: poisoned on every worker alike, so that all of them skip (or stop at) this step
            b.grad.copy_(torch.where(ok, direction, float("nan")))
        self.exchanges += 1

    def _exchange(self, b: _Buffer) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Buffer ``b``'s new momentum, this step's direction (sign(Q) or Q) and whether Q is finite."""
        b.pack()
        momentum = b.momentum * self.cfg.beta + b.grad
        coefficients = b.chunks(momentum) @ b.dct.T
        sent = coefficients if self.wire is None else coefficients.to(self.wire)
        if self.workers.size == 1:  # (sparse_allgather would keep every coefficient of one rank)
            mine = self.code.encode(sent.reshape(-1))[1]
            total = mine
        else:
            total, mine = sparse_allgather(self.workers, sent.reshape(-1), self.code)
        kept = mine.view_as(sent)
        if kept.dtype != coefficients.dtype or self.cfg.bits != 32:  # the kept coefficients, exactly
            kept = torch.where(kept != 0, coefficients, 0.0)
        momentum -= b.inverse(kept)
        mean = total.view_as(sent).to(coefficients.dtype) / self.workers.size
        q = b.inverse(mean)
        return momentum, q.sign() if self.cfg.sign else q, torch.isfinite(q).all()

    @no_grad
    def eval_models(self) -> dict[str, torch.nn.Module]:
        """The workers' model (identical parameters), BatchNorm statistics set to the workers' mean."""
        if self.workers.size > 1:
            self._average(float_buffers(self.model))
        return {"": self.model}

    def metrics(self) -> dict[str, float]:
        """Exchanges so far, this worker's momentum norm (what is left after extraction), bytes of a code."""
        norm = math.hypot(*(float(torch.linalg.vector_norm(b.momentum)) for b in self.buffers))
        return {"exchanges": self.exchanges, "momentum_norm": norm, "code_bytes": self.code_bytes}

    def final_metrics(self) -> dict[str, object]:
        return {"exchanges": self.exchanges, "code_bytes": self.code_bytes}

    def state_dict(self) -> dict[str, Any]:
        """This worker's momentum, the directions not yet applied, the exchange count."""
        return {
            "momentum": [b.momentum.clone() for b in self.buffers],
            "pending": [b.pending.clone() for b in self.buffers],
            "exchanges": self.exchanges,
        }

    @no_grad
    def load_state_dict(self, state: dict[str, Any]) -> None:
        for b, m, pending in zip(self.buffers, state["momentum"], state["pending"], strict=True):
            b.momentum.copy_(m)
            b.pending.copy_(pending)
        self.exchanges = state["exchanges"]

    @no_grad
    def grow(self, joined: bool) -> None:
        """A new worker starts its own momentum empty; the means are over all from now on.

        It took worker 0's model, delayed directions and exchange count (the same on every worker) and
        momentum; the momentum is each worker's own."""
        super().grow(joined)
        if joined:
            for b in self.buffers:
                b.momentum.zero_()

    def recover(self) -> None:
        """Nothing to repair; the means are over the survivors from now on.

        Parameters and delayed directions are alike on every survivor (the module's docstring), and each
        momentum stays its own."""
