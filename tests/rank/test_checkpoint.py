"""Checkpoints in process: every rule's state survives a save and a load exactly, the checkpoint files and
index, the workers' agreement on when to stop, and the small pieces (strict JSON, sampler, heartbeat)."""

from __future__ import annotations

import io
import json
import time

import pytest
import torch
from torch.nn import functional as F

from runner.data.base import ClassificationData, TensorData
from runner.rank.agreement import Control
from runner.rank.checkpoint import Checkpointer, load_part, rng_state, set_rng_state
from runner.rank.records.heartbeat import Heartbeat
from runner.rank.records.output import root_cause
from runner.rules.gosgd import GoSGDConfig
from runner.run_folder import dumps, file_digest, read_checkpoint_index
from runner.schema import schema_of
from runner.schema.sections import CheckpointConfig
from tests.helpers.fakecomm import FakeWorld
from tests.helpers.rule_math import batch, build, mlp, params, sgd
from tests.helpers.rules import variants

STEPS, CUT = 8, 3


def train(world: FakeWorld, cfg, start=None, cut: int | None = None):
    """Every rank of ``world`` trains ``STEPS`` steps of the rule (from ``start``: the states saved at
    ``CUT``); with ``cut``, each rank also returns its state after ``cut`` steps (as the worker saves it:
    ``before_checkpoint``, then model, optimizer and rule), servers through their ``save`` callback."""

    def main(comm):
        saved = {}
        model = mlp(seed=comm.rank if start is None else 0)
        optimizer = sgd(model, lr=0.2, momentum=0.9)
        rule = build(comm, cfg, model, optimizer)
        rule.save = lambda step, state: saved.update(rule=state)
        first = 0
        if start is not None:
            mine = start[comm.rank]
            rule.load_state_dict(mine["rule"])
            if not rule.is_server:
                model.load_state_dict(mine["model"])
                optimizer.load_state_dict(mine["optimizer"])
            first = CUT
        if rule.is_server:
            rule.serve()
            return None, saved if cut else None, rule.state_dict()
        for step in range(first, STEPS):
            x, y = batch(8, seed=100 * comm.rank + step)
            rule.before_step(step)
            optimizer.zero_grad(set_to_none=False)
            (F.cross_entropy(model(x), y) * rule.loss_scale).backward()
            rule.after_backward(step)
            optimizer.step()
            rule.after_step(step)
            if cut is not None and step + 1 == cut:
                rule.before_checkpoint(cut)
                saved.update(
                    model={k: v.clone() for k, v in model.state_dict().items()},
                    optimizer=optimizer.state_dict(),
                    rule=rule.state_dict(),
                )
                saved["optimizer"] = json.loads(json.dumps(saved["optimizer"], default=lambda t: t.tolist()))
        rule.finish()
        return params(model), saved if cut else None, rule.state_dict()

    return world.run(main)


def _tensors(state):
    """Optimizer states went through JSON above (a deep copy); back to tensors for load_state_dict."""
    for s in state["optimizer"]["state"].values():
        s["momentum_buffer"] = torch.tensor(s["momentum_buffer"], dtype=torch.float64)
    state["optimizer"]["state"] = {int(k): v for k, v in state["optimizer"]["state"].items()}
    return state


#: Per rule (tests/helpers/rules.py discovers them) and variant: (ranks, the rule's settings); a rule not
#: named here runs with its defaults on 3 ranks. The asynchronous rules with one worker, whose order of events
#: is fixed. GoSGD has none: its pushes cross the threads in any order (its own tests below). DiLoCo in rounds
#: of 5: cut mid-round, an outer step after the resumption (tests/rules/test_diloco.py cuts rounds of 2 too).
DETERMINISTIC = {
    "sparseloco": {"": (3, {"inner_steps": 5, "chunk": 16, "topk": 4})},
    "desloc": {"": (3, {"param_period": 2, "momentum_period": 4, "variance_period": 4})},
    "easgd": {
        "sync": (3, {"alpha": 0.3, "tau": 2}),
        "async-1-worker": (2, {"alpha": 0.5, "tau": 2, "variant": "async"}),
    },
    "asgd": {
        "1-worker": (2, {"n_push": 2, "n_fetch": 3}),
        "1-worker-2-servers": (3, {"servers": 2, "staleness": "scale"}),
    },
    "async_diloco": {
        "1-worker": (2, {"inner_steps": 3}),
        "1-worker-2-servers": (3, {"inner_steps": 2, "servers": 2, "delay": 2}),
    },
    "gosgd": {},
    "diloco": {"": (3, {"inner_steps": 5})},
}


