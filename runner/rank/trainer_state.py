"""A worker's training state, registered once: one list of fields, serving the three uses that move it.

Each field says how it is taken from the part that owns it (:class:`Owners`) and given back.

* the **checkpoint** (:meth:`TrainerState.checkpoint` / :meth:`TrainerState.restore`): this rank's part
  of a checkpoint, written to disk and read on ``resume=``;
* the **package** a joining worker takes from worker 0 (:meth:`TrainerState.package` /
  :meth:`TrainerState.unpack`, besides the model, which is broadcast as tensors);
* the **share** of the survivors of a lost worker, when one behind takes the state of one ahead
  (:meth:`TrainerState.share` / :meth:`TrainerState.adopt`).

Each use carries the subset of :data:`FIELDS` that :data:`USES` names, and every field a use leaves out is
named in :data:`LEFT_OUT` with the reason (tests/rank/test_trainer_state.py holds the three to it and
round-trips each use), so a field cannot be added to one use and forgotten in another without saying why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runner.rank.checkpoint import rng_state, set_rng_state
from runner.rank.state import Position, broadcast_state

if TYPE_CHECKING:
    import torch
    from torch import nn

    from runner.comm.face import CommLike
    from runner.rank.checkpoint import Checkpointer
    from runner.rank.guard import Guard
    from runner.rank.pace import Pace
    from runner.rank.records.meter import Meter
    from runner.rank.validator import Validator
    from runner.rules.base import Rule
    from runner.schedule import Schedule


@dataclass
class Owners:
    """The parts that own a worker's training state, by name (``scaler``: fp16's, else None)."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    rule: Rule
    scaler: torch.amp.GradScaler | None
    validator: Validator
    guard: Guard
    meter: Meter
    checkpointer: Checkpointer
    schedule: Schedule
    pace: Pace


@dataclass
class At:
    """Where training stands as a state is taken or given back.

    The position, and (a joining worker's package) whether it is within an epoch."""

    pos: Position = field(default_factory=Position)
    mid_epoch: bool = False


@dataclass(frozen=True)
class Field:
    """One part of the training state: ``take(owners, at)`` its value, ``give(owners, value, at)`` back."""

    name: str
    take: Callable[[Owners, At], Any]
    give: Callable[[Owners, Any, At], None]


def _set_pos(name: str) -> Callable[[Owners, Any, At], None]:
    return lambda o, value, at: setattr(at.pos, name, value)


def _give_scaler(o: Owners, value: Any, at: At) -> None:
    if value and o.scaler is not None:  # fp16: every worker scales its loss alike again
        o.scaler.load_state_dict(value)


def _owned(owner: str, key: str, absent: Any = None) -> tuple[Callable, Callable]:
    """``(take, give)`` of ``key`` of the part ``owner`` (its state_dict).

    ``absent``: the value a checkpoint written before the field existed gives back."""

    def take(o: Owners, at: At) -> Any:
        return getattr(o, owner).state_dict((key,))[key]  # (the key alone: the pace's deal is collective)

    def give(o: Owners, value: Any, at: At) -> None:
        getattr(o, owner).load_state_dict({key: absent if value is None else value})

    return take, give


def _paced(key: str) -> tuple[Callable, Callable]:
    """``(take, give)`` of ``key`` of the pace's state, given back at the position."""

    def give(o: Owners, value: Any, at: At) -> None:
        o.pace.load_state_dict({key: value}, at.pos)

    return _owned("pace", key)[0], give


def _take_checkpoints(o: Owners, at: At) -> tuple[int, str | None]:
    state = o.checkpointer.state_dict()  # (a pair in checkpoints written before the owners said so)
    return state["count"], state["latest"]


def _give_checkpoints(o: Owners, value: Any, at: At) -> None:
    count, latest = value
    o.checkpointer.load_state_dict({"count": count, "latest": latest})


def _give_schedule(o: Owners, value: Any, at: At) -> None:
    if value != o.schedule.total_steps:
        o.schedule.load_state_dict({"total_steps": value})
        o.meter.replan(value)


