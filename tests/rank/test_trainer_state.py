"""A worker's training state is registered once (runner/rank/trainer_state.py): every field is in every use
(checkpoint, a joining worker's package, the survivors' share) or named as left out with a reason, and each
use given back to another trainer leaves it equal, field for field, to the one it was taken from. In
process, fast: a tiny model, BSP on the in-process communicator (tests/helpers/fakecomm.py), static shards
and dynamic assignment."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from runner.data.base import ClassificationData
from runner.rank.agreement import Control
from runner.rank.assignment import Chunks, Dealer, Meetings, counter_slots, plan
from runner.rank.checkpoint import Checkpointer
from runner.rank.loop import Parts, Place, Records, Trainer
from runner.rank.records.meter import Meter
from runner.rank.records.metrics import MetricsLog
from runner.rank.state import Position
from runner.rank.trainer_state import FIELDS, LEFT_OUT, USES, At
from runner.rules.base import RuleContext
from runner.rules.diloco import DiLoCoConfig
from runner.schedule.constant import ConstantConfig
from runner.schema.sections import CheckpointConfig, TrainConfig
from runner.tasks.classification import ClassificationConfig
from tests.helpers.fakecomm import FakeWorld

BATCH, STEPS = 4, 6
#: The fields a configuration does not have (the same None on both trainers, so not compared as varied).
ABSENT = {"static": {"deal", "dealing"}, "dynamic": {"shard"}}


def source() -> ClassificationData:
    g = torch.Generator().manual_seed(1)
    x, xv = torch.randn(2 * BATCH * STEPS, 4, generator=g), torch.randn(16, 4, generator=g)
    return ClassificationData(
        TensorDataset(x, (x[:, 0] > 0).long()), TensorDataset(xv, (xv[:, 0] > 0).long()), (4,), 2, workers=0
    )


def trainer(comm: Any, run_dir: Path, dynamic: bool) -> Trainer:
    """A worker's trainer as runner/rank/worker.py builds one: DiLoCo (a rule with state of its own), SGD with
    momentum, and (so the scaler is a field with a value on a CPU) a gradient scaler."""
    run_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    rule = DiLoCoConfig(inner_steps=3).build(RuleContext(comm, comm, model, optimizer, STEPS))
    total = 2 * STEPS
    parts = Parts(
        model, optimizer, rule, ClassificationConfig().build(2), ConstantConfig().build(optimizer, total)
    )
    data = source()
    if dynamic:
        chunks = Chunks(len(data.train), BATCH, 1, 0)
        tickets, _, steps = plan(chunks, 2, None, comm.size)
        dealer = Dealer(chunks, comm.counter(counter_slots(comm.size)), tickets, steps, comm.rank)
        train = data.dealt_loader(dealer, 0)
    else:
        train = data.train_loader(comm.rank, comm.size, BATCH, 0)
    log = MetricsLog(run_dir, enabled=comm.rank == 0, loggers={})
    meter = Meter(comm.stats, comm.size, total, log, 1, progress=False)
    control = Control(comm, run_dir, Checkpointer(CheckpointConfig(), run_dir, comm, None), 1)
    records = Records(log, meter, SimpleNamespace(progress=lambda step: None, seconds=0.0), control)
    cfg = TrainConfig(epochs=2, batch_size=BATCH)
    loop = Trainer(
        cfg,
        parts,
        (train, data.val_loader(comm.rank, comm.size, 16)),
        Place(comm, torch.device("cpu")),
        records,
    )
    loop.scaler = loop.state.owners.scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
    return loop


def advance(loop: Trainer) -> Position:
    """Move every field of ``loop`` away from a fresh trainer's: two optimizer steps, the rule's round, the
    records, the counts, the plan; returns where it stands."""
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(BATCH, 4, generator=g), torch.randint(0, 2, (BATCH,), generator=g)
    for _ in range(2):  # this worker alone (no collective): its model and optimizer move
        loop.optimizer.zero_grad()
        nn.functional.cross_entropy(loop.model(x), y).backward()
        loop.optimizer.step()
    with torch.no_grad():
        loop.rule.momentum[0].add_(1.0)
    loop.rule.round_step, loop.rule.outer_steps = 2, 5
    loop.scaler = loop.state.owners.scaler = torch.amp.GradScaler("cpu", init_scale=64.0)
    loop.validator.history = [{"val_loss": 0.5, "val_acc": 0.75}]
    loop.guard.skipped, loop.guard.checkpointed, loop.guard.overflows = 2, 4, 1
    loop.validator.first_val_loss, loop.validator.reported_prefix = 0.7, "center_"
    loop.validator.val_asked = 3
    loop.meter.total.steps, loop.meter.epoch.samples, loop.meter.window.loss = 5, 20, 1.5
    loop.control.checkpointer.count, loop.control.checkpointer.latest = 3, "00003-step4"
    loop.schedule.replan(2 * STEPS + 4)
    if loop.dealer is not None:
        loop.dealer.base, loop.dealer.pending = 7, [2, 5]
        loop.dealer.total, loop.dealer.steps = loop.dealer.total - 1, loop.dealer.steps - 1
        pace = loop.pace
        pace.meetings, pace.meetings_done, pace.passed = Meetings(12, 3, None), 3, 1
    else:
        loop.train_loader.sampler.reshard(1, 3)
    torch.manual_seed(99)
    return Position(8, 1, 3)


def same(a: Any, b: Any) -> bool:
    """Deep equality of states: tensors and arrays by value, objects by their attributes."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dict__") and type(a) is type(b):
        return same(vars(a), vars(b))
    return a == b


