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

from runner.schema import ModelConfig, require

#: Smallest height and width that survive the stride-4 stem and the three 3×3/2 max pools.
MIN_SIZE = 63


@dataclass
class AlexNetConfig(ModelConfig):
    input_shape: list[int] = field(default_factory=lambda: [3, 224, 224])
    num_classes: int = 1000
    dropout: float = 0.5  # before each of the two hidden fully connected layers

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_image(MIN_SIZE)
        require(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")

    def build(self) -> nn.Module:
        return AlexNet(self)


class AlexNet(nn.Module):
    def __init__(self, cfg: AlexNetConfig):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(cfg.input_shape[0], 64, kernel_size=11, stride=4, padding=2),
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
            nn.Dropout(p=cfg.dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=cfg.dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, cfg.num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))
