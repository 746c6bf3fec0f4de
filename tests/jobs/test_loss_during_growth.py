"""A worker lost while a replacement joins (``heal``): the job survives, or ends within seconds naming the
cause; it never stalls.

The loss comes while every living rank is in ``MPI_Comm_spawn``. When the spawn fails on every survivor,
they recover and spawn again, for both lost workers. When it fails on some and not others, a survivor
waits in the spawn for good (ULFM does not interrupt it) and the others in their shrink: the job stalled
until the watchdog ended it (exit 4, a minute later, naming a rank instead of the cause). Now the
survivors end it 3 s into their shrink, naming the loss during the growth. A merge that fails on one rank
(MPI's error, no loss) ends the job at once, naming it."""

from __future__ import annotations

import time

import pytest

from runner.comm.mpi import PeerLost
from runner.rank.resilience.elastic import NotJoined, arrive
from tests.conftest import run_cli

#: (rule, the first victim and its step, the second victim and its delay into the growth): moments that
#: stalled (EASGD; the spawn takes about 2.5 s here), one the survivors came through (BSP), and ASGD's
#: world rank 0 lost after the workers' agreement, when it alone told the server to grow (the kill
#: battery's asgd heal seed 38: stalled 2 of 2 with the server serving and the workers in their shrink).
DRAWS = [
    (["rule=easgd"], 3, 7, 2, 2.205),
    (["rule=bsp"], 0, 4, 1, 0.654),
    (["rule=asgd"], 0, 3, 1, 0.328),
]


def heal_job(tmp_path, *overrides: str, timeout: float):
    """A job of 4 workers of ``model=dies`` under ``heal``, oversubscribed; a stall ends it (exit 4) after
    60 s, not the test's timeout."""
    return run_cli(
        tmp_path / "run",
        "hydra.searchpath=[file://tests/conf]",
        "model=dies",
        "devices=4",
        "hardware.oversubscribe=true",
        "hardware.fault_tolerance=heal",
        "train.stall_timeout=60",
        *overrides,
        timeout=timeout,
    )


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("rule, first, step, second, delay", DRAWS, ids=["easgd", "bsp", "asgd"])
def test_a_worker_lost_while_a_replacement_joins_never_stalls(tmp_path, rule, first, step, second, delay):
    t0 = time.monotonic()
    run = heal_job(
        tmp_path,
        *rule,
        "train.epochs=3",  # (2 ended once before the second victim's timer, the spawn being quick: no loss)
        f"model.die_rank={first}",
        f"model.die_at={step}",
        f"model.join_rank={second}",
        f"model.join_delay_s={delay}",
        timeout=200,
    )
    wall = time.monotonic() - t0
    summary = run.summary
    if run.returncode == 0:
        lost = {f["rank"] for f in summary["failures"]}
        # besides the two victims, only a replacement that left when its growth failed (NotJoined)
        assert {first, second} <= lost and min(lost - {first, second}, default=4) >= 4, summary
        assert len(summary["joins"]) >= 2 and summary["workers_at_end"] == 4, summary  # both replaced
        assert "survived with 4 workers at the end" in run.output, run.output  # the launcher's last line
    else:
        assert run.returncode == 1, run.output
        assert "was lost while the job grew" in run.output and "resume=RUN_DIR" in run.output, run.output
        assert wall < 50, f"ended {wall:.0f} s after it started: a stall the watchdog ended?\n{run.output}"


class TornWorld:
    """The world a replacement merged into, a rank of which died during the spawn (seen in CI: the first
    meeting's message came torn)."""

    def launch_rank(self) -> int:
        return 4

    def allgather_object(self, obj: object) -> list:
        raise PeerLost("allgather_object: a received object did not unpickle (UnpicklingError)")


def test_a_replacement_whose_first_meeting_loses_a_rank_leaves_instead_of_ending_the_job(tmp_path):
    """Its spawners count it lost and spawn anew; an error of its own would end the job they go on with
    (``rank 4 failed: PeerLost``, the whole job ended). The worker leaves on NotJoined with exit 0 and no
    error file (runner.rank.worker.leave)."""
    with pytest.raises(NotJoined, match="lost while this replacement was spawned .*the job goes on"):
        arrive(TornWorld(), 0, tmp_path, 4, {})
    assert not list(tmp_path.rglob("*.error"))


