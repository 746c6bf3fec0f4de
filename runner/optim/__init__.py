"""Optimizers: one module per ``conf/optim`` option, each a schema that builds a ``torch.optim`` optimizer."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class OptimConfig:
    """Base of the optimizers' schemas."""

    lr: float = 0.05

    def params(self, model: torch.nn.Module) -> Iterable[torch.nn.Parameter] | list[dict]:
        """What :meth:`build` takes for ``model``: its parameters, or param groups with settings of their own.

        ``optim.decay=matrices`` takes param groups."""
        return model.parameters()

    def build(self, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
        raise NotImplementedError


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two param groups: ``weight_decay`` on the weight matrices (and higher-dimensional weights) only.

    None on biases, norms' scales and whatever ``model.no_weight_decay()`` names (timm's convention; the GPT
    names its position embedding). A tied weight is one parameter, in the group of its first name."""
    named = dict(model.named_parameters())  # (a tied weight appears once, under its first name)
    skip = set(model.no_weight_decay()) if hasattr(model, "no_weight_decay") else set()
    unknown = sorted(skip - set(named) - {n for n, _ in model.named_parameters(remove_duplicate=False)})
    if unknown:
        raise ValueError(
            f"optim.decay=matrices: {type(model).__name__}.no_weight_decay() names parameters the model does "
            f"not have ({', '.join(unknown)}); fix the model's list, or use optim.decay=all"
        )
    aliases: dict[int, set[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), set()).add(name)
    decay, no_decay = [], []
    for p in named.values():
        held = p.dim() < 2 or bool(aliases[id(p)] & skip)
        (no_decay if held else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