#: The training state, in the order it is given back (the position before the meter, which reads it; the
#: random generators last).
FIELDS: tuple[Field, ...] = (
    Field("model", lambda o, at: o.model.state_dict(), lambda o, v, at: o.model.load_state_dict(v)),
    Field(
        "optimizer",
        lambda o, at: o.optimizer.state_dict(),
        lambda o, v, at: o.optimizer.load_state_dict(v),
    ),
    Field("rule", lambda o, at: o.rule.state_dict(), lambda o, v, at: o.rule.load_state_dict(v)),
    Field("scaler", lambda o, at: o.scaler.state_dict() if o.scaler is not None else None, _give_scaler),
    Field("step", lambda o, at: at.pos.step, _set_pos("step")),
    Field("epoch", lambda o, at: at.pos.epoch, _set_pos("epoch")),
    Field("batch", lambda o, at: at.pos.batch, _set_pos("batch")),
    Field("mid_epoch", lambda o, at: at.mid_epoch, lambda o, v, at: setattr(at, "mid_epoch", v)),
    Field("history", *_owned("validator", "history")),
    Field("skipped", *_owned("guard", "skipped")),
    Field("checkpointed", *_owned("guard", "checkpointed")),
    Field("overflows", *_owned("guard", "overflows", absent=0)),
    Field("first_val_loss", *_owned("validator", "first_val_loss")),
    Field("reported_prefix", *_owned("validator", "reported_prefix")),
    Field("val_asked", *_owned("validator", "val_asked", absent=0)),
    Field(
        "meter",
        lambda o, at: o.meter.state_dict(),
        lambda o, v, at: o.meter.load_state_dict(v, at.pos.step, at.pos.batch > 0),
    ),
    Field("checkpoints", _take_checkpoints, _give_checkpoints),
    Field("schedule", lambda o, at: o.schedule.state_dict()["total_steps"], _give_schedule),
    Field("shard", *_paced("shard")),
    Field("deal", *_paced("deal")),
    Field("dealing", *_paced("dealing")),
    Field("rng", lambda o, at: rng_state(), lambda o, v, at: set_rng_state(v)),
)

#: Which fields each use carries.
USES: dict[str, tuple[str, ...]] = {
    "checkpoint": (
        *("model", "optimizer", "rule", "scaler", "step", "epoch", "batch", "history", "skipped", "meter"),
        *("overflows", "val_asked", "shard", "deal", "rng"),
    ),
    "package": (
        *("optimizer", "rule", "scaler", "step", "epoch", "batch", "mid_epoch", "history", "skipped"),
        *("checkpointed", "first_val_loss", "reported_prefix", "meter", "checkpoints", "schedule", "dealing"),
        *("overflows", "val_asked"),
    ),
    "share": ("optimizer", "rule", "scaler"),
}

_TENSORS = "broadcast as tensors first (broadcast_state), not pickled with the rest"
_OWN_RNG = "each worker keeps its own random generators (its own data order and dropout)"
_AGREED = "recovery agrees on the position itself (Recovery._agree)"
_SAME = "the survivors kept it alike (validations, skipped steps, checkpoints and schedule are collective)"
#: ``(field, use) -> why the use leaves the field out``: every field is in every use or named here.
LEFT_OUT: dict[tuple[str, str], str] = {
    ("model", "package"): _TENSORS,
    ("model", "share"): _TENSORS,
    ("rng", "package"): _OWN_RNG,
    ("rng", "share"): _OWN_RNG,
    **{(name, "share"): _AGREED for name in ("step", "epoch", "batch", "mid_epoch")},
    ("mid_epoch", "checkpoint"): "a checkpoint's batch > 0 says it",
    **{(name, "share"): _SAME for name in ("history", "skipped", "checkpointed", "checkpoints", "schedule")},
    ("checkpointed", "checkpoint"): "restore sets it to the step of the checkpoint it resumes from",
    ("first_val_loss", "checkpoint"): "the collapse check takes it from the history's first validation",
    ("first_val_loss", "share"): _SAME,
    ("reported_prefix", "checkpoint"): "the next validation sets it, before the results read it",
    ("reported_prefix", "share"): _SAME,
    ("meter", "share"): "each worker times its own steps",
    ("overflows", "share"): "each worker counts its own scaler's skipped steps (worker 0's are reported)",
    ("val_asked", "share"): "worker 0 asks for validations by time; a survivor that becomes worker 0 asks on",
    ("checkpoints", "checkpoint"): "the checkpointer reads them from the index entry it resumes from",
    ("schedule", "checkpoint"): "built for the run's steps; survivors re-plan it at each epoch's start",
    ("shard", "package"): "the welcome gives a new worker a lost worker's shard (lost_shard)",
    ("shard", "share"): "survivors keep their shards until the next epoch",
    ("deal", "package"): "the package carries the dealing as it is (dealing); the welcome deals anew",
    ("deal", "share"): "recovery deals the lost workers' chunks anew (redeal)",
    ("dealing", "checkpoint"): "a checkpoint keeps what is left to deal (deal), which a resumed job deals",
    ("dealing", "share"): "recovery deals the lost workers' chunks anew (redeal)",
}

