"""Dynamic assignment (``data.assignment``, runner/rank/assignment.py): chunks of each epoch's permutation
dealt from one shared counter. In process: every chunk dealt once, and more of them to fast workers, on a
fake world with a real shared counter; the meetings. Under mpirun: with a straggler on 3 workers, stopped
mid-run and resumed, every sample is trained exactly once per epoch (the indices each worker trained on
are recorded by the model)."""

from __future__ import annotations

import os
import subprocess
import time
from subprocess import PIPE, STDOUT
from types import SimpleNamespace

import pytest
from torch.utils.data import DistributedSampler

from runner.comm.errors import PeerLost
from runner.rank.assignment import (
    Chunks,
    Dealer,
    Meetings,
    counter_slots,
    held_rows,
    plan,
    redeal,
    val_chunks,
)
from runner.rank.pace import Dynamic
from runner.rank.state import Position
from tests.conftest import ROOT, Run, checked_config, cli_argv, run_cli
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.traced import OVERRIDES, TRACE_ENV, read_trace


def all_chunks(chunks: Chunks, epochs: int) -> dict[frozenset[int], int]:
    """Every chunk of ``epochs`` epochs by its samples (within its epoch): ticket by (epoch, samples)."""
    out = {}
    for t in range(epochs * chunks.per_epoch):
        samples = [i for mb in chunks.micro_batches(t) for i in mb]
        out[(chunks.epoch_of(t), frozenset(samples))] = t
    return out


@pytest.mark.parametrize("samples,batch,accumulate", [(103, 10, 1), (103, 10, 2), (7, 10, 1), (40, 10, 1)])
def test_an_epochs_chunks_hold_each_sample_once_in_the_static_shards_order(samples, batch, accumulate):
    chunks = Chunks(samples, batch, accumulate, seed=5)
    for epoch in range(2):
        tickets = range(epoch * chunks.per_epoch, (epoch + 1) * chunks.per_epoch)
        dealt = [mb for t in tickets for mb in chunks.micro_batches(t)]
        assert all(len(mb) >= min(batch, samples) for mb in dealt), "a micro-batch smaller than the batch"
        assert all(len(chunks.micro_batches(t)) == accumulate for t in tickets)
        flat = [i for mb in dealt for i in mb]
        shards = DistributedSampler(range(samples), num_replicas=1, rank=0, shuffle=True, seed=5)
        shards.set_epoch(epoch)
        assert flat == list(shards), "one permutation per epoch, the one static shards deal from"


