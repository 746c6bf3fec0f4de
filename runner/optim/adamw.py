"""AdamW (Loshchilov & Hutter 2019, arXiv 1711.05101): ``torch.optim.AdamW``.

The paper: "Decoupled Weight Decay Regularization"."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.optim.adam import AdamConfig

if TYPE_CHECKING:
    import torch


@dataclass
class AdamWConfig(AdamConfig):
    """``torch.optim.AdamW``'s arguments and defaults: Adam's keys and checks, the weight decay decoupled.

    Decoupled from the moments: x ← x − lr·weight_decay·x before Adam's step (default 0.01, as torch's)."""

    weight_decay: float = 0.01

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        import torch

        return torch.optim.AdamW(params, **self.arguments())
