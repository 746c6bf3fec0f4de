"""A small convolutional network with BatchNorm, sized for 8×8 to 32×32 inputs."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from runner.checks import require


@dataclass
class CNNConfig:
    _target_: str = "models.cnn.CNN"
    input_shape: list[int] = field(default_factory=lambda: [1, 8, 8])
    num_classes: int = 10
    width: int = 32
    batch_norm: bool = True

    def __post_init__(self) -> None:
        require(self.width >= 1, "width", self.width, "number of channels of the first layer, >= 1")
        require(len(self.input_shape) == 3, "input_shape", self.input_shape, "expected [C, H, W]")


SCHEMA = CNNConfig


def _block(cin: int, cout: int, batch_norm: bool) -> list[nn.Module]:
    conv = nn.Conv2d(cin, cout, 3, padding=1, bias=not batch_norm)
    return [conv, nn.BatchNorm2d(cout), nn.ReLU()] if batch_norm else [conv, nn.ReLU()]


class CNN(nn.Module):
    """conv(w)-conv(2w)-pool-conv(2w)-global pool-linear; BatchNorm after each convolution."""

    def __init__(self, input_shape: list[int], num_classes: int, width: int = 32, batch_norm: bool = True):
        super().__init__()
        c = input_shape[0]
        self.features = nn.Sequential(
            *_block(c, width, batch_norm),
            *_block(width, 2 * width, batch_norm),
            nn.MaxPool2d(2),
            *_block(2 * width, 2 * width, batch_norm),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))
