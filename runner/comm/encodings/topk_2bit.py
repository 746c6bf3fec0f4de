"""The ``topk_2bit`` encoding: per chunk of 4,096 values its ⌈ratio·4096⌉ largest, in 2 bits (SparseLoCo's).

2-byte offsets and 2-bit values (sign and one of two levels per chunk), by all-gather: (N−1)·ratio·(2 + 1/4)
bytes per value plus 8 per chunk (:mod:`runner.comm.sparse`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.comm.encodings.topk import topk_count
from runner.comm.sparse import Chunked, SparseCode

if TYPE_CHECKING:
    import torch

#: Values per chunk (a smaller tensor is one chunk).
CHUNK = 4096


class TopK2Bit(Chunked):
    """Each chunk's ⌈ratio·chunk⌉ largest |values| in 2 bits, with error feedback."""

    name = "topk_2bit"

    def __init__(self, like: torch.Tensor, size: int, ratio: float = 0.01, feedback: bool = True):
        chunk = min(CHUNK, like.numel())
        super().__init__(like, SparseCode(chunk, topk_count(chunk, ratio), 2), feedback)
