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

from runner.schema import ModelConfig, require


@dataclass
class LSTMConfig(ModelConfig):
    input_shape: list[int] = field(default_factory=lambda: [64])  # [seq_len]; not used by the model
    num_classes: int = 2
    vocab_size: int | None = 10000  # token ids 0 .. vocab_size - 1, from the text data set (None: no text)
    embed_dim: int = 128  # size of the token embeddings
    hidden: int = 128  # LSTM hidden size (per direction)
    num_layers: int = 1  # stacked LSTM layers
    bidirectional: bool = False  # also read the sequence backwards; the classifier sees both final states
    dropout: float = 0.0  # between stacked LSTM layers (needs num_layers >= 2)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.vocab_size is not None,
            "vocab_size",
            self.vocab_size,
            "model=lstm reads token ids: use data=text (it sets the vocabulary); this data set has none",
        )
        require(
            len(self.input_shape) == 1,
            "input_shape",
            self.input_shape,
            "the LSTM reads sequences of token ids, [length] (data=text data.shape=[64]), not images",
        )
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

    def build(self) -> nn.Module:
        return LSTMClassifier(self)


class LSTMClassifier(nn.Module):
    def __init__(self, cfg: LSTMConfig):
        super().__init__()
        self.embedding = nn.Embedding(cfg.vocab_size, cfg.embed_dim, padding_idx=0)
        self.lstm = nn.LSTM(
            cfg.embed_dim,
            cfg.hidden,
            num_layers=cfg.num_layers,
            batch_first=True,
            bidirectional=cfg.bidirectional,
            dropout=cfg.dropout,
        )
        self.directions = 2 if cfg.bidirectional else 1
        self.classifier = nn.Linear(cfg.hidden * self.directions, cfg.num_classes)

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
