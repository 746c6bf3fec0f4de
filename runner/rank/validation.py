"""The task's sums of a model over a loader, under the run's precision (for the loop and for eval=)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from runner.tasks import Task


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    """The forward pass's autocast for ``train.precision`` (nothing for fp32)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if precision == "bf16" else torch.float16)


@torch.no_grad()
def validation_sums(
    model: nn.Module, loader: Any, task: Task, device: torch.device, precision: str
) -> list[float]:
    """The task's sums over ``loader``, with one host synchronisation at the end.

    Zeros of the task's width when it has no batch, so every rank adds the same number of values."""
    was_training = model.training
    model.eval()
    total = torch.zeros(task.width, dtype=torch.float64, device=device)
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with autocast(device, precision):
            out = model(x)
        total += torch.stack([s.double() for s in task.sums(out.float(), y)])
    model.train(was_training)
    return total.tolist()


def nonfinite_batch(loader: Any) -> tuple[int, int] | None:
    """The first batch of ``loader`` whose inputs or targets hold NaN or inf, and how many such values it has.

    None when every batch is finite (read only when a validation loss is not finite)."""
    for index, batch in enumerate(loader):
        bad = sum(int((~torch.isfinite(t)).sum()) for t in _float_tensors(batch))
        if bad:
            return index, bad
    return None


def _float_tensors(node: Any) -> list[torch.Tensor]:
    """The floating-point tensors of a batch (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(node, torch.Tensor):
        return [node] if node.is_floating_point() else []
    if isinstance(node, dict):
        node = list(node.values())
    if isinstance(node, (list, tuple)):
        return [t for item in node for t in _float_tensors(item)]
    return []
