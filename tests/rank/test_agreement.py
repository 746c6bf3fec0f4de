"""The workers' agreement on validations by time: each decided once, by its number, on every worker."""

from __future__ import annotations

import itertools
import threading

from runner.rank.agreement import Board, Control
from runner.rank.assignment import counter_slots
from runner.rank.checkpoint import Checkpointer
from runner.run_folder import JOIN, STOP
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


# -- the board: workers that never wait on each other (dynamic assignment, ASGD / asynchronous EASGD) --------


def board_world(tmp_path, n: int, tolerant: bool = False):
    """``n`` workers' boards over one shared counter of a dealer's size (no thread: polled in turn)."""
    world = FakeWorld(n)
    counter = FakeWorld(1).comms[0].counter(counter_slots(n))  # shared by all (made by one)
    cfg = CheckpointConfig(every=None, every_minutes=None)
    boards = []
    for comm in world.comms:
        comm.tolerant = tolerant
        boards.append(Board(comm, tmp_path, Checkpointer(cfg, tmp_path, comm, None), lambda: counter))
    return boards, counter


def acts(d) -> tuple:
    return (d.checkpoint, d.stop, d.join)


def test_a_worker_passes_meetings_without_the_others_and_the_first_past_decides_for_all(tmp_path):
    """Worker 1 runs three meetings ahead of worker 0 (which never polls meanwhile: with Control it would
    wait at its second). The stop asked before meeting 3 is decided there by worker 1, the first past it;
    worker 0, passing meeting 3 after the file is gone, stops there too; meetings decided to go on stay so
    for a worker passing them after later ones were decided."""
    (w0, w1), _ = board_world(tmp_path, 2)
    assert [acts(w1.poll(m)) for m in (1, 2)] == [(False, False, 0)] * 2
    (tmp_path / STOP).write_text("SIGTERM\n")
    assert acts(w1.poll(3)) == (False, True, 0)
    (tmp_path / STOP).unlink()
    assert [acts(w0.poll(m)) for m in (1, 2, 3)] == [(False, False, 0), (False, False, 0), (False, True, 0)]
    (tmp_path / STOP).write_text("SIGTERM\n")  # too late for meeting 3's go-on, decided before it
    assert acts(w1.poll(4)) == (False, True, 0) and acts(w0.poll(4)) == (False, True, 0)


def test_workers_racing_to_a_meeting_all_read_one_decision_and_a_join_is_taken_once(tmp_path):
    """Four workers in threads pass 30 meetings as fast as they can; a JOIN written meanwhile is decided at
    exactly one meeting, the same one on every worker, and its file taken there. (A worker that missed it
    would leave the others waiting in the growth's barrier: it times out.)"""
    world = FakeWorld(4)
    counter = FakeWorld(1).comms[0].counter(counter_slots(4))
    cfg = CheckpointConfig(every=None, every_minutes=None)
    meet = threading.Barrier(4, timeout=10)

    def main(comm):
        comm.tolerant = True
        board = Board(comm, tmp_path, Checkpointer(cfg, tmp_path, comm, None), lambda: counter)
        out = []
        for m in range(1, 31):
            if m == 10:  # all wait here once, so that meeting 10 is not passed before the JOIN is written
                if comm.rank == 2:
                    (tmp_path / JOIN).write_text("3\n")
                meet.wait()
            out.append(acts(decision := board.poll(m)))
            if decision.join:  # growth is collective at its meeting: no worker goes past it alone
                meet.wait()
        return out

    per_worker = world.run(main)
    assert per_worker[0] == per_worker[1] == per_worker[2] == per_worker[3], per_worker
    joins = [(m, a) for m, a in enumerate(per_worker[0], 1) if a != (False, False, 0)]
    assert len(joins) == 1 and joins[0] == (10, (False, False, 3)), joins
    assert not (tmp_path / JOIN).exists()


def test_a_join_read_by_a_worker_that_lost_the_race_stays_for_the_winner(tmp_path):
    """Worker 1 reads the JOIN, then worker 0 posts meeting 1 first (go on): worker 1 takes worker 0's
    decision and leaves the file, which meeting 2 then decides."""
    (w0, w1), counter = board_world(tmp_path, 2, tolerant=True)
    (tmp_path / JOIN).write_text("2\n")
    real = w1._bits

    def slow_bits() -> int:
        bits = real()
        (tmp_path / JOIN).rename(tmp_path / "held")  # worker 0 does not see it while it posts
        assert acts(w0.poll(1)) == (False, False, 0)
        (tmp_path / "held").rename(tmp_path / JOIN)
        return bits

    w1._bits = slow_bits
    assert acts(w1.poll(1)) == (False, False, 0) and (tmp_path / JOIN).exists()
    w1._bits = real
    assert acts(w1.poll(2)) == (False, False, 2) == acts(w0.poll(2)) and not (tmp_path / JOIN).exists()


def test_after_workers_were_lost_the_board_checkpoints_and_grows_at_the_meeting_agreed(tmp_path):
    """The survivors agreed on meeting 3 (each may have passed a different number before): both checkpoint
    there, and only there, or at a posted action, is what each holds (a replacement to spawn, heal)
    applied: a meeting decided to go on is passed by each in its own time (its ``polled`` is False)."""
    (w0, w1), _ = board_world(tmp_path, 2)
    for board in (w0, w1):
        board.reset(3)
    for board in (w0, w1):
        decisions = [board.poll(m) for m in (1, 2, 3, 4)]
        assert [acts(d) for d in decisions] == [(False, False, 0)] * 2 + [(True, False, 0), (False, False, 0)]
        assert [d.polled for d in decisions] == [False, False, True, False]
    (tmp_path / STOP).write_text("SIGTERM\n")
    assert w1.poll(5).polled and w0.poll(5).polled


def test_a_join_that_is_no_request_is_removed_and_named_once_on_the_board(tmp_path, capsys):
    """The board's decider reads RUN_DIR/JOIN without taking it (it is taken once the decision is posted);
    a text that is no request is never posted, so it is removed where it is read, as Control does, not
    read and named again at every meeting."""
    (w0, w1), _ = board_world(tmp_path, 2, tolerant=True)
    (tmp_path / JOIN).write_text("two please\n")
    assert [acts(w0.poll(m)) for m in (1, 2, 3)] == [(False, False, 0)] * 3
    assert [acts(w1.poll(m)) for m in (1, 2, 3, 4)] == [(False, False, 0)] * 4
    out = capsys.readouterr().out
    assert out.count("warning: ") == 1 and "says 'two please'" in out, out
    assert not (tmp_path / JOIN).exists()
