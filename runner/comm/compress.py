"""Compressed sums with error feedback (``rule.compress``): fewer bytes than an all-reduce.

An all-reduce cannot sum int8 values that carry different scales, nor sparse vectors, so each kind travels
over the all-to-all and all-gather calls of the communicator, and its bytes are counted by those calls as they
really travel (:mod:`runner.comm.stats`):

* **int8** (:func:`int8_allreduce`), a reduce-scatter with re-quantization, as the 16-bit exchange does
  (:mod:`runner.comm.wire`): each rank quantizes its tensor in blocks of ``block`` values sharing one float32
  scale (the block's largest |value| / 127, values rounded to the nearest step: error at most scale/2); an
  all-to-all gives rank r the r-th chunk of every rank; rank r sums them in float32 (in rank order),
  quantizes the sum once more, and an all-gather gives every rank the same bits. Each rank sends
  2(N−1)/N·(1 + 4/block) bytes per value (a float32 all-reduce: 2(N−1)/N·4), plus the padding of each chunk
  to whole blocks. An all-gather of every rank's int8 tensor (each rank decompresses and sums) would send
  (N−1)·(1 + 4/block) per value instead: 0.5 of float32's at N = 4, 1 at N = 8.
* **top-k** (:func:`topk_allreduce`): each rank sends its k = ⌈ratio·numel⌉ largest |values| with their
  int32 indices, by all-gather (sparse vectors do not add up in place); every rank adds them up in rank
  order, the same bits everywhere. Each rank sends (N−1)·k·(4 + 4) bytes, N·ratio of a float32 all-reduce's
  (0.04 at N = 4 and 1%); ratios above 1/N would send more than the all-reduce.
* **top-k in 2 bits** (``topk_2bit``, :mod:`runner.comm.sparse`): per chunk of 4,096 values its
  ⌈ratio·4096⌉ largest |values|, 2-byte offsets and 2-bit values (sign and one of two levels per chunk), by
  all-gather: (N−1)·ratio·(2 + 1/4) bytes per value plus 8 per chunk (SparseLoCo's code).
* **signs** (``sign``, :mod:`runner.comm.sparse`): every value's sign in one bit, one float32 scale (the mean
  |value|) per 256 values, by all-gather: (N−1)·(1/8 + 4/256) bytes per value, 0.035·(N−1) of float32's
  (1-bit SGD, Seide et al. 2014, with its error feedback).

**Error feedback** (Seide et al. 2014; Karimireddy et al. 2019, arXiv 1901.09847): what a rank did not send
is added to its next tensor. :class:`Compressed` keeps each rank's residual e (same size as the tensor):
a = t + e is compressed to c(a), c(a) is what the rank contributes, and e ← a − c(a). With int8 the rank
that re-quantizes a chunk's sum keeps that rounding too (``owner``, 1/N of the tensor) and adds it to the
chunk's next sum (DoubleSqueeze, Tang et al. 2019, arXiv 1905.05957). So over any number of exchanges,
Σ (sums received) + Σ_ranks e + owner residuals = Σ (tensors given), up to float rounding
(tests/rules/test_compress.py). Without error feedback (``rule.error_feedback=false``) what is not sent is
lost: int8 rounds to nearest, nearly unbiased; top-k drops the small coordinates for good.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from runner.lazy import lazy_import

if TYPE_CHECKING:
    import torch

    from runner.comm.face import CommLike
else:
    torch = lazy_import("torch")

#: Values per float32 scale in the int8 exchange of gradients and outer gradients: 4/256 = 1.6% more bytes
#: than the int8 values alone (0.254 of float32's), small enough to leave room in 0.25 ± 0.02 for the padding
#: of each rank's chunk to whole blocks, large enough that one scale is not spent on a few values.
BLOCK = 256

KINDS = ("none", "int8", "topk", "topk_2bit", "sign")

#: The codes of the kinds that travel as chunked sparse codes (:mod:`runner.comm.sparse`): (chunk, bits).
CHUNKED = {"topk_2bit": (4096, 2), "sign": (BLOCK, 1)}


def _no_grad(fn: Any) -> Any:
    """``torch.no_grad()`` applied when called (torch is imported lazily)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            return fn(*args, **kwargs)

    wrapper.__doc__, wrapper.__name__ = fn.__doc__, fn.__name__
    return wrapper