#: The fields a checkpoint part holds at its top level; the others are under ``"loop"``.
CHECKPOINT_TOP = ("model", "optimizer", "rule", "rng")
_BY_NAME = {f.name: f for f in FIELDS}


class TrainerState:
    """The three uses of one worker's training state, taken from and given back to its ``owners``."""

    def __init__(self, owners: Owners):
        self.owners = owners

    def take(self, use: str, at: At) -> dict[str, Any]:
        """The fields ``use`` carries, taken in :data:`FIELDS` order.

        Collective where a field is: under dynamic assignment the checkpoint's ``deal`` gathers what is left
        over the workers."""
        names = USES[use]
        return {f.name: f.take(self.owners, at) for f in FIELDS if f.name in names}

    def give(self, use: str, state: dict[str, Any], at: At | None = None) -> At:
        """Give back what :meth:`take` returned, in :data:`FIELDS` order; returns where training stands.

        A field missing from ``state`` is given back as None."""
        at = at or At()
        names = USES[use]
        for f in FIELDS:
            if f.name in names:
                f.give(self.owners, state.get(f.name), at)
        return at

    def checkpoint(self, pos: Position) -> dict[str, Any]:
        """This rank's part of a checkpoint at ``pos``.

        :data:`CHECKPOINT_TOP` at its top level, the rest under ``"loop"``."""
        state = self.take("checkpoint", At(Position(pos.step, pos.epoch, pos.batch)))
        part = {name: state.pop(name) for name in CHECKPOINT_TOP}
        return {**part, "loop": state}

    def restore(self, part: dict[str, Any]) -> Position:
        """Take this rank's part of a checkpoint (as :meth:`checkpoint` made it); returns where it stood."""
        state = {**{k: v for k, v in part.items() if k != "loop"}, **part["loop"]}
        start = self.give("checkpoint", state).pos
        self.owners.guard.checkpointed = start.step
        return start

    def package(self, pos: Position, mid_epoch: bool) -> dict[str, Any]:
        """Worker 0: what a joining worker takes besides the model (which it broadcasts as tensors)."""
        return self.take("package", At(Position(pos.step, pos.epoch, pos.batch), mid_epoch))

    def unpack(self, package: dict[str, Any]) -> tuple[Position, bool]:
        """A joining worker: take worker 0's :meth:`package`; where to start, and whether within an epoch."""
        at = self.give("package", package)
        return at.pos, at.mid_epoch

    def share(self, comm: CommLike, root: int) -> dict[str, Any]:
        """Collective over ``comm``: give every rank ``root``'s model, and return ``root``'s share."""
        broadcast_state(self.owners.model, comm, root=root)
        mine = self.take("share", At()) if comm.rank == root else None
        return comm.broadcast_object(mine, root=root)

    def adopt(self, state: dict[str, Any]) -> None:
        """Take the share :meth:`share` returned (this survivor was behind)."""
        self.give("share", state)
