"""A multi-layer perceptron over flattened inputs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from runner.checks import require


@dataclass
class MLPConfig:
    _target_: str = "models.mlp.MLP"
    input_shape: list[int] = field(default_factory=lambda: [1, 8, 8])
    num_classes: int = 10
    hidden: list[int] = field(default_factory=lambda: [128, 64])
    dropout: float = 0.0

    def __post_init__(self) -> None:
        require(all(h >= 1 for h in self.hidden), "hidden", self.hidden, "layer widths must be >= 1")
        require(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")


SCHEMA = MLPConfig


class MLP(nn.Module):
    def __init__(
        self, input_shape: list[int], num_classes: int, hidden: list[int] = (128, 64), dropout: float = 0.0
    ):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        width = math.prod(input_shape)
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = h
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
