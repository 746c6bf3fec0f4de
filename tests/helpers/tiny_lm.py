"""A language-modelling problem a tiny model learns exactly, for task=language_model end to end: plain torch
classes, as a user's project would have them."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset


class Counting(Dataset):
    """``size`` sequences of ``length`` token ids counting up modulo ``vocab`` from a random start; the sample
    is (tokens, next tokens): the next token is always (t + 1) mod vocab."""

    def __init__(self, size: int = 512, length: int = 12, vocab: int = 16, seed: int = 0):
        starts = torch.randint(0, vocab, (size, 1), generator=torch.Generator().manual_seed(seed))
        tokens = (starts + torch.arange(length + 1)) % vocab
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class NextToken(nn.Module):
    """Scores of the next token from the current one alone: [batch, time] ids -> [batch, time, vocab]."""

    def __init__(self, vocab: int = 16, width: int = 32):
        super().__init__()
        self.embed, self.out = nn.Embedding(vocab, width), nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.embed(x)))