def differences(use: str, taken: dict, before: dict, after: dict, absent: set[str]) -> list[str]:
    """What a round trip of ``use`` got wrong: a field given back unequal to what was taken, or one the two
    trainers agreed on before (the test would not see it given back)."""
    wrong = [f"{name}: given back unequal" for name in USES[use] if not same(taken[name], after[name])]
    return wrong + [
        f"{name}: the test's two trainers agree on it already; make advance() move it"
        for name in USES[use]
        if name not in absent and same(taken[name], before[name])
    ]


@pytest.fixture(params=["static", "dynamic"])
def assignment(request) -> str:
    return request.param


def test_every_field_is_in_each_use_or_left_out_with_a_reason():
    """Adding a field to one use only, without saying why the others leave it out, fails here."""
    names = [f.name for f in FIELDS]
    assert len(names) == len(set(names)), "a field is declared twice"
    for use, carried in USES.items():
        assert set(carried) <= set(names), f"{use} carries undeclared fields {set(carried) - set(names)}"
    unexplained = [(n, u) for n in names for u in USES if n not in USES[u] and not LEFT_OUT.get((n, u))]
    assert not unexplained, f"fields left out of a use without a reason in LEFT_OUT: {unexplained}"
    contradicted = [key for key in LEFT_OUT if key[0] in USES[key[1]]]
    assert not contradicted, f"LEFT_OUT names fields their use carries: {contradicted}"
    assert all(any(n in USES[u] for u in USES) for n in names), "a field no use carries"


def test_checkpoint_then_restore_gives_back_the_trainer(tmp_path, assignment):
    dynamic = assignment == "dynamic"

    def rank(comm) -> list[str]:
        a, b = trainer(comm, tmp_path / "a", dynamic), trainer(comm, tmp_path / "b", dynamic)
        pos = advance(a)
        part = a.state.checkpoint(pos)
        assert set(part) == {"model", "optimizer", "rule", "rng", "loop"}, "the checkpoint's layout"
        taken = a.state.take("checkpoint", At(pos))
        torch.manual_seed(5)
        before = copy.deepcopy(b.state.take("checkpoint", At()))  # (a state dict holds live tensors)
        start = b.restore(torch.load(save(part, tmp_path), weights_only=True))
        b.pace.begin_epoch(start, 2, start, 2 * STEPS)  # as fit does: a resumed epoch's shard is taken there
        assert b.guard.checkpointed == start.step == pos.step
        return differences(
            "checkpoint", taken, before, b.state.take("checkpoint", At(start)), ABSENT[assignment]
        )

    assert FakeWorld(1).run(rank)[0] == []


def save(part: dict, folder: Path) -> Path:
    """The part written as the checkpointer writes it (so it also reads back with ``weights_only``)."""
    path = folder / "part.pt"
    torch.save(part, path)
    return path


def test_package_then_unpack_gives_back_the_trainer(tmp_path, assignment):
    dynamic = assignment == "dynamic"

    def rank(comm) -> list[str]:
        a, b = trainer(comm, tmp_path / "a", dynamic), trainer(comm, tmp_path / "b", dynamic)
        pos = advance(a)
        package = a.state.package(pos, mid_epoch=True)
        taken = a.state.take("package", At(pos, True))
        before = copy.deepcopy(b.state.take("package", At()))
        start, mid_epoch = b.state.unpack(package)
        after = b.state.take("package", At(start, mid_epoch))
        return differences("package", taken, before, after, ABSENT[assignment])

    assert FakeWorld(1).run(rank)[0] == []


