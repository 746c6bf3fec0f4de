"""What the control plane costs a step: each part counts its own seconds, and the summary reduces them.

The parts (the agreement or the board, the dealer, the heartbeat, the checkpointer) are given a counter or a
communicator that takes a known time; the summary's ``control_ms_per_step`` is the workers' mean per step.
"""

from __future__ import annotations

import time

import pytest

from runner.rank import checkpoint
from runner.rank.agreement import Board
from runner.rank.assignment import Chunks, Dealer, counter_slots
from runner.rank.checkpoint import Checkpointer
from runner.rank.records.heartbeat import Heartbeat
from runner.rank.records.summary import Outcome, control
from runner.schema.sections import CheckpointConfig
from tests.helpers.fakecomm import FakeWorld

SLOW_S = 0.01


class SlowCounter:
    """A counter whose every operation takes :data:`SLOW_S` (a remote host busy computing)."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        call = getattr(self.inner, name)

        def slow(*args, **kwargs):
            time.sleep(SLOW_S)
            return call(*args, **kwargs)

        return slow


def test_the_summary_reports_the_workers_mean_per_step_and_the_slowest_checkpoint():
    """Worker 0 spent 0.2 s agreeing over 10 steps, worker 1 0.4 s over 20: 20 ms and 20 ms a step; their
    deals 0.1 s and 0.3 s: 10 and 15 ms, mean 12.5; the checkpoint's 0.5 s and 2 s: the job waited 2 s."""
    spent = [({"agreement": 0.2, "deal": 0.1}, 10, 0.5), ({"agreement": 0.4, "deal": 0.3}, 20, 2.0)]

    def main(comm):
        seconds, steps, checkpoint = spent[comm.rank]
        outcome = Outcome([], "", "val_acc", None, False, control_s=seconds, checkpoint_s=checkpoint)
        return control(outcome, steps, comm)

    got = FakeWorld(2).run(main)
    assert got[0] == got[1]
    assert got[0]["control_ms_per_step"] == pytest.approx({"agreement": 20.0, "deal": 12.5})
    assert got[0]["checkpoint_s"] == 2.0


def test_the_board_counts_the_time_its_meetings_spend_on_the_counter(tmp_path):
    """Each meeting reads the slot and posts a decision: two calls on a counter that takes 10 ms each."""
    comm = FakeWorld(1).comms[0]
    counter = SlowCounter(FakeWorld(1).comms[0].counter(counter_slots(1)))
    cfg = CheckpointConfig(every=None, every_minutes=None)
    board = Board(comm, tmp_path, Checkpointer(cfg, tmp_path, comm, None), lambda: counter)
    for meeting in range(1, 4):
        board.poll(meeting)
    assert 6 * SLOW_S <= board.seconds < 6 * SLOW_S + 0.5, board.seconds


def test_the_dealer_counts_its_draws_and_the_rows_it_publishes():
    """Under fault tolerance a draw is a fetch-and-add and a published row; a trained step another row."""
    chunks = Chunks(100, 10, 1, seed=0)
    (dealer,) = FakeWorld(1).run(
        lambda comm: Dealer(chunks, SlowCounter(comm.counter(counter_slots(1))), 10, 10, publish=True)
    )
    dealer.set_epoch(0)
    batches = iter(dealer)
    next(batches)  # one draw, one row
    dealer.take()
    dealer.trained()  # one row
    assert 3 * SLOW_S <= dealer.seconds < 3 * SLOW_S + 0.5, dealer.seconds


def test_the_heartbeat_and_the_checkpointer_count_their_writes(tmp_path, monkeypatch):
    """A checkpoint's time runs from its start to its index, its slow part write included."""
    (tmp_path / "logs").mkdir()
    beat = Heartbeat(tmp_path, 0)
    beat.close()
    assert beat.seconds > 0  # its first beat and its last (done)
    original = checkpoint.save_atomic

    def slow_save(obj, path):
        time.sleep(5 * SLOW_S)
        return original(obj, path)

    monkeypatch.setattr(checkpoint, "save_atomic", slow_save)
    comm = FakeWorld(1).comms[0]
    checkpointer = Checkpointer(CheckpointConfig(), tmp_path, comm, None)
    assert checkpointer.seconds == 0.0
    checkpointer.save(1, {"weights": list(range(1000))}, {"epoch": 0})
    assert 5 * SLOW_S <= checkpointer.seconds < 5 * SLOW_S + 2, checkpointer.seconds