def _acc(t: torch.Tensor) -> torch.dtype:
    """The sums' type: float64 for a float64 tensor, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


@_no_grad
def int8_allreduce(
    comm: CommLike,
    t: torch.Tensor,
    block: int = BLOCK,
    residual: torch.Tensor | None = None,
    owner: torch.Tensor | None = None,
) -> torch.Tensor:
    """In-place sum of the flat floating-point tensor ``t`` over ``comm`` with 8-bit traffic (the module's
    docstring): all-to-all of 8-bit chunks with their scales, sums in float32 (float64 for a float64 ``t``)
    in rank order, the sums quantized again, all-gather. Every rank ends with the same bits.

    ``residual`` (``t``'s size): this rank's error feedback, added to ``t`` before quantizing and set to what
    the quantization left out. ``owner`` (:func:`int8_chunk` long): the same for this rank's chunk of the sum.
    """
    n = comm.size
    if n == 1:
        return t
    acc = _acc(t)
    device = t.device if comm.routes(t) else torch.device("cpu")
    numel = t.numel()
    chunk = int8_chunk(numel, n, block)
    padded = torch.zeros(n * chunk, dtype=acc, device=device)
    padded[:numel].copy_(t.view(-1))
    if residual is not None:
        padded[:numel].add_(residual.view(-1).to(device, acc))
    send = _pack(padded, n, block)
    if residual is not None:
        mine = torch.cat([_unpack(row, chunk, acc, block) for row in send.view(n, -1)])
        residual.view(-1).copy_(padded[:numel] - mine[:numel])
    recv = torch.empty_like(send)
    comm.alltoall(send, recv)
    total = torch.zeros(chunk, dtype=acc, device=device)
    for row in recv.view(n, -1):
        total.add_(_unpack(row, chunk, acc, block))
    if owner is not None:
        total.add_(owner.to(device, acc))
    summed = _pack(total, 1, block)
    if owner is not None:
        owner.copy_(total - _unpack(summed, chunk, acc, block))
    gathered = torch.empty_like(send)
    comm.allgather(summed, gathered)
    out = torch.cat([_unpack(row, chunk, acc, block) for row in gathered.view(n, -1)])
    t.view(-1).copy_(out[:numel])
    return t


def int8_chunk(numel: int, size: int, block: int = BLOCK) -> int:
    """Values per rank's chunk in :func:`int8_allreduce`: ``numel``/``size`` rounded up to whole blocks."""
    return -(-numel // (size * block)) * block


def int8_row_bytes(chunk: int, block: int = BLOCK) -> int:
    """Bytes of one rank's row in :func:`_pack` (``chunk`` values): int8 values, a float32 scale a block."""
    return chunk + 4 * (chunk // block)


def _pack(x: torch.Tensor, rows: int, block: int = BLOCK) -> torch.Tensor:
    """``x`` (a multiple of ``rows``·``block`` long) in 8 bits as bytes: per row its values' int8 then their
    blocks' float32 scales (the largest |value| / 127)."""
    blocks = x.view(-1, block)
    scales = blocks.abs().amax(dim=1).div_(127).to(torch.float32)
    safe = torch.where(scales > 0, scales, torch.ones_like(scales)).to(x.dtype)
    q = blocks.div(safe[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return torch.cat(
        [q.view(rows, -1).view(torch.uint8), scales.view(rows, -1).view(torch.uint8)], dim=1
    ).view(-1)


def _unpack(row: torch.Tensor, chunk: int, acc: torch.dtype, block: int = BLOCK) -> torch.Tensor:
    """One row of :func:`_pack`'s bytes back to ``chunk`` values in ``acc``."""
    q = row[:chunk].view(torch.int8).to(acc).view(-1, block)
    scales = row[chunk:].view(torch.float32).to(acc)
    return q.mul_(scales[:, None]).view(-1)


def topk_count(numel: int, ratio: float) -> int:
    """k: the values top-k sends of a tensor of ``numel`` (⌈ratio·numel⌉, at least 1)."""
    return max(1, min(numel, math.ceil(ratio * numel)))


@_no_grad
def topk_allreduce(
    comm: CommLike, t: torch.Tensor, k: int, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """In-place sum over ``comm`` of every rank's ``k`` largest |values| of the flat tensor ``t`` (plus
    ``residual``, which then keeps what was not sent), by all-gather of (int32 indices, values in ``t``'s
    type) as bytes; every rank adds them up in rank order into zeros, so all end with the same bits. One rank
    alone sends nothing and keeps ``t`` as it is (as :func:`int8_allreduce` does)."""
    n = comm.size
    if n == 1:
        return t
    flat = t.view(-1)
    a = flat + residual.view(-1) if residual is not None else flat.clone()
    index = a.abs().topk(k, sorted=False).indices
    values = a[index]
    if residual is not None:
        a[index] = 0
        residual.view(-1).copy_(a)
    send = torch.cat([index.to(torch.int32).view(torch.uint8), values.contiguous().view(torch.uint8)])
    device = t.device if comm.routes(t) else torch.device("cpu")
    send = send.to(device)
    gathered = torch.empty(n * send.numel(), dtype=torch.uint8, device=device)
    comm.allgather(send, gathered)
    total = torch.zeros(flat.numel(), dtype=_acc(t), device=device)
    for row in gathered.view(n, -1):
        idx = row[: 4 * k].view(torch.int32).long()
        total.index_add_(0, idx, row[4 * k :].clone().view(t.dtype).to(total.dtype))  # clone: aligned
    flat.copy_(total)
    return t


class Compressed:
    """One tensor's compressed sums over the workers (a BSP bucket, a DiLoCo flat buffer), with its error
    feedback state: ``residual`` (this rank's, the tensor's size) and ``owner`` (int8: this rank's chunk of
    the sum); both None without error feedback."""

    def __init__(self, kind: str, like: torch.Tensor, size: int, ratio: float = 0.01, feedback: bool = True):
        assert kind in KINDS[1:], kind
        self.kind, self.size = kind, size
        self.k = topk_count(like.numel(), ratio)
        self.code = None
        if kind in CHUNKED:
            from runner.comm.sparse import SparseCode

            chunk, bits = CHUNKED[kind]
            chunk = min(chunk, like.numel())  # (a small tensor is one chunk)
            self.code = SparseCode(chunk, chunk if kind == "sign" else topk_count(chunk, ratio), bits)
        self.residual = torch.zeros_like(like).view(-1) if feedback else None
        chunk = int8_chunk(like.numel(), size)
        self.owner = (
            torch.zeros(chunk, dtype=_acc(like), device=like.device) if feedback and kind == "int8" else None
        )

    def allreduce(self, comm: CommLike, t: torch.Tensor) -> torch.Tensor:
        """In-place: ``t`` becomes the sum over ``comm`` of what every rank sends of its ``t`` (plus its
        residual)."""
        if self.kind == "int8":
            return int8_allreduce(comm, t, BLOCK, self.residual, self.owner)
        if self.code is not None:
            return self._sparse(comm, t)
        return topk_allreduce(comm, t, self.k, self.residual)

    @_no_grad
    def _sparse(self, comm: CommLike, t: torch.Tensor) -> torch.Tensor:
        """:meth:`allreduce` by :func:`runner.comm.sparse.sparse_allgather` (one rank alone: ``t`` as is)."""
        from runner.comm.sparse import sparse_allgather

        if comm.size == 1:
            return t
        a = t + self.residual.view_as(t) if self.residual is not None else t
        total, mine = sparse_allgather(comm, a, self.code)
        if self.residual is not None:
            self.residual.copy_((a - mine).view(-1))
        return t.copy_(total)

    def state(self) -> list[torch.Tensor]:
        """The error feedback's tensors (for checkpoints), cloned; empty without error feedback."""
        return [x.clone() for x in (self.residual, self.owner) if x is not None]

    @_no_grad
    def load(self, state: list[torch.Tensor]) -> None:
        """Restore :meth:`state`'s tensors."""
        for mine, saved in zip([x for x in (self.residual, self.owner) if x is not None], state, strict=True):
            mine.copy_(saved)


def compressors(cfg: Any, buffers: Iterable[torch.Tensor], workers: int) -> list[Compressed]:
    """One compressed exchange per buffer for a rule's ``cfg`` (``compress``, ``topk_ratio``,
    ``error_feedback``) over ``workers``, each with fresh error feedback; none for ``compress: none``."""
    if cfg.compress == "none":
        return []
    return [Compressed(cfg.compress, b, workers, cfg.topk_ratio, cfg.error_feedback) for b in buffers]


def feedback_state(compressed: list[Compressed], workers: int) -> dict[str, Any]:
    """A rule's error feedback for its checkpoint: every exchange's residuals and the number of ``workers``
    they were made for (empty without error feedback)."""
    states = [c.state() for c in compressed]
    return {"residuals": states, "workers": workers} if any(states) else {}


def load_feedback(compressed: list[Compressed], state: dict[str, Any], workers: int) -> None:
    """Restore :func:`feedback_state`'s residuals where they fit (the same exchanges and number of
    ``workers``); else the error feedback starts from zero, as after a change of workers."""
    saved = state.get("residuals")
    if saved is None or state.get("workers") != workers or len(saved) != len(compressed):
        return
    for c, tensors in zip(compressed, saved, strict=True):
        c.load(tensors)
