"""The loop's parts that surviving a loss and growing the job work on, handed over as one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runner.comm import Comm
    from runner.rank.agreement import Control
    from runner.rank.pace import Pace
    from runner.rank.records.meter import Meter
    from runner.rank.records.metrics import MetricsLog
    from runner.rank.trainer_state import TrainerState
    from runner.rank.validator import Validator
    from runner.rules.base import Rule


@dataclass(frozen=True)
class Crew:
    """What the survivor protocol and the job's growth are given of the loop (never the loop itself).

    The survivor protocol is :class:`~runner.rank.resilience.survivor.Survivors`, the growth
    :class:`~runner.rank.resilience.growth.Growth`."""

    workers: Comm
    rule: Rule
    state: TrainerState
    pace: Pace
    validator: Validator
    control: Control
    meter: Meter
    log: MetricsLog
