"""GoogLeNet / Inception v1 (Szegedy et al., "Going Deeper with Convolutions", CVPR 2015,
arXiv:1409.4842), in the layout of torchvision's ``googlenet``.

Stem (7×7/2 convolution, max pool, 1×1 and 3×3 convolutions, max pool), nine Inception modules 3a-5b with
the channel counts of the paper's Table 1 and max pools after 3b and 4e, global average pool, dropout and
a linear classifier. Every convolution is followed by BatchNorm (eps 0.001) and ReLU, as in torchvision
(the paper predates BatchNorm). Like torchvision, the "5×5" branch of each Inception module uses a 3×3
convolution; with it the network has 6,624,904 parameters for 1000 classes, without auxiliary heads. The
input must be at least 15×15.

``aux_logits=True`` adds the two auxiliary classifiers of the paper (after 4a and 4d: 4×4 average pool,
1×1 convolution to 128 channels, fully connected 1024, dropout 0.7, linear) as modules, but ``forward``
always returns only the main logits so that the generic training loop works unchanged; their outputs are
available from :meth:`GoogLeNet.forward_aux`, and the training loop adds no auxiliary loss. Unused by
``forward``, their parameters get no gradient.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from runner.schema import ModelConfig, require

#: Smallest height and width that survive the three 3×3/2 max pools (two in the stem, one after 3b).
MIN_SIZE = 15


class BasicConv2d(nn.Module):
    """Convolution without bias, BatchNorm, ReLU."""

    def __init__(self, cin: int, cout: int, kernel_size: int, stride: int = 1, padding: int = 0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel_size, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn(self.conv(x)))


class Inception(nn.Module):
    """Four parallel branches, concatenated: 1×1; 1×1→3×3; 1×1→3×3 (the paper's 5×5); pool→1×1."""

    def __init__(
        self, cin: int, ch1x1: int, ch3x3red: int, ch3x3: int, ch5x5red: int, ch5x5: int, pool_proj: int
    ):
        super().__init__()
        self.branch1 = BasicConv2d(cin, ch1x1, 1)
        self.branch2 = nn.Sequential(
            BasicConv2d(cin, ch3x3red, 1), BasicConv2d(ch3x3red, ch3x3, 3, padding=1)
        )
        self.branch3 = nn.Sequential(
            BasicConv2d(cin, ch5x5red, 1), BasicConv2d(ch5x5red, ch5x5, 3, padding=1)
        )
        self.branch4 = nn.Sequential(
            nn.MaxPool2d(3, stride=1, padding=1, ceil_mode=True), BasicConv2d(cin, pool_proj, 1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([self.branch1(x), self.branch2(x), self.branch3(x), self.branch4(x)], 1)


class InceptionAux(nn.Module):
    """Auxiliary classifier: 4×4 average pool, 1×1 convolution (128), FC 1024, dropout 0.7, linear."""

    def __init__(self, cin: int, num_classes: int, dropout: float = 0.7):
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d((4, 4))
        self.conv = BasicConv2d(cin, 128, 1)
        self.fc1 = nn.Linear(2048, 1024)
        self.fc2 = nn.Linear(1024, num_classes)
        self.dropout = nn.Dropout(p=dropout)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.flatten(self.conv(self.pool(x)), 1)
        return self.fc2(self.dropout(self.relu(self.fc1(x))))


@dataclass
class GoogLeNetConfig(ModelConfig):
    input_shape: list[int] = field(default_factory=lambda: [3, 224, 224])
    num_classes: int = 1000
    aux_logits: bool = False  # add the two auxiliary heads (``forward`` still returns only the main logits)
    dropout: float = 0.2  # before the final linear layer

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_image(MIN_SIZE)
        require(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")

    def build(self) -> nn.Module:
        return GoogLeNet(self)


class GoogLeNet(nn.Module):
    def __init__(self, cfg: GoogLeNetConfig):
        super().__init__()
        num_classes = cfg.num_classes
        self.conv1 = BasicConv2d(cfg.input_shape[0], 64, 7, stride=2, padding=3)
        self.maxpool1 = nn.MaxPool2d(3, stride=2, ceil_mode=True)
        self.conv2 = BasicConv2d(64, 64, 1)
        self.conv3 = BasicConv2d(64, 192, 3, padding=1)
        self.maxpool2 = nn.MaxPool2d(3, stride=2, ceil_mode=True)

        self.inception3a = Inception(192, 64, 96, 128, 16, 32, 32)
        self.inception3b = Inception(256, 128, 128, 192, 32, 96, 64)
        self.maxpool3 = nn.MaxPool2d(3, stride=2, ceil_mode=True)

        self.inception4a = Inception(480, 192, 96, 208, 16, 48, 64)
        self.inception4b = Inception(512, 160, 112, 224, 24, 64, 64)
        self.inception4c = Inception(512, 128, 128, 256, 24, 64, 64)
        self.inception4d = Inception(512, 112, 144, 288, 32, 64, 64)
        self.inception4e = Inception(528, 256, 160, 320, 32, 128, 128)
        self.maxpool4 = nn.MaxPool2d(2, stride=2, ceil_mode=True)

        self.inception5a = Inception(832, 256, 160, 320, 32, 128, 128)
        self.inception5b = Inception(832, 384, 192, 384, 48, 128, 128)

        self.aux1 = InceptionAux(512, num_classes) if cfg.aux_logits else None
        self.aux2 = InceptionAux(528, num_classes) if cfg.aux_logits else None

        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.dropout = nn.Dropout(p=cfg.dropout)
        self.fc = nn.Linear(1024, num_classes)
        # torchvision's initialisation: a normal of std 0.01 truncated at ±2, i.e. 200 standard deviations
        # out, where no draw lands; drawn untruncated, the same distribution 20-30x faster (trunc_normal_
        # took 2-3 s of every GoogLeNet's construction on 2 cores).
        for m in self.modules():
            if isinstance(m, (nn.Conv2d, nn.Linear)):
                nn.init.normal_(m.weight, mean=0.0, std=0.01)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def _run(
        self, x: torch.Tensor, with_aux: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        aux1 = aux2 = None
        x = self.maxpool1(self.conv1(x))
        x = self.maxpool2(self.conv3(self.conv2(x)))
        x = self.maxpool3(self.inception3b(self.inception3a(x)))
        x = self.inception4a(x)
        if with_aux and self.aux1 is not None:
            aux1 = self.aux1(x)
        x = self.inception4d(self.inception4c(self.inception4b(x)))
        if with_aux and self.aux2 is not None:
            aux2 = self.aux2(x)
        x = self.maxpool4(self.inception4e(x))
        x = self.inception5b(self.inception5a(x))
        return self.fc(self.dropout(torch.flatten(self.avgpool(x), 1))), aux1, aux2

    def forward_aux(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """Main logits and the logits of the auxiliary heads after 4a and 4d (None without ``aux_logits``)."""
        return self._run(x, with_aux=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Main logits only, in training and evaluation mode (the auxiliary heads are not run)."""
        return self._run(x, with_aux=False)[0]
