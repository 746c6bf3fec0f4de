"""Every rule survives a worker lost at any communication call, in process: randomized, seeds printed.

Each rank of a ``hardware.fault_tolerance=continue`` job of 4 workers (and the rule's servers) is a thread
running the worker's own code (tests/helpers/lossy_job.py) over an in-process ULFM (tests/helpers/lossy.py). A
draw kills one worker, or two, each at a call drawn from all of its calls after start-up (a step's exchange,
an agreement, a validation, the dealer's counter, a checkpoint, the job's end). The survivors must all end (no
deadlock: a wait longer than the world's timeout fails), agree on who was lost and how many workers are left,
and the synchronous rules' survivors on the step they end at (BSP's on the model itself, bit for bit).

The seeds are 0, 1, 2 (the same draws every run: CI stays reproducible), printed on failure;
``MPITRAIN_KILL_SEEDS=random`` draws new ones, ``MPITRAIN_KILL_SEEDS=1,2,3`` replays. Such draws run for real
(``mpirun``, SIGKILL, ``continue`` and ``heal``) in tests/jobs/test_kill_battery.py."""

from __future__ import annotations

import random
import sys

import pytest
import torch

from tests.helpers.kill_battery import cases, seeds
from tests.helpers.lossy_job import Killed, calls, config, job

DRAWS = 3  # per rule and run
ATTEMPTS = 6  # seeds tried for them (a void draw, whose call came after the victim's run, is not one)


def draw(case: str, seed: int, spans: dict[int, range]) -> dict[int, int]:
    """{launch rank: call} for one draw: one worker (any, rank 0 too), or two at once one time in three."""
    rng = random.Random(f"{case}/{seed}")
    victims = rng.sample(sorted(spans), 2 if rng.random() < 1 / 3 else 1)
    return {v: rng.choice(spans[v]) for v in victims}


def judge(case: str, results: list, deaths: dict[int, int], synchronous: bool) -> list[str]:
    """What is wrong with a job's ends: empty when every survivor ended as it should."""
    wrong = []
    killed = {r for r, out in enumerate(results) if isinstance(out, Killed)}
    if killed != set(deaths):  # (a call past the victim's run: an asynchronous rule's count varies)
        return [f"void: ranks {sorted(killed)} died, {sorted(deaths)} drawn"]
    ends = [out["result"] for out in results if isinstance(out, dict)]
    lost = [sorted({f["rank"] for f in end["failures"]}) for end in ends]
    if any(lr != sorted(deaths) for lr in lost):
        wrong.append(f"the survivors recorded losses {lost}, {sorted(deaths)} died")
    sizes = {end["workers_at_end"] for end in ends}
    if sizes != {4 - len(deaths)}:
        wrong.append(f"workers at the end {sizes}, {4 - len(deaths)} expected")
    if synchronous and len({end["steps"] for end in ends}) != 1:
        wrong.append(f"synchronous survivors ended at steps {[end['steps'] for end in ends]}")
    params = [out["params"] for out in results if isinstance(out, dict)]
    if not all(torch.isfinite(p).all() for p in params):
        wrong.append("a survivor's model is not finite")
    if case == "bsp" and not all(torch.equal(params[0], p) for p in params):
        wrong.append("BSP's survivors hold different models")
    return wrong


@pytest.mark.parametrize("case", sorted(cases()))
def test_every_rule_survives_workers_lost_at_any_call(tmp_path, case):
    torch.set_num_threads(1)
    cfg = config(cases()[case])
    spans = calls(cfg, tmp_path / "whole")
    synchronous = not cfg.rule.asynchronous()
    failed, tried = [], 0
    for seed in seeds(ATTEMPTS, fixed=True):
        deaths = draw(case, seed, spans)
        try:
            results, _ = job(cfg, tmp_path / str(seed), deaths, timeout=20)
            wrong = judge(case, results, deaths, synchronous)
        except Exception as err:  # a survivor's error, or a deadlock (TimeoutError with every thread's place)
            wrong = [f"{type(err).__name__}: {str(err)[:3000]}"]
        if wrong and wrong[0].startswith("void"):
            continue  # the call came after the victim's run (an asynchronous rule's count varies): no draw
        tried += 1
        if wrong:
            failed.append(f"seed {seed}, deaths {deaths} (launch rank: call): {'; '.join(wrong)}")
        if tried == DRAWS:
            break
    replay = ",".join(f.split(",")[0].split()[1] for f in failed)
    assert not failed, f"{case}: replay with MPITRAIN_KILL_SEEDS={replay}\n" + "\n".join(failed)
    assert tried, f"{case}: every draw was void (its calls came after the victims' runs)"