@pytest.mark.parametrize("rule, setting", variants(DETERMINISTIC, default=(3, {})))
def test_deterministic_rules_resume_exactly(rule, setting):
    """Stopped after CUT steps and resumed from the saved states, every rank ends where it would have."""
    n, kwargs = setting
    cfg = schema_of("rule", rule)(**kwargs)
    whole = train(FakeWorld(n), cfg, cut=CUT)
    saved = [_tensors(s) if "optimizer" in s else s for _, s, _ in whole]
    resumed = train(FakeWorld(n), cfg, start=saved)
    for rank, ((p_whole, _, s_whole), (p_resumed, _, s_resumed)) in enumerate(
        zip(whole, resumed, strict=True)
    ):
        assert p_whole is None or torch.equal(p_whole, p_resumed), f"rank {rank}: parameters differ"
        for key, value in s_whole.items():
            other = s_resumed[key]
            if isinstance(value, list) and value and torch.is_tensor(value[0]):
                assert all(torch.equal(a, b) for a, b in zip(value, other, strict=True)), (rank, key)
            elif torch.is_tensor(value):
                assert torch.equal(value, other), (rank, key)
            else:
                assert value == other, (rank, key)


def test_gosgd_checkpoint_has_no_push_in_flight_and_weights_sum_to_one():
    """With a push after every step, the saved weights still sum to 1 (quiescence before the save), and
    the seeded push decisions continue where they were: as many pushes as uninterrupted."""
    cfg = GoSGDConfig(p=0.7, seed=3)
    whole = train(FakeWorld(3), cfg, cut=CUT)
    saved = [_tensors(s) for _, s, _ in whole]
    assert sum(s["rule"]["weight"] for s in saved) == pytest.approx(1.0, abs=1e-12)
    assert [s["rule"]["merges"] for s in saved] == [
        sum(o["rule"]["sent_to"][r] for o in saved) for r in range(3)
    ], "a push was in flight when the state was saved"
    resumed = train(FakeWorld(3), cfg, start=saved)
    assert sum(s["weight"] for _, _, s in resumed) == pytest.approx(1.0, abs=1e-12)
    assert [s["pushes"] for _, _, s in resumed] == [s["pushes"] for _, _, s in whole]


def test_gosgd_checkpoint_keeps_out_a_push_made_after_another_worker_saved():
    """A worker that sees the end of the count exchange late (its thread descheduled, as on a busy 2-core CI
    machine) must not merge a push that a faster worker made after it saved: the saved weights sum to 1."""

    def main(comm):
        model, weights = mlp(seed=comm.rank), []
        optimizer = sgd(model)
        rule = build(comm, GoSGDConfig(p=1.0), model, optimizer)
        if comm.rank == 1:
            exchange = comm.iallreduce

            def late(t, op="sum"):
                request = exchange(t, op)
                test = request.test

                def seen_late() -> bool:
                    if not test():
                        return False
                    time.sleep(0.3)
                    request.test = test
                    return False

                request.test = seen_late
                return request

            comm.iallreduce = late
        for step in range(4):
            rule.before_step(step)
            optimizer.zero_grad()
            x, y = batch(8, seed=10 * comm.rank + step)
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            rule.after_step(step)
            if step == 1:
                rule.before_checkpoint(step + 1)
                weights.append(rule.state_dict()["weight"])
        rule.finish()
        return weights[0]

    assert sum(FakeWorld(2).run(main)) == pytest.approx(1.0, abs=1e-12)


def test_checkpointer_writes_parts_then_the_index_and_keeps_the_newest(tmp_path):
    cfg = CheckpointConfig(every=2, keep=2)

    def main(comm):
        ckpt = Checkpointer(cfg, tmp_path, comm, None)
        for step in (2, 4, 6):
            ckpt.save(
                step, {"w": torch.full((3,), float(step + comm.rank)), "rng": rng_state()}, {"epoch": 0}
            )
        return ckpt.latest

    assert FakeWorld(2).run(main) == ["00003-step6"] * 2
    entries = read_checkpoint_index(tmp_path)
    assert [e["step"] for e in entries] == [4, 6] and all(e["world_size"] == 2 for e in entries)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "00002-step4",
        "00003-step6",
        "checkpoint.json",
    ]
    part = torch.load(tmp_path / "checkpoints/00003-step6/rank1.pt", weights_only=True)
    assert torch.equal(part["w"], torch.full((3,), 7.0))
    assert not list(tmp_path.rglob("*.tmp"))
    for entry in entries:  # each part's size and CRC-32 as written, and the entry kept in its folder too
        folder = tmp_path / "checkpoints" / entry["dir"]
        assert entry["parts"] == [file_digest(folder / f"rank{r}.pt") for r in range(2)]
        assert json.loads((folder / "entry.json").read_text()) == entry
    (tmp_path / "checkpoints/00003-step6/rank1.pt").unlink()
    with pytest.raises(ValueError, match=r"00003-step6/rank1.pt is damaged \(missing\)"):
        load_part(tmp_path, entries[-1], 1)


