"""Wide residual network WRN-d-k (Zagoruyko & Komodakis, "Wide Residual Networks", BMVC 2016,
arXiv:1605.07146) for 32×32 images (CIFAR), as in the paper's official code
(github.com/szagoruyko/wide-residual-networks).

A 3×3 convolution to 16 channels, then three groups of n = (d - 4) / 6 pre-activation blocks with
16k, 32k and 64k channels (strides 1, 2, 2); each block is BN-ReLU-conv3×3-BN-ReLU-[dropout]-conv3×3, added
to the input, or, where the shape changes, to a 1×1 convolution of the pre-activated input. Then
BN-ReLU, global average pool (the official code's 8×8 average pool at 32×32 inputs) and a linear layer.
Convolutions have no bias. WRN-28-10 for 10 classes: 36,479,194 parameters; WRN-16-4: 2,748,890.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from runner.schema import ModelConfig, require


class WideBlock(nn.Module):
    """Pre-activation basic block; the 1×1 shortcut convolution sees the pre-activated input."""

    def __init__(self, cin: int, cout: int, stride: int, dropout: float):
        super().__init__()
        self.bn0 = nn.BatchNorm2d(cin)
        self.conv0 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv1 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.dropout = dropout
        self.convdim = nn.Conv2d(cin, cout, 1, stride=stride, bias=False) if cin != cout else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        o1 = F.relu(self.bn0(x))
        y = F.relu(self.bn1(self.conv0(o1)))
        if self.dropout > 0:
            y = F.dropout(y, p=self.dropout, training=self.training)
        z = self.conv1(y)
        return z + (x if self.convdim is None else self.convdim(o1))


@dataclass
class WideResNetConfig(ModelConfig):
    input_shape: list[int] = field(default_factory=lambda: [3, 32, 32])
    num_classes: int = 10
    depth: int = 16  # 6n+4: n blocks per group (16, 22, 28, 40)
    widen_factor: int = 4  # k: the groups have 16k, 32k and 64k channels
    dropout: float = 0.0  # between the two convolutions of each block (the paper uses 0.3)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_image()
        require(
            self.depth >= 10 and (self.depth - 4) % 6 == 0,
            "depth",
            self.depth,
            "must be 6n+4 with n >= 1 (e.g. 16, 22, 28, 40)",
        )
        require(self.widen_factor >= 1, "widen_factor", self.widen_factor, "must be >= 1 (e.g. 4 or 10)")
        require(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")

    def build(self) -> nn.Module:
        return WideResNet(self)


class WideResNet(nn.Module):
    def __init__(self, cfg: WideResNetConfig):
        super().__init__()
        n = (cfg.depth - 4) // 6
        k = cfg.widen_factor
        widths = [16 * k, 32 * k, 64 * k]
        self.conv0 = nn.Conv2d(cfg.input_shape[0], 16, 3, padding=1, bias=False)
        blocks: list[nn.Module] = []
        cin = 16
        for width, stride in zip(widths, (1, 2, 2), strict=True):
            for i in range(n):
                blocks.append(WideBlock(cin, width, stride if i == 0 else 1, cfg.dropout))
                cin = width
        self.blocks = nn.Sequential(*blocks)
        self.bn = nn.BatchNorm2d(cin)
        self.fc = nn.Linear(cin, cfg.num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.blocks(self.conv0(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))
