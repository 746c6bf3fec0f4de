"""A growth the workers agreed to, cut short by a loss before every worker was in it, is agreed again.

The CI's stall (async DiLoCo, heal, workers 0 and 2 killed at once): worker 3 had noted a growth at a
meeting, lost worker 2 in the checkpoint that followed, recovered, and grew at its next step; worker 1,
its draws spent, went on to the meeting the recovery forced and waited in its checkpoint, worker 3 in the
growth's agreement. Now every survivor puts the growth off to that forced agreement, where it is agreed
again with the lost workers and the ``RUN_DIR/JOIN`` workers any survivor had agreed to (the most of
them). Recovery and growth run here on two ranks of an in-process communicator that really reduces."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from runner.rank.agreement import Decision
from runner.rank.fence import Fence, Partitioned
from runner.rank.resilience.growth import Growth
from runner.rank.resilience.recovery import Recovery
from runner.rank.state import Position
from tests.helpers.fakecomm import FakeWorld


def growth(heal_pending: int = 0, under_way: bool = False) -> tuple[Growth, list[tuple]]:
    """A worker's growth whose ``grow`` only records its calls (the loop's retry calls it)."""
    grown: list[tuple] = []
    elastic = SimpleNamespace(under_way=under_way, arriving=[])
    recovery = SimpleNamespace(heal_pending=heal_pending, elastic=elastic)
    crew = SimpleNamespace(rule=SimpleNamespace(ready_to_grow=True))
    g = Growth(recovery, crew, model=None, retry=lambda fn, *args: grown.append(args))  # type: ignore[arg-type]
    return g, grown


def test_a_put_off_growth_is_not_grown_and_is_agreed_again_at_the_next_agreement():
    g, grown = growth(heal_pending=1)
    g.note(Decision(polled=True, join=2))  # 2 asked for by RUN_DIR/JOIN, 1 lost to replace
    assert g.due == 3 and g.joins_agreed() == 2
    g.put_off(2)
    g.if_due(Position(5, 0, 5), mid_epoch=True)
    assert grown == [], "a growth put off by a loss was grown at the next step"
    g.recovery.heal_pending = 2  # the loss that put it off is to replace too
    g.note(Decision())  # a step between agreements: nothing agreed
    assert g.due == 0
    g.note(Decision(polled=True, checkpoint=True))  # the agreement the recovery forced
    assert (g.due, g.noted, g.carried) == (4, 2, 0)
    g.if_due(Position(6, 0, 6), mid_epoch=True)
    assert len(grown) == 1


def test_a_growth_every_worker_is_in_is_done_again_at_once():
    g, grown = growth(heal_pending=1, under_way=True)
    g.note(Decision(polled=True, join=1))
    g.put_off(1)
    assert g.due == 2, "a growth under way (every worker in it) was put off"
    g.if_due(Position(5, 0, 5), mid_epoch=True)
    assert len(grown) == 1


class Survivor:
    """The loop's side, as far as the recovery's going on asks: one worker past an agreement, one not."""

    def __init__(self, g: Growth):
        self.growth, self.synchronous, self.polls = g, False, []

    def agreement_after(self, step: int) -> int:
        return step + 1

    def joins_agreed(self) -> int:
        return self.growth.joins_agreed()

    def put_off_growth(self, joins: int) -> None:
        self.growth.put_off(joins)

    def rejoin(self, val_loader, next_poll: int, before: list[int], lost: list[int]) -> None:
        self.polls.append(next_poll)


def test_survivors_at_different_places_put_off_the_same_growth(tmp_path: Path):
    def worker(comm):
        g, grown = growth(heal_pending=1)
        if comm.rank == 0:  # past the meeting that agreed to add 2 workers; the other not there yet
            g.note(Decision(polled=True, join=2))
        comm.launch_rank = lambda r=None: comm.rank if r is None else r
        recovery = Recovery(
            comm, comm, 0, tmp_path, 1, None, lambda rank, size: None, ["a", "a", "a"],
            elastic=g.recovery.elastic, heal=True, fence=Fence(tmp_path, enabled=False),
        )  # fmt: skip
        recovery.heal_pending = 1
        g.recovery = recovery
        survivor = Survivor(g)
        steps = SimpleNamespace(done=7)
        recovery._go_on(survivor, Position(7 + comm.rank, 0, 7), False, steps, [0, 1, 2], [2])
        g.if_due(Position(8, 0, 8), mid_epoch=True)
        g.note(Decision(polled=True, checkpoint=True))  # the agreement the recovery forced
        return survivor.polls, grown, g.due

    ends = FakeWorld(2).run(worker)
    assert [polls for polls, _, _ in ends] == [[9], [9]], "the survivors disagree on their next agreement"
    assert [grown for _, grown, _ in ends] == [[], []], "a survivor grew before the forced agreement"
    assert [due for _, _, due in ends] == [3, 3], "the survivors would add different numbers of workers"


@pytest.mark.parametrize("arriving, stops", [([4], False), ([], True)])
def test_a_replacement_not_yet_welcomed_is_not_counted_in_the_quorum(tmp_path: Path, arriving, stops):
    """Workers 1, 2, 3 and replacement 4 in its settling in; 1 is killed and 4 leaves (the kill battery's bsp
    heal seed 102): survivors 2 and 3 are 2 of the 3 workers that trained, not "exactly half" of 4 without
    the lowest. Counting 4 (``arriving`` empty, as before), they stop as a partition."""

    def worker(comm):
        comm.launch_rank = lambda r=None: [2, 3][comm.rank if r is None else r]
        hosts = ["a", "b", "c", "c", "?"]  # (1 on a host of its own: lost, it could be cut off)
        elastic = SimpleNamespace(arriving=list(arriving), under_way=True)
        recovery = Recovery(
            comm, comm, 0, tmp_path, 1, None, lambda rank, size: None, hosts,
            elastic=elastic, heal=True, fence=Fence(tmp_path, enabled=False),
        )  # fmt: skip
        try:
            recovery._go_on_or_stop([1, 2, 3, 4])
        except Partitioned as err:
            return str(err)
        return None

    ends = FakeWorld(2).run(worker)
    assert all((end is not None) == stops for end in ends), ends
