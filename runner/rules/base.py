"""The interface between the one training loop and a synchronization rule.

A rule's module is read by the launcher for its schema, so it imports torch lazily (:func:`lazy_import`)
and the communication layer only for type hints: importing a rule starts neither torch nor MPI.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from runner.comm.encodings import KINDS
from runner.comm.flat import FlatTensors, flat_copy, float_buffers
from runner.comm.tags import GROW
from runner.comm.wire import wire_dtype
from runner.lazy import lazy_import, no_grad
from runner.schema import one_of, require

if TYPE_CHECKING:
    import torch

    from runner.comm import Comm
else:
    torch = lazy_import("torch")


def split_roles(comm: Comm, servers: int) -> Comm | None:
    """Collective over all ranks: split them into workers and ``servers`` servers.

    Ranks ``0 .. size-servers-1`` train and get their communicator; the last ``servers`` ranks serve and get
    None. Rank 0 is always a worker and writes the run's records."""
    assert 0 <= servers < comm.size, f"{servers} server ranks leave no worker in a job of {comm.size}"
    if servers == 0:
        return comm
    is_server = comm.rank >= comm.size - servers
    workers = comm.split(int(is_server))
    return None if is_server else workers


@dataclass
class RuleContext:
    """Everything a rule is built with (by the worker, once the model and the loaders exist)."""

    comm: Comm
    workers: Comm | None
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None = None
    steps_per_epoch: int = 0
    save: Callable[[int, dict[str, Any]], None] | None = None  # server ranks: write their checkpoint part
    joined: bool = False  # a worker spawned into the job: its state comes from worker 0 (no collective)
    grow: Callable[[], list[int]] | None = None  # server ranks: take part in the job's growth; the new ids


