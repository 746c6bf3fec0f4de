"""VGG (Simonyan & Zisserman, "Very Deep Convolutional Networks for Large-Scale Image Recognition",
ICLR 2015, arXiv:1409.1556), in the layout of torchvision's ``vgg11`` ... ``vgg19_bn``.

Configurations A (11 layers), B (13), D (16) and E (19) of the paper: stacks of 3×3 convolutions with
64-128-256-512-512 channels, each stack followed by a 2×2 max pool; with ``batch_norm`` a BatchNorm follows
every convolution (the convolutions keep their bias, as in torchvision). Then an adaptive average pool to
7×7 and the classifier 4096-4096-``num_classes`` with dropout. VGG-16: 138,357,544 parameters for 1000
classes, 138,365,992 with BatchNorm. The input must be at least 32×32 (five halvings).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from runner.schema import ModelConfig, require

#: Output channels of each 3×3 convolution, "M" for a 2×2 max pool, by depth (weight layers).
LAYERS: dict[int, list[int | str]] = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    13: [64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [
        64,
        64,
        "M",
        128,
        128,
        "M",
        256,
        256,
        256,
        256,
        "M",
        512,
        512,
        512,
        512,
        "M",
        512,
        512,
        512,
        512,
        "M",
    ],
}

#: Smallest height and width that survive the five 2×2 max pools.
MIN_SIZE = 32


@dataclass
class VGGConfig(ModelConfig):
    input_shape: list[int] = field(default_factory=lambda: [3, 224, 224])
    num_classes: int = 1000
    depth: int = 16  # weight layers: 11, 13, 16 or 19 (configurations A, B, D, E)
    batch_norm: bool = False  # BatchNorm after every convolution
    dropout: float = 0.5  # after each of the two hidden fully connected layers

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_image(MIN_SIZE)
        require(self.depth in LAYERS, "depth", self.depth, "choose one of 11, 13, 16, 19")
        require(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")

    def build(self) -> nn.Module:
        return VGG(self)


def _features(in_channels: int, layers: list[int | str], batch_norm: bool) -> nn.Sequential:
    modules: list[nn.Module] = []
    c = in_channels
    for v in layers:
        if v == "M":
            modules.append(nn.MaxPool2d(kernel_size=2, stride=2))
            continue
        modules.append(nn.Conv2d(c, v, kernel_size=3, padding=1))
        if batch_norm:
            modules.append(nn.BatchNorm2d(v))
        modules.append(nn.ReLU(inplace=True))
        c = v
    return nn.Sequential(*modules)


class VGG(nn.Module):
    def __init__(self, cfg: VGGConfig):
        super().__init__()
        self.features = _features(cfg.input_shape[0], LAYERS[cfg.depth], cfg.batch_norm)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(512 * 7 * 7, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=cfg.dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=cfg.dropout),
            nn.Linear(4096, cfg.num_classes),
        )
        # torchvision's initialisation.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))
