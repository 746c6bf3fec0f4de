"""A partition: one side goes on (the quorum rule) and the run folder is fenced by membership generation.

In process, in milliseconds; the real cut link on namespaced nodes is in tests/cluster/."""

from __future__ import annotations

import itertools
import random

import pytest

from runner.rank.fence import Fence, Partitioned, quorum


def test_the_side_holding_rank_0_goes_on_when_a_cut_halves_the_job():
    hosts = ["a", "a", "b", "b"]
    assert quorum([0, 1, 2, 3], [0, 1], hosts) is None
    why = quorum([0, 1, 2, 3], [2, 3], hosts)
    assert why is not None and why.startswith("partitioned: rank 2 (b), rank 3 (b) lost contact with a")
    assert "exactly half of the 4 workers, without rank 0 (a)" in why


def test_a_strict_majority_goes_on_and_a_minority_stops_even_with_rank_0():
    hosts = ["a", "b", "c"]
    assert quorum([0, 1, 2], [1, 2], hosts) is None
    why = quorum([0, 1, 2], [0], hosts)
    assert why is not None and "1 of 3 workers, not a majority" in why


def test_ranks_lost_beside_a_survivor_are_dead_not_cut_off():
    """Ranks of one node are on the same side of any cut: a loss on a survivor's host is a death, and the
    survivors go on however few they are (one machine: every loss)."""
    assert quorum([0, 1], [1], ["a", "a"]) is None
    assert quorum([0, 1, 2, 3], [1, 3], ["a", "a", "b", "b"]) is None  # half, without rank 0, yet each
    why = quorum([0, 1, 2, 3], [2], ["a", "a", "b", "b"])  # host a went silent: it may be cut off
    assert why is not None and "lost contact with a and is 1 of 4 workers" in why


def test_the_membership_before_the_loss_counts_not_the_launch():
    """After an earlier loss the membership is the survivors, renumbered: rank 0 is the lowest survivor."""
    hosts = ["a", "b", "b", "c", "c"]
    assert quorum([1, 2, 3, 4], [1, 2], hosts) is None  # half of the 4, holding their rank 0 (launch rank 1)
    assert quorum([1, 2, 3, 4], [3, 4], hosts) is not None


@pytest.mark.parametrize("seed", range(40))
def test_never_both_sides_of_any_cut_go_on(seed):
    """Any job (ranks spread over hosts at random), any cut of its hosts into two sides: exactly one side
    passes the quorum."""
    rng = random.Random(seed)
    nhosts = rng.randint(2, 5)
    hosts = [f"h{rng.randrange(nhosts)}" for _ in range(rng.randint(2, 9))]
    members = sorted(rng.sample(range(len(hosts)), rng.randint(2, len(hosts))))
    names = sorted({hosts[r] for r in members})
    for size in range(1, len(names)):
        for side in itertools.combinations(names, size):
            one = [r for r in members if hosts[r] in side]
            other = [r for r in members if hosts[r] not in side]
            passed = [quorum(members, s, hosts) is None for s in (one, other)]
            assert sum(passed) == 1, (members, hosts, side, passed)


def test_the_first_side_to_claim_a_generation_holds_the_run_folder(tmp_path):
    (tmp_path / "logs").mkdir()
    majority, minority = Fence(tmp_path, True), Fence(tmp_path, True)
    assert majority.claim("0@a, 1@a") and not minority.claim("2@b, 3@b")
    majority.advance()
    majority.check("the summary")
    with pytest.raises(Partitioned, match="generation 1, this side is at generation 0; the summary not"):
        minority.check("the summary")
    assert (tmp_path / "logs" / "generation.1").read_text() == "0@a, 1@a\n"


def test_a_side_fenced_out_by_a_new_job_on_the_folder_stops_too(tmp_path):
    """The launcher removes the generations when it starts a job on the folder: a straggler of the
    previous job finds its generation gone."""
    (tmp_path / "logs").mkdir()
    old = Fence(tmp_path, True)
    assert old.claim("0@a")
    old.advance()
    (tmp_path / "logs" / "generation.1").unlink()
    with pytest.raises(Partitioned):
        old.check("checkpoint 00002-step20")


def test_a_job_without_fault_tolerance_is_never_fenced(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "generation.3").write_text("x\n")
    Fence(tmp_path, False).check("the summary")
