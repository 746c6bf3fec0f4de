"""LSTM text classifier: token embedding, LSTM (Hochreiter & Schmidhuber, "Long Short-Term Memory", Neural
Computation 1997), and a linear classifier on the hidden state at the last valid time step.

Inputs are LongTensors [batch, seq_len] of token ids with 0 as padding, padded on the right. A sequence's
length is the position of its last non-zero id (ids of 0 before it count as tokens, with the zero
embedding of ``padding_idx``); an all-padding row counts as one step. The embedded batch is packed with
``pack_padded_sequence`` so the LSTM stops at each sequence's end, and the classifier reads the final
hidden state of the last layer: with ``bidirectional``, the forward direction's state at the last token
concatenated with the backward direction's state at the first token. ``dropout`` acts between stacked
LSTM layers only, so it needs ``num_layers >= 2``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from runner.checks import require


@dataclass
class LSTMConfig:
    _target_: str = "models.lstm.LSTMClassifier"
    input_shape: list[int] = field(default_factory=lambda: [64])
    num_classes: int = 2
    vocab_size: int = 10000
    embed_dim: int = 128
    hidden: int = 128
    num_layers: int = 1
    bidirectional: bool = False
    dropout: float = 0.0

    def __post_init__(self) -> None:
        # input_shape ([seq_len]) is not used by the model: it is here so every model takes the same keys.
        require(self.num_classes >= 1, "num_classes", self.num_classes, "must be >= 1")
        require(self.vocab_size >= 2, "vocab_size", self.vocab_size, "need id 0 (padding) and >= 1 token")
        require(self.embed_dim >= 1, "embed_dim", self.embed_dim, "must be >= 1")
        require(self.hidden >= 1, "hidden", self.hidden, "LSTM hidden size, >= 1")
        require(self.num_layers >= 1, "num_layers", self.num_layers, "number of stacked LSTM layers, >= 1")
        require(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")
        require(
            self.dropout == 0 or self.num_layers >= 2,
            "dropout",
            self.dropout,
            "dropout acts between stacked LSTM layers: set num_layers >= 2 or dropout=0",
        )


SCHEMA = LSTMConfig


class LSTMClassifier(nn.Module):
    def __init__(
        self,
        input_shape: list[int],
        num_classes: int,
        vocab_size: int = 10000,
        embed_dim: int = 128,
        hidden: int = 128,
        num_layers: int = 1,
        bidirectional: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        self.lstm = nn.LSTM(
            embed_dim,
            hidden,
            num_layers=num_layers,
            batch_first=True,
            bidirectional=bidirectional,
            dropout=dropout if num_layers > 1 else 0.0,
        )
        self.directions = 2 if bidirectional else 1
        self.classifier = nn.Linear(hidden * self.directions, num_classes)

    @staticmethod
    def lengths(tokens: torch.Tensor) -> torch.Tensor:
        """Per row: the position of the last non-zero id, plus one (at least 1), on the CPU."""
        positions = torch.arange(1, tokens.shape[1] + 1, device=tokens.device)
        return (positions * (tokens != 0)).amax(dim=1).clamp(min=1).cpu()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        packed = pack_padded_sequence(
            self.embedding(tokens), self.lengths(tokens), batch_first=True, enforce_sorted=False
        )
        _, (h_n, _) = self.lstm(packed)
        # h_n: [num_layers * directions, batch, hidden], in the batch's original order; keep the last layer.
        last = h_n[-self.directions :].transpose(0, 1).reshape(tokens.shape[0], -1)
        return self.classifier(last)
