"""AlexNet (Krizhevsky, Sutskever & Hinton, "ImageNet Classification with Deep Convolutional Neural Networks",
NeurIPS 2012), in the single-tower layout of torchvision's ``alexnet`` (the "one weird trick" variant,
Krizhevsky 2014, arXiv:1404.5997): five convolutions with 64-192-384-256-256 channels and three max pools,
an adaptive average pool to 6×6, then a dropout classifier 4096-4096-``num_classes``.

61,100,840 parameters for 3-channel inputs and 1000 classes. The adaptive pool makes the parameter count
independent of the input size; the input must be at least 63×63 (64×64 and 224×224 both work).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from runner.checks import require

#: Smallest height and width that survive the stride-4 stem and the three 3×3/2 max pools.
MIN_SIZE = 63


@dataclass
class AlexNetConfig:
    _target_: str = "models.alexnet.AlexNet"
    input_shape: list[int] = field(default_factory=lambda: [3, 224, 224])
    num_classes: int = 1000
    dropout: float = 0.5

    def __post_init__(self) -> None:
        require(len(self.input_shape) == 3, "input_shape", self.input_shape, "expected [C, H, W]")
        require(self.num_classes >= 1, "num_classes", self.num_classes, "must be >= 1")
        require(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")


SCHEMA = AlexNetConfig


class AlexNet(nn.Module):
    def __init__(self, input_shape: list[int], num_classes: int, dropout: float = 0.5):
        super().__init__()
        c, h, w = input_shape
        require(
            min(h, w) >= MIN_SIZE,
            "input_shape",
            list(input_shape),
            f"AlexNet needs height and width >= {MIN_SIZE} (e.g. data.shape=[{c},64,64])",
        )
        self.features = nn.Sequential(
            nn.Conv2d(c, 64, kernel_size=11, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))
