"""A small convolutional network with BatchNorm, sized for 8×8 to 32×32 inputs.

conv(w)-conv(2w)-pool-conv(2w)-global pool-linear, with BatchNorm after each convolution. This is the
default job's model, so importing this module does not import torch: the launcher reads the schema from it.
The network is an ``nn.Sequential`` of ``features`` and ``classifier``; its class :class:`CNN` is defined,
and torch imported, on first use (``from models.cnn import CNN`` or :meth:`CNNConfig.build`).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from runner.schema import ModelConfig, require

if TYPE_CHECKING:
    from torch import nn

#: Smallest height and width that survive the 2×2 max pool.
MIN_SIZE = 2


@dataclass
class CNNConfig(ModelConfig):
    width: int = 32  # channels of the first convolution; the two others have 2 × width
    batch_norm: bool = True  # BatchNorm after each convolution (which then has no bias)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.require_image(MIN_SIZE)
        require(self.width >= 1, "width", self.width, "number of channels of the first layer, >= 1")

    def build(self) -> nn.Module:
        return _network_class()(self)


def _block(cin: int, cout: int, batch_norm: bool) -> list[nn.Module]:
    from torch import nn

    conv = nn.Conv2d(cin, cout, 3, padding=1, bias=not batch_norm)
    return [conv, nn.BatchNorm2d(cout), nn.ReLU()] if batch_norm else [conv, nn.ReLU()]


@cache
def _network_class() -> type[nn.Sequential]:
    from torch import nn

    class CNN(nn.Sequential):
        """``features`` (convolutions, max pool, global average pool, flatten), then ``classifier``."""

        def __init__(self, cfg: CNNConfig):
            w, bn = cfg.width, cfg.batch_norm
            features = nn.Sequential(
                *_block(cfg.input_shape[0], w, bn),
                *_block(w, 2 * w, bn),
                nn.MaxPool2d(2),
                *_block(2 * w, 2 * w, bn),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
            )
            super().__init__(OrderedDict(features=features, classifier=nn.Linear(2 * w, cfg.num_classes)))

    CNN.__qualname__ = "CNN"
    return CNN


def __getattr__(name: str) -> type[nn.Sequential]:
    if name == "CNN":
        return _network_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
