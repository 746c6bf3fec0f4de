"""The language-model samples of ``data=shakespeare_char`` and ``data=tokens``: windows of a token sequence.

A shared helper, not a data set of its own. Window ``i`` of a split of ``N`` tokens is its tokens
``[i*T, i*T + T]`` (``T + 1`` of them, ``T = block_size``): input ``x = window[:-1]``, target
``y = window[1:]``, both int64 ``[T]``. Consecutive windows share one token, so every token of the split
after the first is a target exactly once per epoch; the ``(N - 1) % T`` tokens that fill no window are
left out. A batch is one fancy index over the tokens (no Python loop per sample), so the loaders' sharding,
shuffling and resumption (:mod:`runner.data.base`) apply unchanged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from runner.data.base import BatchedData


def window_count(tokens: int, block_size: int) -> int:
    """How many windows a split of ``tokens`` tokens yields."""
    return max(0, (tokens - 1) // block_size)


class TokenWindows(BatchedData):
    """The windows of a split held in memory as one integer tensor (converted to int64 per batch)."""

    def __init__(self, tokens: torch.Tensor, block_size: int):
        self.tokens, self.block_size = tokens, block_size
        self.offsets = torch.arange(block_size + 1)

    def __len__(self) -> int:
        return window_count(len(self.tokens), self.block_size)

    def positions(self, indices: list[int]) -> torch.Tensor:
        """The token positions of the windows ``indices``, ``[len(indices), block_size + 1]``."""
        idx = torch.as_tensor(indices, dtype=torch.long)
        if len(idx) and (int(idx.min()) < 0 or int(idx.max()) >= len(self)):
            raise IndexError(f"window index out of range 0..{len(self) - 1}")
        return idx[:, None] * self.block_size + self.offsets

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        return self.tokens[positions].long()

    def __getitems__(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        windows = self.gather(self.positions(indices))
        return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()


def out_of_range(path: Path, largest: int, vocab_size: int, dtype: str) -> str:
    """The error for a token id of ``path`` outside the vocabulary (data=tokens)."""
    return (
        f"data.vocab_size={vocab_size} is invalid: {path} holds token id {largest}: the vocabulary needs at "
        f"least {largest + 1} (fix meta.json or data.vocab_size), or data.dtype={dtype!r} is not the type "
        "the file was written in"
    )


class MappedWindows(TokenWindows):
    """The windows of a flat binary file of token ids (nanoGPT's ``train.bin``), read through a memory map
    opened lazily, so the data set pickles cheaply to loader processes (the pages a batch touches are all
    that is read). Where ``vocab_size`` is given, every batch's ids are checked to be below it."""

    def __init__(self, path: Path, dtype: str, block_size: int, vocab_size: int | None = None):
        self.path, self.dtype, self.block_size = Path(path), np.dtype(dtype), block_size
        self.vocab_size = vocab_size
        self.count = self.path.stat().st_size // self.dtype.itemsize
        self.offsets = torch.arange(block_size + 1)
        self._map: np.memmap | None = None

    @property
    def tokens(self) -> np.memmap:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.count,))
        return self._map

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_map": None}

    def __len__(self) -> int:
        return window_count(self.count, self.block_size)

    def gather(self, positions: torch.Tensor) -> torch.Tensor:
        windows = self.tokens[positions.numpy()]
        if self.vocab_size is not None and windows.size and int(windows.max()) >= self.vocab_size:
            raise ValueError(out_of_range(self.path, int(windows.max()), self.vocab_size, self.dtype.name))
        return torch.from_numpy(windows.astype(np.int64))

    def largest(self, chunk: int = 1 << 26) -> int:
        """The largest token id of the file (reads all of it, a chunk at a time); -1 for an empty file."""
        tokens = self.tokens
        return max((int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk)), default=-1)
