"""The int8 encoding: a reduce-scatter with re-quantization, 8-bit values and a float32 scale a block.

As the 16-bit exchange does (:mod:`runner.comm.wire`): each rank quantizes its tensor in blocks of ``block``
values sharing one float32 scale (the block's largest |value| / 127, values rounded to the nearest step:
error at most scale/2); an all-to-all gives rank r the r-th chunk of every rank; rank r sums them in float32
(in rank order), quantizes the sum once more, and an all-gather gives every rank the same bits. Each rank
sends 2(N−1)/N·(1 + 4/block) bytes per value (a float32 all-reduce: 2(N−1)/N·4), plus the padding of each
chunk to whole blocks. An all-gather of every rank's int8 tensor (each rank decompresses and sums) would send
(N−1)·(1 + 4/block) per value instead: 0.5 of float32's at N = 4, 1 at N = 8.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from runner.comm.encodings.base import Encoding, acc
from runner.lazy import lazy_import, no_grad

if TYPE_CHECKING:
    import torch

    from runner.comm.face import CommLike
    from runner.comm.links import Links
else:
    torch = lazy_import("torch")

#: Values per float32 scale in the int8 exchange of gradients and outer gradients: 4/256 = 1.6% more bytes
#: than the int8 values alone (0.254 of float32's), small enough to leave room in 0.25 ± 0.02 for the padding
#: of each rank's chunk to whole blocks, large enough that one scale is not spent on a few values.
BLOCK = 256


class Int8(Encoding):
    """:func:`int8_allreduce` in blocks of ``block``, with its error feedback and the chunk owner's."""

    name = "int8"

    def __init__(
        self, like: torch.Tensor, size: int, ratio: float = 0.01, feedback: bool = True, block: int = BLOCK
    ):
        super().__init__(like, feedback)
        self.block = block
        chunk = int8_chunk(like.numel(), size, block)
        self.owner = torch.zeros(chunk, dtype=acc(like), device=like.device) if feedback else None

    def _reduce(self, comm: CommLike, t: torch.Tensor) -> torch.Tensor:
        return int8_allreduce(comm, t, self.block, self.residual, self.owner)

    def seconds(self, links: Links, nodes: Sequence[int], t: torch.Tensor) -> float:
        chunk = int8_chunk(t.numel(), len(nodes), self.block)
        return links.two_phase(nodes, int8_row_bytes(chunk, self.block))

    def feedback(self) -> list[torch.Tensor]:
        return [x for x in (self.residual, self.owner) if x is not None]


@no_grad
def int8_allreduce(
    comm: CommLike,
    t: torch.Tensor,
    block: int = BLOCK,
    residual: torch.Tensor | None = None,
    owner: torch.Tensor | None = None,
) -> torch.Tensor:
    """In-place sum of the flat floating-point tensor ``t`` over ``comm`` with 8-bit traffic.

    The steps (the module's docstring): all-to-all of 8-bit chunks with their scales, sums in float32 (float64
    for a float64 ``t``) in rank order, the sums quantized again, all-gather. Every rank ends with the same
    bits.

    ``residual`` (``t``'s size): this rank's error feedback, added to ``t`` before quantizing and set to what
    the quantization left out. ``owner`` (:func:`int8_chunk` long): the same for this rank's chunk of the sum.

    """
    n = comm.size
    if n == 1:
        return t
    dtype = acc(t)
    device = t.device if comm.routes(t) else torch.device("cpu")
    numel = t.numel()
    chunk = int8_chunk(numel, n, block)
    padded = torch.zeros(n * chunk, dtype=dtype, device=device)
    padded[:numel].copy_(t.view(-1))
    if residual is not None:
        padded[:numel].add_(residual.view(-1).to(device, dtype))
    send = _pack(padded, n, block)
    if residual is not None:
        mine = torch.cat([_unpack(row, chunk, dtype, block) for row in send.view(n, -1)])
        residual.view(-1).copy_(padded[:numel] - mine[:numel])
    recv = torch.empty_like(send)
    comm.alltoall(send, recv)
    total = torch.zeros(chunk, dtype=dtype, device=device)
    for row in recv.view(n, -1):
        total.add_(_unpack(row, chunk, dtype, block))
    if owner is not None:
        total.add_(owner.to(device, dtype))
    summed = _pack(total, 1, block)
    if owner is not None:
        owner.copy_(total - _unpack(summed, chunk, dtype, block))
    gathered = torch.empty_like(send)
    comm.allgather(summed, gathered)
    out = torch.cat([_unpack(row, chunk, dtype, block) for row in gathered.view(n, -1)])
    t.view(-1).copy_(out[:numel])
    return t


def int8_chunk(numel: int, size: int, block: int = BLOCK) -> int:
    """Values per rank's chunk in :func:`int8_allreduce`: ``numel``/``size`` rounded up to whole blocks."""
    return -(-numel // (size * block)) * block


def int8_row_bytes(chunk: int, block: int = BLOCK) -> int:
    """Bytes of one rank's row in :func:`_pack` (``chunk`` values): int8 values, a float32 scale a block."""
    return chunk + 4 * (chunk // block)


def _pack(x: torch.Tensor, rows: int, block: int = BLOCK) -> torch.Tensor:
    """``x`` (a multiple of ``rows``·``block`` long) in 8 bits as bytes.

    Per row, its values' int8 then their blocks' float32 scales (the largest |value| / 127)."""
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