def test_rng_state_round_trip_through_weights_only_load(tmp_path):
    import random

    import numpy as np

    state = rng_state()
    torch.save(state, tmp_path / "rng.pt")
    drawn = (torch.rand(3), np.random.rand(3), random.random())
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    again = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(drawn[0], again[0]) and (drawn[1] == again[1]).all() and drawn[2] == again[2]


@pytest.mark.parametrize("interval", [1, 4])
def test_workers_agree_on_the_step_to_stop_at(tmp_path, interval):
    """Only worker 0 reads the stop file; every worker stops after the same step, at most two intervals
    after the file appeared."""
    cfg = CheckpointConfig(every=None, every_minutes=None)
    appeared = 9

    def main(comm):
        control = Control(comm, tmp_path, Checkpointer(cfg, tmp_path, comm, None), interval)
        for step in range(1, 40):
            if comm.rank == 0 and step == appeared:
                (tmp_path / "STOP").write_text("SIGTERM")
            if comm.rank == 2:
                time.sleep(0.002)  # a slower worker
            if control.poll(step).stop:
                control.close()
                return step
        control.close()
        return None

    stops = FakeWorld(3).run(main)
    assert len(set(stops)) == 1 and stops[0] is not None, stops
    assert appeared <= stops[0] <= appeared + 2 * interval


def test_records_are_strict_json():
    text = dumps({"loss": float("nan"), "x": [1.0, float("inf")], "ok": 2.5})
    assert json.loads(text) == {"loss": None, "x": [1.0, None], "ok": 2.5}


def test_sampler_resumes_part_way_through_an_epoch():
    data = ClassificationData(TensorData(torch.arange(50.0)[:, None], torch.zeros(50)), None, (1,), 2)
    loader = data.train_loader(rank=1, world=2, batch_size=4, seed=7)
    loader.sampler.set_epoch(3)
    whole = [x.flatten().tolist() for x, _ in loader]
    loader.sampler.set_epoch(3)
    loader.sampler.start_at(2 * 4)
    assert [x.flatten().tolist() for x, _ in loader] == whole[2:]
    assert len(loader) == len(whole) == 7


def test_root_cause_names_the_innermost_exception_and_its_line():
    def parse():
        int("x1")

    try:
        try:
            parse()
        except ValueError as err:
            raise RuntimeError("Error in call to target 'data.cifar10.CIFAR10':") from err
    except RuntimeError as err:
        line = root_cause(err)
    assert line.startswith("ValueError: invalid literal for int() with base 10: 'x1' (")
    assert "test_checkpoint.py:" in line
    try:
        try:
            parse()
        except ValueError:
            raise ValueError("data.root: /d/batch_1 is not a CIFAR-10 batch file") from None
    except ValueError as err:
        assert root_cause(err).startswith("ValueError: data.root: /d/batch_1 is not a CIFAR-10 batch file (")


def test_heartbeat_reports_step_and_counts_communication_as_progress(tmp_path, monkeypatch):
    monkeypatch.setattr(f"{Heartbeat.__module__}.INTERVAL_S", 0.1)  # beats 10 times a second, not once
    (tmp_path / "logs").mkdir()
    seconds = [0.0]
    beat = Heartbeat(tmp_path, 3, counter=lambda: seconds[0])
    beat.progress(12)
    first = json.loads((tmp_path / "logs/rank3.beat").read_text())
    assert first["rank"] == 3 and first["role"] == "worker"
    before = beat.progress_time
    seconds[0] = 1.5
    time.sleep(0.5)
    beat.close()
    last = json.loads((tmp_path / "logs/rank3.beat").read_text())
    assert (
        last["step"] == 12 and last["progress_time"] > before and last["alive_time"] >= last["progress_time"]
    )


class FillsUp(io.BytesIO):
    """A file on a disk that fills up after ``room`` bytes."""

    def __init__(self, room: int):
        super().__init__()
        self.room = room

    def write(self, data) -> int:
        if self.tell() + len(data) > self.room:
            raise OSError(28, "No space left on device")
        return super().write(data)


def test_a_full_disk_is_named_with_the_file_not_torchs_unexpected_pos(tmp_path, monkeypatch):
    """torch.save reports a write that fails midway as 'unexpected pos 704 vs 598': cause and file lost."""
    import runner.rank.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint, "create_new", lambda path, binary=False: FillsUp(5000))
    with pytest.raises(OSError, match=rf"\[Errno 28\] cannot write {tmp_path / 'rank0.pt'}: No space left"):
        checkpoint.save_atomic({"x": torch.zeros(100_000)}, tmp_path / "rank0.pt")
