"""Adam (Kingma & Ba 2015, arXiv 1412.6980): ``torch.optim.Adam``."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from runner.optim import OptimConfig, decay_groups
from runner.schema import one_of, require

if TYPE_CHECKING:
    import torch


@dataclass
class AdamConfig(OptimConfig):
    """``torch.optim.Adam``'s arguments and defaults (``lr`` 1e-3, not SGD's 0.05).

    With moments m ← β₁·m + (1 − β₁)·g and v ← β₂·v + (1 − β₂)·g², x ← x − lr·m̂/(√v̂ + eps) (m̂, v̂
    bias-corrected); ``weight_decay`` adds weight_decay·x to g (L2, coupled to the moments: ``optim=adamw``
    decouples it); ``amsgrad`` uses the running maximum of v̂. ``decay: matrices`` decays the weight matrices
    only, not the biases, norms and position embeddings (nanoGPT's and GPT-2's practice)."""

    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False
    decay: str = "all"  # all | matrices: weight decay on weight matrices only (runner.optim.decay_groups)

    def __post_init__(self) -> None:
        require(
            math.isfinite(self.lr) and self.lr >= 0,
            "lr",
            self.lr,
            "the learning rate must be >= 0 (e.g. optim.lr=0.001)",
        )
        require(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "betas",
            self.betas,
            "two moment decay rates in [0, 1) (e.g. optim.betas=[0.9,0.999])",
        )
        require(self.eps > 0, "eps", self.eps, "the denominator's term must be > 0 (e.g. 1e-8)")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        one_of("decay", self.decay, ("all", "matrices"))

    def params(self, model: torch.nn.Module) -> Iterable[torch.nn.Parameter] | list[dict]:
        if self.decay == "matrices":
            return decay_groups(model, self.weight_decay)
        return model.parameters()

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        import torch

        return torch.optim.Adam(params, **self.arguments())

    def arguments(self) -> dict:
        """The keyword arguments of the torch optimizer (``betas`` as a tuple)."""
        arguments = {**asdict(self), "betas": tuple(self.betas)}
        del arguments["decay"]  # (how the groups are made, not an argument of the optimizer)
        return arguments
