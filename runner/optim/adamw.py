"""AdamW (Loshchilov & Hutter 2019, "Decoupled Weight Decay Regularization", arXiv 1711.05101):
``torch.optim.AdamW``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.optim.adam import AdamConfig

if TYPE_CHECKING:
    import torch


@dataclass
class AdamWConfig(AdamConfig):
    """``torch.optim.AdamW``'s arguments and defaults: Adam's keys and checks, with the weight decay
    decoupled from the moments, x ← x − lr·weight_decay·x before Adam's step (default 0.01, as torch's)."""

    weight_decay: float = 0.01

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        import torch

        return torch.optim.AdamW(params, **self.arguments())
