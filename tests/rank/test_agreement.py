"""The workers' agreement on validations by time: each decided once, by its number, on every worker."""

from __future__ import annotations

import itertools

from runner.rank.agreement import Control
from runner.rank.checkpoint import Checkpointer
from runner.schema.sections import CheckpointConfig
from tests.helpers.fakecomm import FakeWorld


def test_a_validation_due_at_every_agreement_is_decided_once_each_by_number(tmp_path):
    """Agreements further apart than ``train.val_every_s``: worker 0 sees validation k+1 due when the
    workers act on k. Each worker validates 1, 2, 3... in order, each once (not k+1 twice, k never)."""
    cfg = CheckpointConfig(every=None, every_minutes=None)

    def main(comm):
        control = Control(comm, tmp_path, Checkpointer(cfg, tmp_path, comm, None), 1)
        if comm.rank == 0:
            counter = itertools.count(1)
            control.validation_due = lambda: next(counter)  # a new one due at every agreement
        decided = [d.validate for step in range(1, 8) if (d := control.poll(step)).validate]
        control.close()
        return decided

    per_worker = FakeWorld(2).run(main)
    assert per_worker[0] == per_worker[1] == [1, 2, 3, 4, 5, 6], per_worker


def test_no_validation_is_decided_when_none_is_due(tmp_path):
    cfg = CheckpointConfig(every=None, every_minutes=None)

    def main(comm):
        control = Control(comm, tmp_path, Checkpointer(cfg, tmp_path, comm, None), 1)
        control.validation_due = (lambda: 0) if comm.rank == 0 else None
        decided = [control.poll(step).validate for step in range(1, 6)]
        control.close()
        return decided

    assert FakeWorld(2).run(main) == [[0] * 5] * 2
