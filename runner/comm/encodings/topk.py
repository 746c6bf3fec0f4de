"""The top-k encoding: each rank's k largest |values| with their int32 indices, by all-gather.

Sparse vectors do not add up in place: every rank adds the gathered values up in rank order into zeros, so
all end with the same bits. Each rank sends (N−1)·k·(4 + 4) bytes, N·ratio of a float32 all-reduce's (0.04
at N = 4 and 1%); ratios above 1/N would send more than the all-reduce.
"""

from __future__ import annotations

import math
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


class TopK(Encoding):
    """:func:`topk_allreduce` of a tensor's k = ⌈ratio·numel⌉ largest |values|, with its error feedback."""

    name = "topk"

    def __init__(self, like: torch.Tensor, size: int, ratio: float = 0.01, feedback: bool = True):
        super().__init__(like, feedback)
        self.k = topk_count(like.numel(), ratio)

    def _reduce(self, comm: CommLike, t: torch.Tensor) -> torch.Tensor:
        return topk_allreduce(comm, t, self.k, self.residual)

    def seconds(self, links: Links, nodes: Sequence[int], t: torch.Tensor) -> float:
        return links.collective("allgather", nodes, self.k * (4 + t.element_size()))


def topk_count(numel: int, ratio: float) -> int:
    """k: the values top-k sends of a tensor of ``numel`` (⌈ratio·numel⌉, at least 1)."""
    return max(1, min(numel, math.ceil(ratio * numel)))


@no_grad
def topk_allreduce(
    comm: CommLike, t: torch.Tensor, k: int, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """In-place sum over ``comm`` of every rank's ``k`` largest |values| of the flat tensor ``t``.

    ``residual``: this rank's error feedback, added to ``t`` and then set to what was not sent. The
    (int32 indices, values in ``t``'s type) travel as bytes. One rank alone sends nothing and keeps ``t`` as
    it is (as the int8 exchange does)."""
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
    total = torch.zeros(flat.numel(), dtype=acc(t), device=device)
    for row in gathered.view(n, -1):
        idx = row[: 4 * k].view(torch.int32).long()
        total.index_add_(0, idx, row[4 * k :].clone().view(t.dtype).to(total.dtype))  # clone: aligned
    flat.copy_(total)
    return t