def test_a_slow_worker_takes_fewer_chunks_and_every_chunk_is_dealt_once():
    """3 workers, worker 2 three times slower per chunk, 3 epochs that end together (as epoch ends do)."""
    chunks = Chunks(300, 10, 1, seed=0)
    total, epochs, _ = plan(chunks, 3, None, 3)

    def worker(comm) -> list[int]:
        dealer = Dealer(chunks, comm.counter(), total, total // comm.size)
        trained = []
        for epoch in range(epochs):
            dealer.set_epoch(epoch)
            for _ in dealer:
                ticket = dealer.take()
                assert chunks.epoch_of(ticket) == epoch
                trained.append(ticket)
                time.sleep(0.006 if comm.rank == 2 else 0.002)
            comm.barrier()
        return trained

    got = FakeWorld(3).run(worker)
    assert sorted(t for ts in got for t in ts) == list(range(total)), "a chunk lost or dealt twice"
    assert len(got[2]) < min(len(got[0]), len(got[1])), [len(g) for g in got]


def test_a_restarted_dealer_deals_pending_tickets_first_then_from_its_base():
    """Resume and recovery: ``pending`` (a lost worker's tickets) before ``base`` onwards."""
    chunks = Chunks(100, 10, 1, seed=0)

    def worker(comm) -> list[int]:
        dealer = Dealer(chunks, comm.counter(), 20, 20)
        dealer.restart(comm.counter(), 12, [9, 3], comm.rank)
        out = []
        while (ticket := dealer.draw()) is not None:
            out.append(ticket)
        return out

    (dealt,) = FakeWorld(1).run(worker)
    assert dealt == [3, 9, *range(12, 20)]


def survivors_train(dealers: list[Dealer]) -> list[list[int]]:
    """Workers 0 and 1 of 3 deal anew after worker 2 was lost (no note: worker 0 held the counter), then
    train what they draw; the tickets each trained."""

    def survivor(comm) -> list[int]:
        assert redeal(dealers[comm.rank], comm, before=[0, 1, 2], lost=[2]) is None
        mine = []
        for _ in dealers[comm.rank]:
            mine.append(dealers[comm.rank].take())
            dealers[comm.rank].trained()
        return mine

    return FakeWorld(2).run(survivor)


def test_the_chunks_a_lost_worker_held_are_dealt_again_to_the_survivors():
    """3 workers publish what they hold; worker 2 is lost holding a chunk it was training and one drawn
    ahead; the 2 survivors re-deal over a new counter: every chunk is then trained exactly once."""
    chunks = Chunks(100, 10, 1, seed=0)  # 10 chunks, one epoch
    old = FakeWorld(1).comms[0].counter(counter_slots(3))
    dealers = [Dealer(chunks, old, 10, 4, rank, publish=True) for rank in range(3)]
    iters = [iter(d) for d in dealers]
    trained = []
    for rank in (0, 1, 2, 0, 2):  # draws 0, 1, 2, 3, 4: rank 2 holds 2 (training) and 4 (drawn ahead)
        next(iters[rank])
        if rank != 2 or not dealers[2].current:
            ticket = dealers[rank].take()
            if rank != 2:
                dealers[rank].trained()
                trained.append(ticket)
    assert dealers[2].holding() == [2, 4] and held_rows(old.snapshot(), 3)[2] == [2, 4]

    after = survivors_train(dealers)
    assert sorted(trained + after[0] + after[1]) == list(range(10)), (trained, after)
    assert {2, 4} <= set(after[0] + after[1])


class FirstBarrierFails:
    """A worker's communicator whose first barrier raises what a peer lost before it raises (ULFM)."""

    def __init__(self, comm):
        self.comm, self.failed = comm, False

    def __getattr__(self, name):
        return getattr(self.comm, name)

    def barrier(self) -> None:
        if not self.failed:
            self.failed = True
            raise PeerLost("barrier: MPI_ERR_PROC_FAILED")
        self.comm.barrier()


def test_the_epochs_end_is_a_meeting_of_all_so_a_loss_seen_only_there_is_trained_in_the_epoch():
    """Under fault tolerance the workers' meetings are one-sided (the counter's): a worker lost holding
    chunks may show only at the first collective after the epoch's last meeting. The span's end is a
    barrier of the workers, so its survivors re-deal there and train the chunks in their epoch (the
    span had ended, and the run's last epoch never trained them: CI lost 2 of 60 so)."""
    chunks = Chunks(100, 10, 1, seed=0)  # 10 chunks, one epoch
    old = FakeWorld(1).comms[0].counter(counter_slots(3))
    dealers = [Dealer(chunks, old, 10, 4, rank, publish=True) for rank in range(3)]
    lost = iter(dealers[2])
    next(lost), next(lost)  # worker 2 holds chunks 0 and 1
    spent = []
    for rank in (0, 1):  # the survivors train the rest of the epoch: their draws are spent
        for _ in dealers[rank]:
            spent.append(dealers[rank].take())
            dealers[rank].trained()

    class Survivor:  # what the pace is given; its recovery re-deals, as Dynamic.rejoin does
        def __init__(self, comm):
            self.workers = FirstBarrierFails(comm)

        def retry(self, fn, pos, *args):
            try:
                return fn(pos, *args)
            except PeerLost:
                redeal(dealers[self.workers.rank], self.workers, before=[0, 1, 2], lost=[2])
                return fn(pos, *args)

    def survivor(comm) -> tuple[bool, list[int]]:
        pace = Dynamic.__new__(Dynamic)  # (its meetings are passed: only the span's end is under test)
        pace.given, pace.dealer, pace.meet = Survivor(comm), dealers[comm.rank], lambda pos, ticket: False
        pace.stopped = False
        again, mine = pace.end_of_span(Position(9, 0, 0)), []
        for _ in pace.dealer if again else ():
            mine.append(pace.dealer.take())
            pace.dealer.trained()
        return again, mine

    after = FakeWorld(2).run(survivor)
    assert [again for again, _ in after] == [True, True], "the survivors train again within the epoch"
    assert sorted(spent + after[0][1] + after[1][1]) == list(range(10)), (spent, after)


@pytest.mark.parametrize("epochs", [1, 2])
def test_chunks_returned_after_the_survivors_draws_were_spent_are_trained_in_their_epoch(epochs):
    """Worker 2 is lost holding two chunks of epoch 0, and the survivors notice only at the epoch's end,
    their draws spent (with a next epoch, each holds one of its chunks drawn ahead): after the re-deal they
    iterate again, the returned chunks are trained in epoch 0, and every chunk exactly once."""
    chunks = Chunks(100, 10, 1, seed=0)  # 10 chunks an epoch
    total = 10 * epochs
    old = FakeWorld(1).comms[0].counter(counter_slots(3))
    dealers = [Dealer(chunks, old, total, total // 3, rank, publish=True) for rank in range(3)]
    lost = iter(dealers[2])
    next(lost), next(lost)  # worker 2 holds chunks 0 and 1
    spent = []
    for rank in (0, 1):  # the survivors train the rest of epoch 0 (and draw epoch 1's first chunk)
        for _ in dealers[rank]:
            spent.append(dealers[rank].take())
            dealers[rank].trained()
    assert sorted(spent) == list(range(2, 10)) and dealers[2].holding() == [0, 1]

    def survivor(comm) -> dict[int, list[int]]:
        dealer, mine = dealers[comm.rank], {}
        redeal(dealer, comm, before=[0, 1, 2], lost=[2])
        for epoch in range(epochs):
            dealer.set_epoch(epoch)
            again = epoch == 0  # what Trainer.fit does at epoch 0's end: iterate while reopened
            while again:
                for _ in dealer:
                    mine.setdefault(epoch, []).append(dealer.take())
                    dealer.trained()
                again = dealer.reopen() if epoch == 0 else False
            if epoch:
                for _ in dealer:
                    mine.setdefault(epoch, []).append(dealer.take())
                    dealer.trained()
        return mine

    after = FakeWorld(2).run(survivor)
    epoch0 = spent + [t for m in after for t in m.get(0, [])]
    assert sorted(epoch0) == list(range(10)), f"epoch 0 must train every chunk once: {after}"
    later = sorted(t for m in after for e, ts in m.items() if e > 0 for t in ts)
    assert later == list(range(10, total)), after


def test_meetings_come_at_agreement_points_and_validations_and_the_epochs_end():
    m = Meetings(per_epoch=30, interval=12, val_chunks=val_chunks(0.25, 30))  # validations every 8 chunks
    assert m.positions == [8, 12, 16, 24] and m.count == 5
    assert [m.validates(k) for k in range(m.count)] == [True, False, True, True, False]
    assert [m.passed_by(t) for t in (0, 7, 8, 15, 16, 29, 30, 38)] == [0, 0, 1, 2, 3, 4, 0, 1]
    assert [m.position(k) for k in range(m.count)] == [8, 12, 16, 24, 30]
    assert val_chunks(1, 30) is None and val_chunks(0.01, 30) == 1


def test_dynamic_assignment_is_refused_where_it_cannot_work_and_auto_picks_it_for_asynchronous_rules():
    def dealt(*overrides: str) -> bool:
        cfg = checked_config(list(overrides))
        return cfg.data.dynamic(cfg.rule.asynchronous())

    assert dealt("rule=gosgd") and dealt("rule=asgd") and dealt("rule=easgd", "rule.variant=async")
    assert not dealt("rule=easgd") and not dealt("rule=bsp")
    assert not dealt("rule=gosgd", "data.assignment=static")
    with pytest.raises(ValueError, match=r"data.assignment='dynamic' is invalid with this rule.*static"):
        checked_config(["rule=bsp", "data.assignment=dynamic"])
    with pytest.raises(ValueError, match=r"data.assignment='random' is invalid"):
        checked_config(["data.assignment=random"])
    with pytest.raises(ValueError, match=r"train.val_every=1.5 is invalid.*fraction"):
        checked_config(["train.val_every=1.5"])
    with pytest.raises(ValueError, match=r"train.val_every_s=0.0 is invalid.*> 0"):
        checked_config(["train.val_every_s=0"])
    with pytest.raises(ValueError, match=r"train.val_every_s=5.0 is invalid: train.val_every=0.25 also"):
        checked_config(["train.val_every_s=5", "train.val_every=0.25"])
    assert checked_config(["train.val_every_s=5", "train.val_every=2"]).train.val_every_s == 5


def traced_batches(trace, chunks: Chunks, epochs: int) -> dict[int, list[int]]:
    """The tickets each rank trained on, from the batches its model recorded."""
    by_samples = all_chunks(chunks, epochs)
    trained: dict[int, list[int]] = {}
    for rank, batches in read_trace(trace).items():
        trained[rank] = []
        for batch in batches:
            matches = [t for (_, s), t in by_samples.items() if s == frozenset(batch)]
            assert len(matches) == 1, f"rank {rank} trained a batch that is no chunk: {batch}"
            trained[rank].append(matches[0])
    return trained


@pytest.mark.slow
@pytest.mark.mpi
def test_stopped_and_resumed_under_a_straggler_every_sample_is_trained_once_per_epoch(tmp_path):
    """GoSGD, 3 workers, worker 2 sleeping 20 ms a step, validation twice an epoch. A stop request as the
    job starts (what SIGTERM writes) stops it at the second meeting, mid-epoch; then resume=. The model
    records the sample indices of every training batch."""
    trace, cut = tmp_path / "trace", tmp_path / "cut"
    trace.mkdir()
    env = {**os.environ, TRACE_ENV: str(trace), "PYTHONUNBUFFERED": "1"}
    args = [
        *OVERRIDES,
        "rule=gosgd",
        "devices=3",
        "hardware.oversubscribe=true",
        "train.epochs=3",
        "train.val_every=0.5",
        "simulate.straggler_ranks=[2]",
        "simulate.straggler_ms=20",
    ]
    proc = subprocess.Popen(cli_argv(cut, *args), cwd=ROOT, env=env, stdout=PIPE, stderr=STDOUT, text=True)
    deadline = time.time() + 60
    while not (cut / "config.yaml").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.01)
    (cut / "STOP").write_text("SIGTERM\n")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 5, out
    chunks = Chunks(300, 10, 1, seed=0)  # indexed_pair: 300 training samples
    first = sum(len(t) for t in traced_batches(trace, chunks, 3).values())
    again = run_cli(tmp_path / "again", f"resume={cut}", timeout=180, env=env)
    assert again.returncode == 0, again.output
    run = Run(again.proc, cut)
    assert run.summary["status"] == "ok"

    trained = traced_batches(trace, chunks, 3)
    dealt = sorted(t for ts in trained.values() for t in ts)
    assert dealt == list(range(3 * chunks.per_epoch)), "a chunk was lost or trained twice"
    assert 0 < first < chunks.per_epoch, "the stop comes at the second meeting, within the first epoch"
    assert len(trained[2]) < min(len(trained[0]), len(trained[1])), {r: len(t) for r, t in trained.items()}
    assert len(run.records("val")) == 6, "validation twice an epoch, each recorded once"


@pytest.mark.slow
@pytest.mark.mpi
def test_a_killed_workers_chunks_go_back_to_the_pool_and_every_sample_is_trained_once(tmp_path):
    """Async EASGD under fault tolerance, 3 workers with a loader process each: worker 2 is killed at its
    5th step; the chunks it held are dealt again to a survivor, and each sample is trained exactly once per
    epoch, also when the survivors notice the loss only at the epoch's end (their draws spent)."""
    trace = tmp_path / "trace"
    trace.mkdir()
    env = {**os.environ, TRACE_ENV: str(trace)}
    args = [
        *OVERRIDES,
        "rule=easgd",
        "rule.variant=async",
        "devices=3",
        "hardware.oversubscribe=true",
        "hardware.fault_tolerance=continue",
        "train.epochs=2",
        "data.workers=1",  # a loader process draws ahead; the killed worker often dies in the last epoch
        "+model.die_rank=2",
        "+model.die_at=5",
    ]
    run = run_cli(tmp_path / "run", *args, timeout=180, env=env)
    assert run.returncode == 0, run.output
    s = run.summary
    assert s["workers_at_end"] == 2 and [f["rank"] for f in s["failures"]] == [2]
    chunks = Chunks(300, 10, 1, seed=0)
    trained = traced_batches(trace, chunks, 2)
    assert len(trained[2]) == 4, "the killed worker finished 4 chunks"
    dealt = sorted(t for ts in trained.values() for t in ts)
    assert dealt == list(range(2 * chunks.per_epoch)), "a chunk was lost or trained twice"


@pytest.mark.slow
@pytest.mark.mpi
def test_validations_within_an_epoch_do_not_wait_for_a_slow_worker(cli):
    """ASGD, 3 workers, worker 0 (which records the run) sleeping 1.5 s a step, four validations an epoch:
    each validation within the epoch is taken once, by the worker that drew its chunk, on the servers'
    model alone; none waits for worker 0's step, and worker 0 records them all with their own times.
    (The fast workers' own pace spaces validations by about 0.35 s on 2 cores: the slow step is far
    beyond it, so that a gap tells waiting from training.)"""
    run = cli(
        "rule=asgd",
        "devices=3",
        "hardware.oversubscribe=true",
        "train.epochs=1",
        "train.val_every=0.25",
        "simulate.straggler_ranks=[0]",
        "simulate.straggler_ms=1500",
    )
    assert run.returncode == 0, run.output
    alone = sorted((r for r in run.records("val") if r.get("alone")), key=lambda r: r["time"])
    assert len(alone) == 3 and all(0 <= r["val_acc"] <= 1 for r in alone), alone
    assert {r["by"] for r in alone} - {0}, f"the slow worker 0 took every validation: {alone}"
    gaps = [b["time"] - a["time"] for a, b in zip(alone, alone[1:], strict=False)]
    assert max(gaps) < 1.0, f"a validation waited for the slow worker's step: {gaps}"
    steps = run.summary["steps_per_worker"]
    assert steps[0] < min(steps[1], steps[2]) and run.summary["assignment"] == "dynamic", steps


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize(
    "rule,alone",
    [
        # worker 1 sleeps 10 ms a step, so 6 epochs (138 steps) last 1.4 s or more however fast the machine:
        # 4 or more due (without it a fast machine trained them in 0.75 s, 2 due)
        (
            [
                "rule=bsp",
                "devices=2",
                "train.epochs=6",
                "simulate.straggler_ranks=[1]",
                "simulate.straggler_ms=10",
            ],
            False,
        ),
        (
            [
                "rule=asgd",
                "devices=3",
                "train.epochs=6",  # 1.6 s or more: worker 0's 200 ms steps are a sixth of the chunks
                "simulate.straggler_ranks=[0]",
                "simulate.straggler_ms=200",
            ],
            True,
        ),
    ],
    ids=["bsp-agreed", "asgd-claimed"],
)
def test_validations_by_time_come_when_due_once_each(cli, rule, alone):
    """``train.val_every_s``: BSP's workers validate together at the agreement after each 0.3 s of
    training (worker 0's clock); ASGD's, with worker 0 sleeping 200 ms a step, are claimed by the first free
    worker, alone. Either way each is recorded once, none before it is due, and none is skipped."""
    every = 0.3
    run = cli(*rule, "hardware.oversubscribe=true", f"train.val_every_s={every}")
    assert run.returncode == 0, run.output
    timed = sorted((r for r in run.records("val") if "due" in r), key=lambda r: r["due"])
    dues = [r["due"] for r in timed]
    assert dues == sorted(set(dues)) and len(dues) >= 3, dues  # once each
    assert all(r["time"] >= r["due"] * every - 0.1 for r in timed), timed  # never before it is due
    end = max(r["time"] for r in run.records("val"))
    assert dues[-1] >= int(end // every) - 2 and dues[0] <= 2, (dues, end)  # none skipped on the way
    assert all(bool(r.get("alone")) == alone for r in timed), timed
    if alone:
        assert {r["by"] for r in timed} - {0}, f"the slow worker 0 took every validation: {timed}"


def test_a_growth_agreed_at_a_meeting_is_taken_before_the_next_meeting():
    """A worker whose draws are spent passes the epoch's remaining meetings in one call: a growth the workers
    agree at one of them is taken right there (the others take it after the same meeting), not after it
    polled the next one while they grow (a stall seen in the kill battery, async DiLoCo under heal)."""
    from runner.rank.assignment import Meetings

    calls = []
    pace = Dynamic.__new__(Dynamic)
    pace.meetings, pace.passed, pace.meetings_done, pace.stopped = Meetings(12, 3, None), 0, 0, False
    chunks = SimpleNamespace(per_epoch=12, epoch_of=lambda ticket: 0)
    pace.dealer = SimpleNamespace(chunks=chunks, total=10**6)
    pace.agree = lambda pos, before, position: calls.append(("agree", position)) or False
    pace.given = SimpleNamespace(
        validator=SimpleNamespace(alone=False),
        workers=SimpleNamespace(rank=1),
        cfg=SimpleNamespace(val_every_s=None),
        grow=lambda pos: calls.append(("grow", None)),
    )
    assert pace.meet(Position(5, 0, 5), None) is False
    kinds = [kind for kind, _ in calls]
    assert kinds == ["agree", "grow"] * pace.meetings.count, calls


class Calls:
    """A counter that counts the calls made on it."""

    def __init__(self, counter):
        self.counter, self.calls = counter, 0

    def __getattr__(self, name):
        return getattr(self.counter, name)

    def fetch_add(self, slot: int = 0, value: int = 1) -> int:
        self.calls += 1
        return self.counter.fetch_add(slot, value)


@pytest.mark.parametrize("block", [1, 3, 8])
def test_draws_in_blocks_deal_every_chunk_once_in_a_call_per_block(block):
    """``data.chunks_per_draw``: 3 workers, one 3x slower, 2 epochs: every chunk trained once, the slow
    worker still trains fewer, and the counter is called about once per ``block`` chunks (once more a
    worker and epoch, for the draw that ends it)."""
    chunks = Chunks(480, 10, 1, seed=0)
    total, epochs, _ = plan(chunks, 2, None, 3)

    def worker(comm) -> tuple[list[int], int]:
        counter = Calls(comm.counter(counter_slots(comm.size)))
        dealer = Dealer(chunks, counter, total, total // comm.size, comm.rank, block=block)
        trained = []
        for epoch in range(epochs):
            dealer.set_epoch(epoch)
            for _ in dealer:
                trained.append(dealer.take())
                time.sleep(0.006 if comm.rank == 2 else 0.002)
            comm.barrier()
        return trained, counter.calls

    got = FakeWorld(3).run(worker)
    trained = [t for ts, _ in got for t in ts]
    assert sorted(trained) == list(range(total)), "a chunk lost or dealt twice"
    assert len(got[2][0]) < min(len(got[0][0]), len(got[1][0])), [len(g) for g, _ in got]
    calls = sum(c for _, c in got)
    assert calls <= total / block + 2 * 3 * epochs, (calls, total, block)


def test_the_rest_of_a_lost_workers_block_is_dealt_again_to_the_survivors():
    """Blocks of 3 under fault tolerance: worker 2 is lost holding the chunk it trains and the two left of
    its block (published with it); the survivors deal them again, and every chunk is trained once."""
    chunks = Chunks(120, 10, 1, seed=0)  # 12 chunks, one epoch
    old = FakeWorld(1).comms[0].counter(counter_slots(3))
    dealers = [Dealer(chunks, old, 12, 4, rank, publish=True, block=3) for rank in range(3)]
    iters = [iter(d) for d in dealers]
    trained = []
    for rank in (0, 1, 2):  # blocks [0, 1, 2], [3, 4, 5], [6, 7, 8]; each takes its first
        next(iters[rank])
        ticket = dealers[rank].take()
        if rank != 2:
            dealers[rank].trained()
            trained.append(ticket)
    assert dealers[2].holding() == [6, 7, 8] and held_rows(old.snapshot(), 3)[2] == [6, 7, 8]

    after = survivors_train(dealers)
    assert sorted(trained + after[0] + after[1]) == list(range(12)), (trained, after)


def test_chunks_per_draw_is_one_per_8_workers_and_checked():
    from runner.rank.assignment import HELD_SLOTS
    from runner.schema import MAX_CHUNKS_PER_DRAW, DataConfig

    assert MAX_CHUNKS_PER_DRAW == HELD_SLOTS // 2, "the published rows have room for a block and 8 more"
    data = DataConfig()
    assert [data.draw_block(n) for n in (1, 8, 9, 32, 64, 1000)] == [1, 1, 2, 4, 8, 8]
    assert DataConfig(chunks_per_draw=3).draw_block(64) == 3
    for bad in (0, 9):
        with pytest.raises(ValueError, match=r"data\.chunks_per_draw=.* 1 to 8"):
            DataConfig(chunks_per_draw=bad, assignment="dynamic").dynamic(True)


def test_a_block_across_the_epochs_end_goes_back_to_the_pool_when_survivors_deal_anew():
    """Blocks of 4 over epochs of 6 chunks: worker 1's block [4, 5, 6, 7] crosses into epoch 1. Worker 2
    is lost holding [8..11]. At the epoch's end the survivors deal anew: worker 1's 6 and 7 go back to the
    pool with the lost ones (else its next epoch would start on them ahead of the rest), and epoch 1 is
    trained once, in order of the tickets dealt."""
    chunks = Chunks(60, 10, 1, seed=0)  # 6 chunks an epoch, 2 epochs
    old = FakeWorld(1).comms[0].counter(counter_slots(3))
    dealers = [Dealer(chunks, old, 12, 4, rank, publish=True, block=4) for rank in range(3)]
    iters = [iter(d) for d in dealers]
    trained = {0: [], 1: []}
    for rank in (0, 0, 0, 0, 1, 1):  # worker 0 draws [0..3] and trains them; worker 1 draws [4..7]
        next(iters[rank])
        trained[rank].append(dealers[rank].take())
        dealers[rank].trained()
    assert next(iters[2], None) is None  # worker 2 draws [8..11]: epoch 1 (8 carried); it is lost
    assert next(iters[1], None) is None and next(iters[0], None) is None  # 6 carried; no chunk left
    assert dealers[1].carry == 6 and list(dealers[1].ahead) == [7]
    assert trained == {0: [0, 1, 2, 3], 1: [4, 5]} and held_rows(old.snapshot(), 3)[2] == [8, 9, 10, 11]

    def survivor(comm) -> list[int]:
        dealer = dealers[comm.rank]
        assert redeal(dealer, comm, before=[0, 1, 2], lost=[2]) is None
        assert dealer.carry is None and not dealer.ahead
        dealer.set_epoch(1)
        mine = []
        for _ in dealer:
            mine.append(dealer.take())
            dealer.trained()
        return mine

    after = FakeWorld(2).run(survivor)
    assert sorted(after[0] + after[1]) == list(range(6, 12)), after