class SpawnedThenTorn:
    """A world of 2 workers whose spawn of 2 replacements succeeds and whose settling (the hosts' gather)
    then meets a loss."""

    rank, size = 0, 2
    spares = None  # (no warm spares: the growth spawns)

    def shrink(self) -> None: ...
    def broadcast_object(self, obj: object) -> object:
        return obj

    def grow(self, argv, want, key, cwd, oversubscribe=False, hosts=()) -> None:
        self.size += want

    def failed_ids(self) -> list[int]:
        return []

    def launch_rank(self) -> int:
        return 0

    def allgather_object(self, obj: object) -> list:
        raise PeerLost("allgather_object: MPI_ERR_PROC_FAILED")


def test_replacements_lost_in_their_settling_are_named_by_recovery_not_an_index_error(tmp_path):
    """Seen once: the loss came in the settling after the spawn, and recovery's quorum looked the new ids up
    in a hosts list that did not have them yet (IndexError, the job failed). They are named "?" until they
    say where they run, and recovery can fence and name them."""
    from types import SimpleNamespace

    from runner.rank.fence import quorum
    from runner.rank.resilience.elastic import Elastic

    hosts = ["vm", "vm"]
    elastic = Elastic(SpawnedThenTorn(), SimpleNamespace(agree=lambda: None), 0, tmp_path, hosts, 4, {})
    with pytest.raises(PeerLost):
        elastic.grow(2)
    assert hosts == ["vm", "vm", "?", "?"]
    assert quorum([0, 1, 2, 3], [0, 1], hosts) is None, "half, with rank 0: the survivors go on"


class Spawning(SpawnedThenTorn):
    """A world that records how it was asked to spawn."""

    def grow(self, argv, want, key, cwd, oversubscribe=False, hosts=()) -> None:
        self.asked = (oversubscribe, list(hosts))
        raise PeerLost("stop here: only the request is checked")


@pytest.mark.parametrize(
    "env, near, asked",
    [
        (None, ["n2"], (False, [])),  # not oversubscribed: Open MPI finds the free slots itself
        ("1", ["n2"], (True, [])),  # one machine: nowhere else to go
        ("n1,n2", ["n2", "?", "elsewhere"], (True, ["n2"])),  # heal: where the lost worker ran
    ],
)
def test_an_oversubscribed_job_spawns_replacements_where_the_lost_ran(
    tmp_path, monkeypatch, env, near, asked
):
    """Open MPI does not pass the launch's ``--oversubscribe`` on to MPI_Comm_spawn and then took the first
    node (32 ranks on 16 nodes: the replacement of a rank on node 16 started on node 1). A host mpirun does
    not know by that name (a worker still settling, "?") is left to Open MPI."""
    from types import SimpleNamespace

    from runner.rank.resilience.elastic import Elastic
    from runner.run_folder import OVERSUBSCRIBED_ENV

    if env is None:
        monkeypatch.delenv(OVERSUBSCRIBED_ENV, raising=False)
    else:
        monkeypatch.setenv(OVERSUBSCRIBED_ENV, env)
    world = Spawning()
    elastic = Elastic(world, SimpleNamespace(agree=lambda: None), 0, tmp_path, ["n1", "n2"], 4, {})
    with pytest.raises(PeerLost):
        elastic.grow(1, near=near)
    assert world.asked == asked


@pytest.mark.slow
@pytest.mark.mpi
def test_a_merge_that_fails_on_one_rank_ends_the_job_naming_it(tmp_path):
    """Seen once in CI on 2 nodes: ``MPI_ERR_INTERN`` from rank 0's ``MPI_Intercomm_merge`` after a heal's
    spawn. The others wait in the merge for good (ULFM's revoke does not end it, tried), so the job ends at
    once with the cause named and how to continue: never a stall, never a bare MPI error."""
    t0 = time.monotonic()
    run = heal_job(
        tmp_path, "rule=bsp", "model.die_rank=3", "model.die_at=4", "model.merge_fails_rank=0", timeout=150
    )
    wall = time.monotonic() - t0
    assert run.returncode == 1, run.output
    assert "rank 0 failed" in run.output and "MPI_Intercomm_merge of the new worker(s) returned" in run.output
    assert "resume=RUN_DIR" in run.output, run.output
    assert wall < 45, f"ended {wall:.0f} s after it started: a stall the watchdog ended?\n{run.output}"
    assert run.summary["status"] == "failed", run.summary
