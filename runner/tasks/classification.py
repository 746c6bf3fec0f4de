"""Classification: cross-entropy over class scores; accuracy, and top-5 accuracy above 5 classes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from runner.lazy import lazy_import
from runner.tasks import Task, TaskConfig, describe

if TYPE_CHECKING:
    import torch
else:
    torch = lazy_import("torch")


@dataclass
class ClassificationConfig(TaskConfig):
    """Outputs ``[batch, classes]`` with integer class targets.

    Or outputs ``[batch, classes, ...]`` with targets ``[batch, ...]``. Metrics: ``loss`` (cross-entropy),
    ``acc``, and ``top5`` when there are more than 5 classes."""

    METRICS = ("acc", "loss", "top5")

    def metrics(self, num_classes: int | None) -> tuple[str, ...]:
        """Top-5 needs a known class count above 5 (``data.num_classes``, or the data set's own).

        The count is the same on every rank whatever its share of the validation set."""
        return self.METRICS if num_classes is not None and num_classes > 5 else ("acc", "loss")

    def build(self, num_classes: int | None = None) -> Classification:
        return Classification(self.loss_fn(), num_classes)


class Classification(Task):
    width = 4

    def __init__(
        self, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, num_classes: int | None
    ):
        super().__init__(loss)
        self.num_classes = num_classes  # (None: not known) chance is 1 / num_classes (train.collapse_margin)
        self.top5 = num_classes is not None and num_classes > 5

    def default_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(out, y)

    def check(self, out: torch.Tensor, y: torch.Tensor) -> None:
        if y.is_floating_point() or y.is_complex():
            raise ValueError(
                f"task=classification needs integer class labels, but the targets are {describe(y)}: for "
                "real-valued targets use task=regression; for classes return them as integers (torch.long)"
            )
        if out.dim() != y.dim() + 1 or out.shape[0] != y.shape[0] or out.shape[2:] != y.shape[1:]:
            raise ValueError(
                f"task=classification needs outputs [batch, classes, ...] for targets [batch, ...], but the "
                f"model gives {describe(out)} for targets {describe(y)}"
            )
        if len(y) and (int(y.min()) < 0 or int(y.max()) >= out.shape[1]):
            raise ValueError(
                f"the targets hold labels {int(y.min())}..{int(y.max())} but the model outputs "
                f"{out.shape[1]} classes; set model.num_classes (data.num_classes) to the number of classes"
            )

    def sums(self, out: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        n = y.numel()
        top5 = out.topk(min(5, out.shape[1]), dim=1).indices
        return [
            self.loss(out, y).float() * n,
            (out.argmax(1) == y).sum(),
            (top5 == y.unsqueeze(1)).any(1).sum(),
            torch.tensor(n, device=out.device),
        ]

    def results(self, sums: list[float]) -> dict[str, float]:
        count = max(sums[-1], 1)
        out = {"loss": sums[0] / count, "acc": sums[1] / count}
        if self.top5:
            out["top5"] = sums[2] / count
        return out
