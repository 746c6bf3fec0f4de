"""Language modelling: next-token cross-entropy over sequences; perplexity and token accuracy."""

from __future__ import annotations

import math
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
class LanguageModelConfig(TaskConfig):
    """Outputs ``[batch, time, vocabulary]`` scores for targets ``[batch, time]`` of token ids.

    The data set gives each sequence's next tokens as its targets (inputs ``t[:-1]``, targets ``t[1:]``).
    Targets equal to ``ignore_index`` (padding) count in neither loss nor metrics. Metrics: ``loss`` (per
    token), ``ppl`` (its exponential), ``acc`` (next tokens predicted exactly)."""

    METRICS = ("loss", "ppl", "acc")
    ignore_index: int = -100

    def tokens_per_sample(self, shape: list[int]) -> int | None:
        return int(shape[-1]) if shape else None  # a sequence of tokens: its length

    def build(self, num_classes: int | None = None) -> LanguageModel:
        return LanguageModel(self.loss_fn(), self.ignore_index)


class LanguageModel(Task):
    def __init__(self, loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, ignore_index: int):
        super().__init__(loss)
        self.ignore_index = ignore_index

    def default_loss(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The mean over the counted tokens; 0 (not NaN) for a batch of padding only."""
        total = torch.nn.functional.cross_entropy(
            out.flatten(0, 1), y.flatten(), ignore_index=self.ignore_index, reduction="sum"
        )
        return total / (y != self.ignore_index).sum().clamp(min=1)

    def check(self, out: torch.Tensor, y: torch.Tensor) -> None:
        if y.is_floating_point() or y.dim() != 2 or out.dim() != 3 or out.shape[:2] != y.shape:
            raise ValueError(
                "task=language_model needs outputs [batch, time, vocabulary] for integer targets "
                f"[batch, time] (the next tokens), but the model gives {describe(out)} "
                f"for targets {describe(y)}"
            )
        tokens = y[y != self.ignore_index]
        if len(tokens) and (int(tokens.min()) < 0 or int(tokens.max()) >= out.shape[2]):
            raise ValueError(
                f"the targets hold token ids {int(tokens.min())}..{int(tokens.max())} but the model scores a "
                f"vocabulary of {out.shape[2]}; set the model's vocabulary size"
            )

    def sums(self, out: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
        counted = y != self.ignore_index
        n = counted.sum()
        right = ((out.argmax(2) == y) & counted).sum()
        return [self.loss(out, y).float() * n, right, n]

    def results(self, sums: list[float]) -> dict[str, float]:
        count = max(sums[-1], 1)
        loss = sums[0] / count
        return {"loss": loss, "ppl": math.exp(min(loss, 700.0)), "acc": sums[1] / count}