@pytest.mark.slow
@pytest.mark.parametrize("case", ["bsp", "diloco"])
def test_a_worker_lost_at_the_closing_meeting_is_recorded(tmp_path, case):
    """Worker 3 killed at its last call, the job's closing meeting after summary.json: the survivors record
    it (``after training``) and end with 3 workers, rank 0's records open or closed alike."""
    torch.set_num_threads(1)
    cfg = config(cases()[case])
    spans = calls(cfg, tmp_path / "whole")
    deaths = {3: spans[3][-1]}
    results, _ = job(cfg, tmp_path / "killed", deaths, timeout=20)
    assert judge(case, results, deaths, synchronous=True) == []


def test_a_worker_lost_while_another_makes_the_rules_last_probe(tmp_path, monkeypatch):
    """GoSGD's last call after training is a probe, which fails on the one survivor that makes it after
    the loss; the others notice the loss in the results' collectives. All must recover at the same place
    (they once stood in different functions and the job failed)."""
    import time

    from runner.comm.errors import PeerLost
    from runner.rank import loop
    from runner.rules.gosgd import GoSGD

    torch.set_num_threads(1)
    late = []

    def summary(*args, **kwargs):
        workers = args[-1]
        if workers.launch_rank() == 3:  # dies as it makes its first call of the results
            with workers._w.cond:
                workers._w.deaths[3] = workers._w.calls[3] + 1
        return real_summary(*args, **kwargs)

    def finish(self):
        if self.comm.launch_rank() == 1 and not late:
            probe = self.comm.iprobe

            def slow(*args, **kwargs):
                time.sleep(0.3)  # worker 3 reaches the results and dies meanwhile
                try:
                    return probe(*args, **kwargs)
                except PeerLost:
                    late.append(True)
                    raise

            self.comm.iprobe = slow
        try:
            real_finish(self)
        finally:
            self.comm.__dict__.pop("iprobe", None)

    real_summary, real_finish = loop.summary, GoSGD.finish
    monkeypatch.setattr(loop, "summary", summary)
    monkeypatch.setattr(GoSGD, "finish", finish)
    results, _ = job(config(cases()["gosgd"]), tmp_path, timeout=20)
    assert late, "worker 1's probe did not fail: the draw did not happen as planned"
    assert judge("gosgd", results, {3: 0}, synchronous=False) == []


@pytest.mark.parametrize("case", ["asgd", "easgd-async", "async_diloco"])
def test_a_worker_lost_after_its_last_message_leaves_the_server_whole(tmp_path, monkeypatch, case):
    """A server, every worker done, probes that nothing was left unread; a worker that died after its last
    message (in the results), between the server's acknowledging the losses and that probe, made the probe
    fail and the server end with PeerLost, and the job with it."""
    import threading
    import time

    from runner.rank import loop
    from tests.helpers.lossy import LossyComm

    torch.set_num_threads(1)
    acked, dying = threading.Event(), threading.Event()

    def summary(*args, **kwargs):
        workers = args[-1]
        if workers.launch_rank() == 3:  # after its DONE: dies once the server acknowledged, at its next call
            assert acked.wait(10), "the server never came to its last probe"
            with workers._w.cond:
                workers._w.deaths[3] = workers._w.calls[3] + 1
            dying.set()
        return real_summary(*args, **kwargs)

    def lost_peers(self):
        found = real_lost_peers(self)
        last_probe = sys._getframe(1).f_code.co_name == "_nothing_left"  # (not a checkpoint's barrier)
        if self.launch_rank() == 4 and last_probe and not acked.is_set():  # the server, before its last probe
            acked.set()
            assert dying.wait(10)
            time.sleep(0.2)  # (worker 3 makes its call)
        return found

    real_summary, real_lost_peers = loop.summary, LossyComm.lost_peers
    monkeypatch.setattr(loop, "summary", summary)
    monkeypatch.setattr(LossyComm, "lost_peers", lost_peers)
    results, _ = job(config(cases()[case]), tmp_path, timeout=20)
    assert judge(case, results, {3: 0}, synchronous=False) == []
