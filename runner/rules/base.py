"""The interface between the one training loop and a synchronization rule."""

from __future__ import annotations

import torch

from runner.comm import Comm


class Rule:
    """A synchronization rule, called by the training loop at fixed hooks.

    The loop calls, per step: ``before_step`` (before forward), ``after_backward`` (gradients are in
    ``p.grad``), ``after_step`` (the optimizer has stepped); per epoch ``on_epoch_end``; before each
    validation ``eval_models``; and ``finish`` once at the end. Constructor arguments are the rule's YAML
    keys; the communicator is passed in code.
    """

    def __init__(self, comm: Comm):
        self.comm = comm

    @property
    def workers(self) -> Comm:
        """The communicator of the ranks that train (for sharding data and reducing metrics)."""
        return self.comm

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> None:
        self.model, self.optimizer, self.steps_per_epoch = model, optimizer, steps_per_epoch

    def before_step(self, step: int) -> None:
        """Called before the forward pass of global step ``step`` (0-based)."""

    def after_backward(self, step: int) -> None:
        """Called when the local gradients are ready, before the optimizer steps."""

    def after_step(self, step: int) -> None:
        """Called after the optimizer step."""

    def on_epoch_end(self, epoch: int) -> None:
        """Called after the last step of each epoch."""

    def eval_models(self) -> dict[str, torch.nn.Module]:
        """The models to validate, by name; the first is the one the run reports ("" is the plain model)."""
        return {"": self.model}

    def metrics(self) -> dict[str, float]:
        """Rule-specific metrics for metrics.jsonl and TensorBoard."""
        return {}

    def finish(self) -> None:
        """Called once after training; must leave no message in flight."""
