"""The training loop as its components see it: a ``typing.Protocol`` of what the pace, the training state,
the survivor protocol and growth use of a :class:`~runner.rank.loop.Trainer`, so that none of them imports
the loop that holds them (no import circle, not even for type hints: tests/test_layout.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    from runner.comm import Comm
    from runner.rank.agreement import Control, Decision
    from runner.rank.guard import Guard
    from runner.rank.records.meter import Meter
    from runner.rank.records.metrics import MetricsLog
    from runner.rank.state import Position
    from runner.rank.validator import Validator
    from runner.rules.base import Rule
    from runner.schedule import Schedule
    from runner.schema.sections import TrainConfig


class Pace(Protocol):
    """How the loop's steps are paced through an epoch (:mod:`runner.rank.pace`: static shards or dynamic
    assignment): the points the loop calls, and what the training state, recovery and growth ask of it."""

    ahead: bool  # whether the next step's batch may be loaded while this one computes

    def begin_epoch(self, pos: Position, epochs: int, start: Position, max_steps: int) -> int: ...
    def before_step(self, pos: Position) -> bool: ...
    def start_step(self) -> None: ...
    def schedule_step(self, pos: Position) -> int: ...
    def after_step(self) -> int | None: ...
    def at_step_end(self, pos: Position, max_steps: int) -> bool: ...
    def end_of_span(self, pos: Position) -> bool: ...
    def end_of_epoch(self, epoch: int) -> None: ...
    def cut_at(self, pos: Position, max_steps: int) -> float | None: ...
    def checkpoint_step(self, pos: Position) -> int: ...
    def checkpoint_words(self, step: int, pos: Position) -> str: ...
    def agreement_after(self, step: int) -> int: ...
    def shard(self) -> list[int] | None: ...
    def take_shard(self, shard: list[int] | None, pos: Position) -> None: ...
    def left_to_deal(self) -> dict[str, Any] | None: ...
    def deal_rest(self, deal: dict[str, Any] | None, pos: Position) -> None: ...
    def dealing(self) -> tuple | None: ...
    def take_dealing(self, dealing: tuple | None) -> None: ...
    def rejoin(self, before: list[int], lost: list[int]) -> None: ...
    def welcome(self, joined: bool, mid_epoch: bool) -> None: ...


class State(Protocol):
    """The training state's uses that recovery and growth call (:mod:`runner.rank.trainer_state`)."""

    def share(self, comm: Comm, root: int) -> dict[str, Any]: ...
    def adopt(self, state: dict[str, Any]) -> None: ...
    def package(self, pos: Position, mid_epoch: bool) -> dict[str, Any]: ...
    def unpack(self, package: dict[str, Any]) -> tuple[Position, bool]: ...


class Grows(Protocol):
    """Growth as the pace calls it at an agreement (:mod:`runner.rank.resilience.growth`)."""

    def note(self, decision: Decision) -> None: ...


class Loop(Protocol):
    """What the loop's components use of it: its parts and records, its components, and two of its
    methods."""

    cfg: TrainConfig
    model: nn.Module
    optimizer: torch.optim.Optimizer
    rule: Rule
    schedule: Schedule
    scaler: torch.amp.GradScaler | None
    workers: Comm
    train_loader: DataLoader
    log: MetricsLog
    meter: Meter
    control: Control
    guard: Guard
    validator: Validator
    pace: Pace
    state: State
    growth: Grows
    preempted: bool

    def save(self, pos: Position, end: bool) -> None: ...
    def tolerant(self, fn: Callable[..., Any], pos: Position, *args: Any) -> Any: ...
