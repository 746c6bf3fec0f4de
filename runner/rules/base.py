"""The interface between the one training loop and a synchronization rule."""

from __future__ import annotations

import torch

from runner.comm import Comm
from runner.flat import FlatTensors, flat_copy, float_buffers


class Rule:
    """A synchronization rule, called by the training loop at fixed hooks.

    The loop calls, per step: ``before_step`` (before forward), ``after_backward`` (gradients are in
    ``p.grad``), ``after_step`` (the optimizer has stepped); per epoch ``on_epoch_end``; before each
    validation ``eval_models``; and ``finish`` once at the end. Constructor arguments are the rule's YAML
    keys; the communicator is passed in code.

    A rule with ``servers > 0`` runs on ``devices + servers`` ranks: ranks ``0 .. devices-1`` train (so rank
    0 is always a worker and writes the run's records) and the last ``servers`` ranks call ``serve``
    instead of training.
    """

    def __init__(self, comm: Comm, servers: int = 0):
        assert 0 <= servers < comm.size, f"{servers} server ranks leave no worker in a job of {comm.size}"
        self.comm = comm
        self.num_servers = servers
        self.num_workers = comm.size - servers
        self.is_server = comm.rank >= self.num_workers
        self._workers = comm.split(int(self.is_server)) if servers else comm

    @property
    def workers(self) -> Comm:
        """The communicator of the ranks that train (for sharding data and reducing metrics)."""
        return self._workers

    def setup(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps_per_epoch: int) -> None:
        self.model, self.optimizer, self.steps_per_epoch = model, optimizer, steps_per_epoch

    def serve(self, model: torch.nn.Module) -> None:
        """Server ranks only: serve the workers until all of them are done."""
        raise NotImplementedError(f"{type(self).__name__} has no server ranks")

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
        """Rule-specific metrics for metrics.jsonl and TensorBoard (per epoch, workers)."""
        return {}

    def finish(self) -> None:
        """Workers, once after training; must leave no message in flight."""

    def final_metrics(self) -> dict[str, object]:
        """Collective over all ranks (workers and servers) after training: metrics for summary.json."""
        return {}

    # -- helpers for rules that report a model other than the local one -----------------------------------
    @torch.no_grad()
    def _workers_mean(self, local: FlatTensors, weight: float) -> tuple[torch.nn.Module, FlatTensors]:
        """A model copy (made once) set to Σ_workers weight_i · x_i: this worker's x_i is in ``local``, the
        weights sum to 1; its BatchNorm statistics are the workers' mean."""
        if not hasattr(self, "_mean_copy"):
            self._mean_copy = flat_copy(self.model)
        model, flat = self._mean_copy
        for x, m in zip(local.buffers, flat.buffers, strict=True):
            torch.mul(x, weight, out=m)
            self.workers.allreduce(m)
        self._average_buffers_into(model)
        return model, flat

    @torch.no_grad()
    def _average_buffers_into(self, target: torch.nn.Module) -> None:
        """Set ``target``'s float buffers (BatchNorm statistics) to the workers' mean of the local ones."""
        n = self.workers.size
        for mine, theirs in zip(float_buffers(self.model), float_buffers(target), strict=True):
            theirs.copy_(mine)
            self.workers.allreduce(theirs).mul_(1.0 / n)
