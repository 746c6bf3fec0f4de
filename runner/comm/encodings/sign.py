"""The ``sign`` encoding: every value's sign in one bit and a float32 scale per 256 values (1-bit SGD).

The scale is the mean |value| of its 256 values; by all-gather: (N−1)·(1/8 + 4/256) bytes per value,
0.035·(N−1) of float32's (Seide et al. 2014, with its error feedback; :mod:`runner.comm.sparse`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from runner.comm.sparse import Chunked, SparseCode

if TYPE_CHECKING:
    import torch

#: Values per float32 scale (a smaller tensor has one).
CHUNK = 256


class Sign(Chunked):
    """Every value's sign in 1 bit, a scale per chunk, with error feedback (``ratio`` is not used)."""

    name = "sign"

    def __init__(self, like: torch.Tensor, size: int, ratio: float = 0.01, feedback: bool = True):
        chunk = min(CHUNK, like.numel())
        super().__init__(like, SparseCode(chunk, chunk, 1), feedback)