def test_share_then_adopt_gives_back_the_trainer(tmp_path):
    """Two survivors: worker 1 (behind) adopts worker 0's share, the model included."""

    def rank(comm) -> dict:
        loop = trainer(comm, tmp_path / str(comm.rank), dynamic=False)
        if comm.rank == 0:
            advance(loop)
        before = copy.deepcopy(loop.state.take("share", At()))
        model_before = {k: v.clone() for k, v in loop.model.state_dict().items()}
        shared = loop.state.share(comm, root=0)
        if comm.rank == 1:
            loop.state.adopt(shared)
        after = {**loop.state.take("share", At()), "model": loop.model.state_dict()}
        return {"before": {**before, "model": model_before}, "after": after}

    ahead, behind = FakeWorld(2).run(rank)
    carried = ("model", *USES["share"])
    assert [n for n in carried if not same(ahead["after"][n], behind["after"][n])] == []
    assert [n for n in carried if same(ahead["after"][n], behind["before"][n])] == []


def test_a_validation_within_an_epoch_says_how_far_into_it(tmp_path, capsys):
    """``train.val_every=0.25`` printed "epoch 0:" four times: a validation within the epoch says how much
    of it was trained, one by time which it is, and the epoch's own validation stays "epoch 0:"."""

    def rank(comm) -> None:
        loop = trainer(comm, tmp_path / "run", False)
        loop.meter.terminal = sys.stdout
        loop.validator.validate(0, 3, done=0.25)
        loop.validator.validate(0, 5, done=0.5, due=2)
        loop.validator.validate(0, 12)
        loop.close()

    FakeWorld(1).run(rank)
    lines = [line.split(":")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("epoch")]
    assert lines == ["epoch 0 (25%)", "epoch 0 (50%), by time #2", "epoch 0"], lines


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_every_attribute_of_a_part_that_owns_state_is_state_or_says_why_not(tmp_path, dynamic):
    """An owner's new attribute must go through its state_dict (STATE) or be declared TRANSIENT with the
    reason; and every STATE name is a field of the table, carried by a use or left out with a reason (the
    test above). Caught this way: the validator's last validation by time (a resumed job validated at
    once) and the guard's fp16 overflow count (a resumed job's summary counted its own alone)."""
    from runner.schedule import Schedule

    def rank(comm) -> list[str]:
        loop, wrong = trainer(comm, tmp_path, dynamic), []
        owners = loop.state.owners
        for part in (owners.validator, owners.guard, owners.checkpointer, owners.schedule, owners.pace):
            name, attrs = type(part).__name__, set(vars(part))
            attrs |= set(part.STATE) if part is owners.pace else set()  # its keys: computed when asked
            declared = set(part.STATE) | set(part.TRANSIENT)
            wrong += [f"{name}.{a}: neither STATE nor TRANSIENT" for a in sorted(attrs - declared)]
            wrong += [f"{name}.{a}: declared but not set" for a in sorted(declared - attrs)]
            wrong += [f"{name}.{a}: in both" for a in sorted(set(part.STATE) & set(part.TRANSIENT))]
            wrong += [f"{name}.{a}: no reason given" for a, why in part.TRANSIENT.items() if not why]
            assert set(part.state_dict()) == set(part.STATE), name
        assert isinstance(owners.schedule, Schedule)
        return wrong

    assert FakeWorld(1).run(rank)[0] == []
    fields = {f.name for f in FIELDS}
    assert {"skipped", "overflows", "history", "val_asked"} <= fields


def test_a_new_attribute_of_an_owner_is_caught(tmp_path):
    def rank(comm) -> list[str]:
        guard = trainer(comm, tmp_path, False).state.owners.guard
        guard.retries = 0  # as a change to Guard.__init__ would add it
        return sorted(set(vars(guard)) - set(guard.STATE) - set(guard.TRANSIENT))

    assert FakeWorld(1).run(rank)[0] == ["retries"]


def test_a_checkpoint_written_before_a_field_existed_gives_back_its_start_value(tmp_path):
    """val_asked and overflows came after checkpoints that lack them: such a checkpoint resumes with 0."""

    def rank(comm) -> tuple:
        a, b = trainer(comm, tmp_path / "a", False), trainer(comm, tmp_path / "b", False)
        pos = advance(a)
        part = a.state.checkpoint(pos)
        del part["loop"]["val_asked"], part["loop"]["overflows"]
        b.restore(torch.load(save(part, tmp_path), weights_only=True))
        return b.validator.val_asked, b.guard.overflows, b.guard.skipped

    assert FakeWorld(1).run(rank)[0] == (0, 0, 2)