class Rule:
    """A synchronization rule, called by the training loop at fixed hooks.

    Per step: ``before_step`` (before forward), ``after_backward`` (gradients are in ``p.grad``),
    ``after_step`` (the optimizer has stepped); per epoch ``on_epoch_end``; before each validation
    ``eval_models``; ``finish`` once at the end. A rule with ``servers > 0`` runs on ``devices + servers``
    ranks, and the server ranks call ``serve`` instead of training. Subclasses take their schema object and
    the context, and declare all of their state in ``__init__``.

    Checkpoints: at a step all workers agree on, the loop calls ``before_checkpoint`` (leave no message in
    flight; ask the server ranks to save, which they do through ``ctx.save``), then saves every worker's
    ``state_dict`` with its model and optimizer; ``load_state_dict`` restores it on resume (servers too).
    A rule with server ranks is called there once every worker has taken its state: the servers are asked
    once per checkpoint (a worker lost before is recovered from first, and the checkpoint taken again).
    The checkpointer's write ends in a barrier of all ranks, servers included, so no worker sends again
    before every rank has taken its state; a rule whose workers talk to each other meets in its own
    ``before_checkpoint`` as well (GoSGD), so that its saved states agree whoever calls it.
    """

    #: False for rules whose workers do not meet every step: they agree on checkpoints and stops less often.
    synchronous = True
    #: True for rules whose reported model worker 0 can read alone (:meth:`solo_model`): validations within
    #: an epoch then do not wait for the other workers (dynamic assignment).
    solo_validation = False

    def __init__(self, ctx: RuleContext, servers: int = 0, comm_dtype: str = "fp32"):
        self.comm = ctx.comm
        self.workers = ctx.workers
        self.model = ctx.model
        self.optimizer = ctx.optimizer
        self.steps_per_epoch = ctx.steps_per_epoch
        self.num_servers = servers
        self.num_workers = ctx.comm.size - servers
        self.is_server = ctx.workers is None
        self.save = ctx.save
        self.joined = ctx.joined  # built alone (no collective call): Rule.grow makes it one of the workers
        self.grow_job = ctx.grow
        self.wire = wire_dtype(comm_dtype)  # the 16-bit type exchanges travel in (None: as they are)
        self._mean: tuple[torch.nn.Module, FlatTensors] | None = None
        self._mean_copy: tuple[torch.nn.Module, FlatTensors] | None = None

    def serve(self) -> None:
        """Server ranks only: serve the workers until all of them are done."""
        raise NotImplementedError(f"{type(self).__name__} has no server ranks")

    def lr_factor(self, step: int) -> float:
        """The rule's own factor on the learning rate at ``step`` (BSP's ``lr_scaling``).

        It is multiplied into the schedule's (runner/schedule); 1 for rules that keep the rate as
        configured."""
        return 1.0

    def micro_batch(self, last: bool) -> None:
        """Called before each micro-batch's forward pass of an accumulated step (``train.accumulate``).

        ``last`` is true for the one whose backward completes the step's gradients."""

    @property
    def loss_scale(self) -> float:
        """The factor the loop multiplies the loss by before backward, so gradients arrive scaled.

        BSP: 1/N, so the all-reduced sum is the mean with no pass of its own over the gradients."""
        return 1.0

    def grad_buffers(self) -> list[torch.Tensor]:
        """After ``after_backward``: flat buffers that hold every gradient, if the rule keeps them so.

        The loop checks them for non-finite values in one pass. Empty if the rule does not keep them so."""
        return []

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

    def solo_model(self) -> torch.nn.Module:
        """Worker 0 alone, where :attr:`solo_validation`: the reported model as it can read it now.

        It is read without the other workers (BatchNorm statistics: its own)."""
        raise NotImplementedError(f"{type(self).__name__} reports a model only all workers together can make")

    def metrics(self) -> dict[str, float]:
        """Rule-specific metrics for metrics.jsonl and TensorBoard (per epoch, workers)."""
        return {}

    def finish(self) -> None:
        """Workers, after training; must leave no message in flight.

        Called again after a recovery from a worker lost in it or in the results that follow: a message the
        servers count (``done``) is sent once."""

    def before_checkpoint(self, step: int) -> None:
        """Workers, all at step ``step``: leave no message in flight; have the server ranks save."""

    def state_dict(self) -> dict[str, Any]:
        """This rank's rule state for a checkpoint (tensors, numbers, lists, dicts), workers and servers."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned, on the same rank of a job of the same shape."""

    def final_metrics(self) -> dict[str, object]:
        """Collective over all ranks (workers and servers) after training: metrics for summary.json."""
        return {}

    # -- fault tolerance (hardware.fault_tolerance=continue; runner/rank/resilience/recovery.py) ------------
    def abandon(self) -> None:
        """Workers, when a worker was lost: complete or forget the operations in flight (they fail).

        By then the communicator is revoked; the local state is left as it was before those operations."""

    def recover(self) -> None:
        """Workers, once the communicator holds the survivors only: make the rule's state consistent again.

        For synchronous rules all survivors are at the same step by then. The rule's own math decides how."""

    # -- growing the job (fault_tolerance=heal, RUN_DIR/JOIN; runner/rank/resilience/elastic.py) ------------
    @property
    def ready_to_grow(self) -> bool:
        """Whether workers may join at this step (the same answer on every worker of a synchronous rule)."""
        return True

    def before_grow(self) -> None:
        """Workers, collective, before the job grows: leave nothing in flight.

        The communicators are replaced."""

    def grow(self, joined: bool) -> None:
        """Workers, collective over all of them once new ones joined: make the rule's state consistent again.

        ``joined``: this one is new and has taken worker 0's model, optimizer and rule state. The rule's own
        math decides how."""
        self.num_workers = self.comm.size - self.num_servers

    # -- servers --------------------------------------------------------------------------------------------
    def _serve_workers(self, handle: Callable[[int, int], None], done: int, checkpoint: int) -> None:
        """Server ranks: ``handle(source, tag)`` each message of the workers in arrival order.

        This goes on until every worker has sent tag ``done`` or was lost; when every living worker has sent
        tag ``checkpoint`` (a float64 header: the step), save this server's state. A lost worker (its messages
        fail, or it dies while the server waits) is no longer served, and a push or exchange it did not finish
        is dropped. Which workers asked for the checkpoint is kept by id: a loss noticed after every survivor
        asked (they wait for this server in the checkpoint) saves at once; a lost worker's ask counts no
        more."""
        from runner.comm import PeerLost

        header = torch.zeros(1, dtype=torch.float64)
        living = {self.comm.launch_rank(r) for r in range(self.num_workers)}
        finished: set[int] = set()
        asked: set[int] = set()
        while living - finished:
            try:
                if asked and living <= asked:
                    asked = set()
                    self.save(int(header), self.state_dict())
                    # its barrier drops the ranks lost meanwhile from the job, which then raise nothing here
                    living &= {self.comm.launch_rank(r) for r in range(self.comm.size - self.num_servers)}
                    continue
                source, tag = self.comm.probe()
                if tag in (done, checkpoint, GROW):
                    self.comm.recv(header, source, tag)
                if tag == GROW:  # the workers grow the job (runner/rank/resilience/elastic.py)
                    self.grow_job()
                    self.num_workers, asked = self.comm.size - self.num_servers, set()
                    living = {self.comm.launch_rank(r) for r in range(self.num_workers)} - finished
                elif tag == done:
                    finished.add(self.comm.launch_rank(source))
                elif tag == checkpoint:
                    asked.add(self.comm.launch_rank(source))
                else:
                    handle(source, tag)
            except PeerLost:
                living -= set(self.comm.lost_peers_ids()) - finished
                asked &= living
        assert self._nothing_left(), "a message was left in flight"

    def _nothing_left(self) -> bool:
        """Servers, once every worker is done: whether no message waits.

        A probe of any source fails while a loss is not acknowledged, and a worker may die after its last
        message, even as this probes (it sent nothing more): acknowledged, and probed again."""
        from runner.comm import PeerLost

        for _ in range(self.comm.size):
            try:
                if self.comm.tolerant:
                    self.comm.lost_peers()
                return self.comm.iprobe() is None
            except PeerLost:
                continue
        return self.comm.iprobe() is None

    # -- helpers for rules that report a model other than the local one -----------------------------------
    @no_grad
    def _workers_mean(self, local: FlatTensors, weight: float) -> tuple[torch.nn.Module, FlatTensors]:
        """A model copy (made once) set to Σ_workers weight_i · x_i.

        This worker's x_i is in ``local``, the weights sum to 1; the copy's BatchNorm statistics are the
        workers' mean."""
        if self._mean is None:
            self._mean = flat_copy(self.model)
        model, flat = self._mean
        for x, m in zip(local.buffers, flat.buffers, strict=True):
            torch.mul(x, weight, out=m)
            self.workers.allreduce(m)
        self._average_buffers_into(model)
        return model, flat

    @no_grad
    def _workers_mean_copy(self, flat: FlatTensors) -> tuple[torch.nn.Module, FlatTensors]:
        """A copy of the model (made once) set to the workers' mean.

        The mean is of ``flat`` (this worker's trainable parameters) and of the float buffers (BatchNorm
        statistics); the copy's other state is this worker's. Returns the copy's model and flat buffers; this
        worker's model is left as it is."""
        if self._mean_copy is None:
            model = copy.deepcopy(self.model)
            self._mean_copy = model, FlatTensors(p for p in model.parameters() if p.requires_grad)
        model, copied = self._mean_copy
        model.load_state_dict(self.model.state_dict())
        mine = [*flat.buffers, *float_buffers(self.model)]
        for target, local in zip([*copied.buffers, *float_buffers(model)], mine, strict=True):
            target.copy_(local)
            self.workers.allreduce(target).div_(self.workers.size)
        return model, copied

    @no_grad
    def _mean_of_workers(
        self, tensors: list[torch.Tensor], wire: torch.dtype | None = None
    ) -> list[torch.Tensor]:
        """The workers' mean of each of ``tensors``, as new tensors, sent in ``wire``'s type if given.

        ``tensors`` are left as they were, also when an all-reduce fails (a lost worker)."""
        means = []
        for t in tensors:
            total = t.clone()
            self.workers.allreduce(total, wire=wire)
            means.append(total.div_(self.workers.size))
        return means

    @no_grad
    def _average(self, tensors: list[torch.Tensor], wire: torch.dtype | None = None) -> None:
        """Set each of ``tensors`` to its mean over the workers (sent in ``wire``'s type, if given).

        Reduced in a copy, so that a failed all-reduce (a lost worker) leaves them as they were."""
        for t, mean in zip(tensors, self._mean_of_workers(tensors, wire), strict=True):
            t.copy_(mean)

    @no_grad
    def _average_buffers_into(self, target: torch.nn.Module) -> None:
        """Set ``target``'s float buffers (BatchNorm statistics) to the workers' mean of the local ones.

        Its other buffers (BatchNorm's batch counts, equal on all workers) are set to the local ones."""
        n = self.workers.size
        for mine, theirs in zip(float_buffers(self.model), float_buffers(target), strict=True):
            theirs.copy_(mine)
            self.workers.allreduce(theirs).div_(n)
        for mine, theirs in zip(self.model.buffers(), target.buffers(), strict=True):
            if not mine.is_floating_point():
                theirs.copy_(mine)


def check_compress(compress: str, topk_ratio: float, comm_dtype: str) -> None:
    """The checks of ``rule.compress`` and ``rule.topk_ratio`` that every rule taking them shares.

    Raise ValueError naming the key and the fix."""
    one_of("compress", compress, KINDS)
    require(
        0 < topk_ratio <= 1,
        "topk_ratio",
        topk_ratio,
        "the share of each tensor's values top-k sends, in (0, 1] (e.g. 0.01: 1%)",
    )
    require(
        compress == "none" or comm_dtype == "fp32",
        "compress",
        compress,
        f"a compressed exchange has its own encoding and is not also sent in comm_dtype={comm_dtype}: set "
        "rule.comm_dtype=fp32, or rule.compress=none to send in 16 bits",
    )
