"""Regression: mean squared error between outputs and real-valued targets of the same shape; MAE."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.lazy import lazy_import
from runner.tasks import Task, TaskConfig, describe

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")


@dataclass
class RegressionConfig(TaskConfig):
    """Outputs and float targets of the same shape.

    No broadcasting: outputs ``[batch, 1]`` against targets ``[batch]`` are refused rather than compared all
    against all. Metrics: ``loss`` (the MSE, or the given loss) and ``mae`` (mean absolute error per
    element)."""

    METRICS = ("loss", "mae")

    def build(self, num_classes: int | None = None) -> Regression:
        return Regression(self.loss_fn())


class Regression(Task):
    def loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss in float32 at least, whatever the targets' type or the autocast type of the outputs.

        Numpy gives float64 targets; bf16 outputs would round the targets to 3 digits."""
        dtype = torch.promote_types(out.dtype, torch.float32)
        return super().loss(out.to(dtype), y.to(dtype))

    def default_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.mse_loss(out, y)

    def check(self, out: torch.Tensor, y: torch.Tensor) -> None:
        if not y.is_floating_point():
            raise ValueError(
                f"task=regression needs real-valued targets, but they are {describe(y)}: for class labels "
                "use task=classification; for numbers return float tensors"
            )
        if out.shape != y.shape:
            raise ValueError(
                f"task=regression needs outputs shaped like the targets, but the model gives {describe(out)} "
                f"for targets {describe(y)}: make them match (e.g. squeeze the model's last dimension, or "
                "give targets as [batch, outputs])"
            )

    def sums(self, out: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        n = y.numel()
        return [
            self.loss(out, y).float() * n,
            (out.float() - y.float()).abs().sum(),
            torch.tensor(n, device=out.device),
        ]

    def results(self, sums: list[float]) -> dict[str, float]:
        count = max(sums[-1], 1)
        return {"loss": sums[0] / count, "mae": sums[1] / count}
