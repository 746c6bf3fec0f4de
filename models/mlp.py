"""A multi-layer perceptron over flattened inputs.

Importing this module does not import torch (the launcher reads the schema from it): the network is an
``nn.Sequential`` whose class :class:`MLP` is defined, and torch imported, on first use
(``from models.mlp import MLP`` or :meth:`MLPConfig.build`).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from functools import cache
from typing import TYPE_CHECKING

from runner.schema import ModelConfig, require

if TYPE_CHECKING:
    from torch import nn


@dataclass
class MLPConfig(ModelConfig):
    hidden: list[int] = field(default_factory=lambda: [128, 64])  # widths of the hidden layers (ReLU)
    dropout: float = 0.0  # after each hidden layer

    def __post_init__(self) -> None:
        super().__post_init__()
        require(all(h >= 1 for h in self.hidden), "hidden", self.hidden, "layer widths must be >= 1")
        require(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")

    def build(self) -> nn.Module:
        return _network_class()(self)


@cache
def _network_class() -> type[nn.Sequential]:
    from torch import nn

    class MLP(nn.Sequential):
        """One child, ``net``: flatten, then linear-ReLU[-dropout] per hidden layer, then linear (parameter
        names ``net.1.weight``, ``net.3.weight``...)."""

        def __init__(self, cfg: MLPConfig):
            layers: list[nn.Module] = [nn.Flatten()]
            width = math.prod(cfg.input_shape)
            for h in cfg.hidden:
                layers += [nn.Linear(width, h), nn.ReLU()]
                if cfg.dropout > 0:
                    layers.append(nn.Dropout(cfg.dropout))
                width = h
            layers.append(nn.Linear(width, cfg.num_classes))
            super().__init__(OrderedDict(net=nn.Sequential(*layers)))

    MLP.__qualname__ = "MLP"
    return MLP


def __getattr__(name: str) -> type[nn.Sequential]:
    if name == "MLP":
        return _network_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
