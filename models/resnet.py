"""ResNet (He, Zhang, Ren & Sun, "Deep Residual Learning for Image Recognition", CVPR 2016,
arXiv:1512.03385), the ImageNet networks of the paper's Table 1 in the layout of torchvision's ``resnet18``
... ``resnet152``.

Stem: 7×7/2 convolution, BatchNorm, ReLU, 3×3/2 max pool; then four stages of 64-128-256-512 base
channels, the last three starting with stride 2; global average pool and a linear classifier. Depths 18 and
34 use the two-convolution ``BasicBlock``; 50, 101 and 152 the ``Bottleneck`` (1×1, 3×3, 1×1 with 4×
expansion) with the stride on the 3×3 convolution ("ResNet v1.5", as torchvision). Shortcuts are
identities, or a 1×1 convolution with BatchNorm when the shape changes (option B of the paper).
ResNet-18: 11,689,512 parameters, ResNet-50: 25,557,032 (1000 classes). The stem is the same for every
input size, so small images (32×32) are reduced to 1×1 before the last stage; the network still runs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from runner.schema import ModelConfig, require


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(inplanes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = _shortcut(inplanes, planes * self.expansion, stride)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


def _shortcut(inplanes: int, outplanes: int, stride: int) -> nn.Module | None:
    if stride == 1 and inplanes == outplanes:
        return None
    return nn.Sequential(
        nn.Conv2d(inplanes, outplanes, 1, stride=stride, bias=False),
        nn.BatchNorm2d(outplanes),
    )


#: Block type and number of blocks per stage, by depth (Table 1 of the paper).
LAYERS: dict[int, tuple[type[BasicBlock] | type[Bottleneck], list[int]]] = {
    18: (BasicBlock, [2, 2, 2, 2]),
    34: (BasicBlock, [3, 4, 6, 3]),
    50: (Bottleneck, [3, 4, 6, 3]),
    101: (Bottleneck, [3, 4, 23, 3]),
    152: (Bottleneck, [3, 8, 36, 3]),
}


@dataclass
class ResNetConfig(ModelConfig):
    input_shape: list[int] = field(default_factory=lambda: [3, 224, 224])
    num_classes: int = 1000
    depth: int = 50  # 18, 34 (basic blocks), 50, 101, 152 (bottleneck blocks)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_image()
        require(self.depth in LAYERS, "depth", self.depth, "choose one of 18, 34, 50, 101, 152")

    def build(self) -> nn.Module:
        return ResNet(self)


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig):
        super().__init__()
        block, counts = LAYERS[cfg.depth]
        self.inplanes = 64
        self.conv1 = nn.Conv2d(cfg.input_shape[0], 64, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._stage(block, 64, counts[0], stride=1)
        self.layer2 = self._stage(block, 128, counts[1], stride=2)
        self.layer3 = self._stage(block, 256, counts[2], stride=2)
        self.layer4 = self._stage(block, 512, counts[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(512 * block.expansion, cfg.num_classes)
        # torchvision's initialisation (the linear layer keeps PyTorch's default).
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _stage(
        self, block: type[BasicBlock] | type[Bottleneck], planes: int, count: int, stride: int
    ) -> nn.Sequential:
        blocks = []
        for i in range(count):
            blocks.append(block(self.inplanes, planes, stride if i == 0 else 1))
            self.inplanes = planes * block.expansion
        return nn.Sequential(*blocks)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))
