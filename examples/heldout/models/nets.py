"""A small 1-D convolutional network for signals and a bigram network for token sequences."""

from __future__ import annotations

from torch import nn


class Conv1d(nn.Module):
    """Signals ``[channels, length]`` → three convolutions of ``width`` channels (ReLU, pooling) → classes."""

    def __init__(self, channels: int, classes: int, width: int = 32):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv1d(channels, width, 7, padding=3),
            nn.ReLU(),
            nn.MaxPool1d(2),
            nn.Conv1d(width, width, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool1d(2),
            nn.Conv1d(width, width, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool1d(1),
            nn.Flatten(),
            nn.Linear(width, classes),
        )

    def forward(self, x):
        return self.net(x)


class BigramNet(nn.Module):
    """Token sequences → an embedding of ``dim`` → a convolution over token pairs (``hidden`` channels,
    ReLU) averaged over the sequence → classes: it can count the chains' transitions."""

    def __init__(self, vocab: int, classes: int, dim: int = 16, hidden: int = 64):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pairs = nn.Conv1d(dim, hidden, 2)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        h = self.pairs(self.embed(x).transpose(1, 2)).relu().mean(dim=2)
        return self.head(h)
