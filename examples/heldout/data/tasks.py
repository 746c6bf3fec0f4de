"""Two synthetic tasks of kinds the runner's own data sets do not cover, generated in memory from a seed.

``Signals``: 1-D signals of ``length`` samples, each a waveform of one of five kinds (sine, square,
sawtooth, a chirp, a decaying sine) with a random frequency, phase and amplitude and Gaussian noise; the
target is the kind. ``Markov``: token sequences drawn from one of ``classes`` Markov chains over ``vocab``
tokens whose transition rows differ a little; the target is the chain. Each split draws its own samples
from the same chains.
"""

from __future__ import annotations

import math

import torch
from torch.utils.data import Dataset

SPLITS = {"train": 1, "val": 2}


class Signals(Dataset):
    """``n`` signals ``[1, length]`` float32 with labels 0-4 (the waveform's kind)."""

    def __init__(
        self, n: int = 4000, length: int = 128, noise: float = 0.6, split: str = "train", seed: int = 0
    ):
        g = torch.Generator().manual_seed(seed * 10 + SPLITS[split])
        self.y = torch.randint(5, (n,), generator=g)
        t = torch.linspace(0, 1, length)[None, :]
        freq = 2 + 6 * torch.rand(n, 1, generator=g)
        phase = 2 * math.pi * torch.rand(n, 1, generator=g)
        amp = 0.5 + torch.rand(n, 1, generator=g)
        angle = 2 * math.pi * freq * t + phase
        kinds = torch.stack(
            [
                torch.sin(angle),
                torch.sign(torch.sin(angle)),
                2 * torch.remainder(angle / (2 * math.pi), 1.0) - 1,
                torch.sin(2 * math.pi * freq * t * (1 + 2 * t) + phase),
                torch.sin(angle) * torch.exp(-4 * t),
            ]
        )
        x = kinds[self.y, torch.arange(n)] * amp + noise * torch.randn(n, length, generator=g)
        self.x = x[:, None, :].float()
        self.classes = ["sine", "square", "sawtooth", "chirp", "decaying"]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Markov(Dataset):
    """``n`` sequences of ``length`` tokens (int64, < ``vocab``), each from one of ``classes`` Markov chains
    (transition rows: a shared random distribution plus ``contrast`` times one of the chain's own)."""

    def __init__(
        self,
        n: int = 4000,
        length: int = 48,
        vocab: int = 16,
        classes: int = 4,
        contrast: float = 1.0,
        split: str = "train",
        seed: int = 0,
    ):
        chains = torch.Generator().manual_seed(seed)
        shared = torch.rand(vocab, vocab, generator=chains)
        own = torch.rand(classes, vocab, vocab, generator=chains)
        rows = shared[None] + contrast * own * vocab / own.sum(-1, keepdim=True)
        probs = rows / rows.sum(-1, keepdim=True)
        g = torch.Generator().manual_seed(seed * 10 + SPLITS[split])
        self.y = torch.randint(classes, (n,), generator=g)
        tokens = torch.empty(n, length, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (n,), generator=g)
        for s in range(1, length):
            step = probs[self.y, tokens[:, s - 1]]
            tokens[:, s] = torch.multinomial(step, 1, generator=g)[:, 0]
        self.x = tokens
        self.classes = [f"chain{c}" for c in range(classes)]

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]
