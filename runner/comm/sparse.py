"""Chunked sparse codes: each chunk's k largest |values|, their offsets and their values in 32, 2 or 1 bits.

The encoding of SparseLoCo's outer gradients (chunks of 4,096, k = 64, 2-bit values), DeMo's momentum
components (chunks of 64 DCT coefficients, 1-bit signs) and ``rule.compress=topk_2bit|sign``. A tensor is
padded with zeros to whole chunks; each chunk sends the offsets of its k largest |values| (1 byte each for
chunks up to 256, 2 bytes up to 32,768; none when k is the whole chunk) and their values:

* ``bits=32``: as they are (the tensor's own type: float64 stays float64, so an exchange with every value kept
  is exact);
* ``bits=2``: a sign bit and a level bit; the levels are the mean |value| of the chunk's smaller half and of
  its larger half of the k (two float32 scales per chunk: one step of Lloyd's two-level quantizer);
* ``bits=1``: the sign, and one float32 scale per chunk, the mean |value| of the k (so that a sum of codes
  keeps the magnitudes' order; a rule that applies the sign of the sum, as DeMo does, needs no scale).

:func:`sparse_allgather` exchanges the codes by all-gather (sparse codes do not add up in place): every rank
decodes every rank's code and adds them in rank order into zeros, so all end with the same bits, and the
communicator counts the bytes as they travel: (N−1) × :meth:`SparseCode.nbytes` per rank. SparseLoCo's
default, chunk 4,096, k 64, 2 bits, sends 64 × (2 + 1/4) + 8 = 152 bytes per 16,384 bytes of float32 (108×
less; 12-bit offsets as the paper packs them would give 120 bytes, 137×; not done: byte-aligned offsets keep
the decoder a view).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.comm.encodings.base import Encoding
from runner.lazy import lazy_import, no_grad

if TYPE_CHECKING:
    import torch

    from runner.comm.face import CommLike
    from runner.comm.links import Links
else:
    torch = lazy_import("torch")

#: The value widths a code may take.
BITS = (32, 2, 1)


@dataclass(frozen=True)
class SparseCode:
    """How a flat tensor of ``numel`` values is coded: ``k`` of every ``chunk`` values, in ``bits`` bits."""

    chunk: int
    k: int
    bits: int

    def __post_init__(self) -> None:
        assert self.bits in BITS, self.bits
        assert 1 <= self.k <= self.chunk <= 32768, (self.k, self.chunk)

    def chunks(self, numel: int) -> int:
        """Chunks of a tensor of ``numel`` values (the last one padded with zeros)."""
        return -(-numel // self.chunk)

    @property
    def dense(self) -> bool:
        """Whether every value of a chunk is sent (then no offsets travel)."""
        return self.k == self.chunk

    def index_bytes(self) -> int:
        """Bytes of one offset: none when dense, 1 for chunks up to 256, else 2."""
        return 0 if self.dense else (1 if self.chunk <= 256 else 2)

    def nbytes(self, numel: int, itemsize: int = 4) -> int:
        """Bytes of one rank's code of a tensor of ``numel`` values.

        ``itemsize``: its type's, for ``bits=32``. The offsets, the values (narrow ones packed across
        chunks) and the scales."""
        rows = self.chunks(numel)
        if self.bits == 32:
            values = rows * self.k * itemsize
        else:
            values = -(-rows * self.k * self.bits // 8) + 4 * rows * (2 if self.bits == 2 else 1)
        return rows * self.k * self.index_bytes() + values

    # -- coding ------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The code of the flat tensor ``x`` as bytes, and what it decodes to (``x``'s shape and type)."""
        rows = _rows(x.reshape(-1), self.chunk)
        if self.dense:
            index = torch.arange(self.chunk, device=x.device).expand_as(rows)
        else:
            index = rows.abs().topk(self.k, dim=1, sorted=False).indices
        values = rows.gather(1, index)
        parts, decoded_values = [], values
        if not self.dense:
            kind = torch.uint8 if self.index_bytes() == 1 else torch.int16
            parts.append(index.to(kind).contiguous().view(torch.uint8).view(-1))
        if self.bits == 32:
            parts.append(values.contiguous().view(torch.uint8).view(-1))
        else:
            codes, scales = _quantize(values, self.bits)
            parts += [_pack_bits(codes, self.bits), scales.contiguous().view(torch.uint8).view(-1)]
            decoded_values = _dequantize(codes, scales, self.bits).to(x.dtype)
        decoded = torch.zeros_like(rows).scatter_(1, index, decoded_values)
        return torch.cat(parts), decoded.view(-1)[: x.numel()].view_as(x)

    def decode_into(self, code: torch.Tensor, total: torch.Tensor) -> None:
        """Add the values of one rank's ``code`` to the flat ``total`` (its tensor's size and type)."""
        rows = self.chunks(total.numel())
        at = 0
        if self.dense:
            index = torch.arange(self.chunk, device=total.device).expand(rows, -1)
        else:
            kind = torch.uint8 if self.index_bytes() == 1 else torch.int16
            size = rows * self.k * self.index_bytes()
            index = code[:size].clone().view(kind).view(rows, self.k).long()  # clone: aligned
            at = size
        if self.bits == 32:
            size = rows * self.k * total.element_size()
            values = code[at : at + size].clone().view(total.dtype).view(rows, self.k)
        else:
            size = -(-rows * self.k * self.bits // 8)
            codes = _unpack_bits(code[at : at + size], self.bits, rows * self.k).view(rows, self.k)
            width = 2 if self.bits == 2 else 1
            scales = code[at + size : at + size + 4 * width * rows].clone().view(torch.float32)
            values = _dequantize(codes, scales.view(rows, width), self.bits).to(total.dtype)
        padded = torch.zeros(rows, self.chunk, dtype=total.dtype, device=total.device)
        padded.scatter_(1, index, values)
        total.add_(padded.view(-1)[: total.numel()])


class Chunked(Encoding):
    """A sum of every rank's :class:`SparseCode` of its tensor, by :func:`sparse_allgather`.

    With error feedback (``decay`` β: a = t + β·e); ``wire``: the 16-bit type ``bits=32`` values travel in
    (SparseLoCo's ``comm_dtype``). The encodings ``topk_2bit`` and ``sign`` are its kinds."""

    def __init__(
        self,
        like: torch.Tensor,
        code: SparseCode,
        feedback: bool = True,
        decay: float = 1.0,
        wire: torch.dtype | None = None,
    ):
        super().__init__(like, feedback)
        self.code, self.decay, self.wire = code, decay, wire

    @no_grad
    def _reduce(self, comm: CommLike, t: torch.Tensor) -> torch.Tensor:
        given = t.view(-1) if self.residual is None else t.view(-1).add(self.residual, alpha=self.decay)
        total, mine = sparse_allgather(comm, given if self.wire is None else given.to(self.wire), self.code)
        if self.residual is not None:  # e ← a − c(a)
            torch.sub(given, mine.view(-1).to(given.dtype), out=self.residual)
        return t.copy_(total.view_as(t))

    def seconds(self, links: Links, nodes: Sequence[int], t: torch.Tensor) -> float:
        itemsize = (self.wire or t.dtype).itemsize
        return links.collective("allgather", nodes, self.code.nbytes(t.numel(), itemsize))


def sparse_allgather(comm: CommLike, x: torch.Tensor, code: SparseCode) -> tuple[torch.Tensor, torch.Tensor]:
    """Every rank's ``code`` of its flat ``x``, all-gathered: the decoded codes' sum and this rank's own.

    The sum is taken in rank order (the same bits on every rank); this rank's own code is for error feedback.
    One rank alone sends nothing and keeps ``x`` as it is (both are copies of it), as the other compressed
    exchanges do."""
    with torch.no_grad():
        if comm.size == 1:
            return x.clone(), x.clone()
        payload, mine = code.encode(x)
        device = x.device if comm.routes(x) else torch.device("cpu")
        payload = payload.to(device)
        gathered = torch.empty(comm.size * payload.numel(), dtype=torch.uint8, device=device)
        comm.allgather(payload, gathered)
        total = torch.zeros(x.numel(), dtype=x.dtype, device=device)
        for row in gathered.view(comm.size, -1):
            code.decode_into(row, total)
        return total.to(x.device).view_as(x), mine


def _rows(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """``flat`` as rows of ``chunk`` values, the last padded with zeros."""
    rows = -(-flat.numel() // chunk)
    if rows * chunk == flat.numel():
        return flat.view(rows, chunk)
    padded = torch.zeros(rows * chunk, dtype=flat.dtype, device=flat.device)
    padded[: flat.numel()] = flat
    return padded.view(rows, chunk)


def _quantize(values: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes (uint8, ``bits`` wide) and float32 scales per row of ``values`` (the module's docstring)."""
    negative = (values < 0).to(torch.uint8)
    size = values.abs().to(torch.float32)
    if bits == 1:
        return negative, size.mean(dim=1, keepdim=True)
    ranked = size.sort(dim=1).values
    half = max(1, values.shape[1] // 2)
    low = ranked[:, :half].mean(dim=1, keepdim=True)
    high = ranked[:, half:].mean(dim=1, keepdim=True) if values.shape[1] > 1 else low
    upper = (size > (low + high) / 2).to(torch.uint8)  # the nearer level
    return negative | (upper << 1), torch.cat([low, high], dim=1)


def _dequantize(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """The values ``codes`` stand for, given each row's ``scales`` (float32)."""
    sign = 1.0 - 2.0 * (codes & 1).to(torch.float32)
    if bits == 1:
        return sign * scales
    level = torch.where((codes >> 1).bool(), scales[:, 1:2], scales[:, 0:1])
    return sign * level


def _pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``codes`` (uint8 below 2**bits) packed 8/bits to a byte, the first in the lowest bits."""
    per = 8 // bits
    flat = codes.reshape(-1)
    pad = -flat.numel() % per
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    grouped = flat.view(-1, per).to(torch.int32)
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=codes.device)
    return (grouped << shifts).sum(dim=1).to(torch.uint8)


def _unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` codes of :func:`_pack_bits`'s bytes."""
    shifts = torch.arange(0, 8, bits, dtype=torch.int32, device=packed.device)
    codes = (packed.to(torch.int32)[:, None] >> shifts) & ((1 << bits) - 1)
    return codes.view(-1)[:count].to(torch.uint8)
