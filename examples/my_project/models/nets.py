"""A plain multi-layer perceptron."""

from __future__ import annotations

from torch import nn


class MLP(nn.Module):
    """``inputs`` features → ``layers`` hidden layers of ``hidden`` units (ReLU, or Tanh for smooth
    functions) → ``outputs`` values: class scores for classification, predicted values for regression."""

    def __init__(
        self, inputs: int, outputs: int, hidden: int = 64, layers: int = 2, activation: str = "relu"
    ):
        super().__init__()
        act = {"relu": nn.ReLU, "tanh": nn.Tanh}[activation]
        body, width = [], inputs
        for _ in range(layers):
            body += [nn.Linear(width, hidden), act()]
            width = hidden
        self.net = nn.Sequential(*body, nn.Linear(width, outputs))

    def forward(self, x):
        return self.net(x)
