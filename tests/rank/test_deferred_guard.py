"""The non-finite guard without a host synchronisation per step (``train.on_nonfinite=stop``): the checks stay
on the device and are read every ``train.log_every`` steps and before every validation and checkpoint; the
run still ends naming the first bad step, by ``log_every`` steps later, with no checkpoint past it. And the
loss, summed on the device, gives the records Python floats gave. In process: BSP over two ranks of the
in-process communicator (tests/helpers/fakecomm.py), the real Trainer, meter, checkpointer and records."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from runner.comm import CommStats
from runner.data.base import ClassificationData
from runner.rank.agreement import Control
from runner.rank.checkpoint import Checkpointer
from runner.rank.guard import Diverged, Guard
from runner.rank.loop import Parts, Place, Records, Trainer
from runner.rank.records.meter import Meter
from runner.rank.records.metrics import MetricsLog
from runner.rank.state import Position
from runner.rules.base import Rule, RuleContext
from runner.rules.bsp import BSPConfig
from runner.schedule.constant import ConstantConfig
from runner.schema.sections import CheckpointConfig, TrainConfig
from runner.tasks.classification import ClassificationConfig
from tests.helpers.fakecomm import FakeWorld

BATCH, STEPS_PER_EPOCH, EPOCHS = 8, 12, 2
NAN_RANK, NAN_AT_STEP = 1, 5  # rank 1's output is NaN in its 5th step (0-based step 4): "at step 5"


class NaNAt(nn.Module):
    """Wraps a model; its training forward call number ``at`` returns NaN (``at`` None: never)."""

    def __init__(self, inner: nn.Module, at: int | None):
        super().__init__()
        self.inner, self.at, self.calls = inner, at, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if self.training:
            self.calls += 1
            if self.calls == self.at:
                out = out * float("nan")
        return out


def net() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def data() -> ClassificationData:
    g = torch.Generator().manual_seed(1)
    n = 2 * BATCH * STEPS_PER_EPOCH
    x, xv = torch.randn(n, 4, generator=g), torch.randn(64, 4, generator=g)
    y, yv = (x[:, 0] > 0).long() + (x[:, 1] > 0).long(), (xv[:, 0] > 0).long() + (xv[:, 1] > 0).long()
    return ClassificationData(TensorDataset(x, y), TensorDataset(xv, yv), (4,), 3, workers=0)


def train(run_dir: Path, log_every: int, every: int | None = None, **options) -> list[SimpleNamespace]:
    """Two ranks of BSP; rank ``NAN_RANK``'s output is NaN in step ``NAN_AT_STEP``. Per rank: the Diverged
    message (None: it trained to the end), the last step it finished, and its guard."""
    torch.manual_seed(0)
    first = net()
    models = [NaNAt(net(), NAN_AT_STEP if r == NAN_RANK else None) for r in range(2)]
    for model in models:
        model.inner.load_state_dict(first.state_dict())  # (BSP starts every rank from one model)
    total = EPOCHS * STEPS_PER_EPOCH

    def rank(comm) -> SimpleNamespace:
        model = models[comm.rank]
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        rule = BSPConfig(overlap="none").build(RuleContext(comm, comm, model, optimizer, STEPS_PER_EPOCH))
        parts = Parts(
            model, optimizer, rule, ClassificationConfig().build(3), ConstantConfig().build(optimizer, total)
        )
        source = data()
        loaders = source.train_loader(comm.rank, 2, BATCH, 0), source.val_loader(comm.rank, 2, 64)
        log = MetricsLog(run_dir, enabled=comm.rank == 0, loggers={})
        meter = Meter(comm.stats, 2, total, log, log_every, progress=False)
        control = Control(comm, run_dir, Checkpointer(CheckpointConfig(every=every), run_dir, comm, None), 1)
        done: list[int] = [0]
        beat = SimpleNamespace(progress=done.append, seconds=0.0)
        cfg = TrainConfig(epochs=EPOCHS, batch_size=BATCH, log_every=log_every, **options)
        trainer = Trainer(
            cfg, parts, loaders, Place(comm, torch.device("cpu")), Records(log, meter, beat, control)
        )
        error = None
        try:
            trainer.fit(total, EPOCHS, Position())
        except Diverged as err:
            error = str(err)
        finally:
            log.close()
        return SimpleNamespace(error=error, last=done[-1], guard=trainer.guard)

    return FakeWorld(2, timeout=60).run(rank)


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def checkpoint_steps(run_dir: Path) -> list[int]:
    index = run_dir / "checkpoints" / "checkpoint.json"
    return [c["step"] for c in json.loads(index.read_text())["checkpoints"]] if index.exists() else []


def test_a_nan_stops_the_run_at_the_next_log_step_naming_its_own_step(tmp_path):
    """log_every 4: the guard's flag is read after steps 4 and 8; the NaN came in step 5, so every rank
    stops after step 8 (the step was not synchronised on), naming step 5: rank 1 its loss, rank 0 the
    gradient BSP's mean carried to it. Step 8's record, past the NaN, is not written."""
    ranks = train(tmp_path, log_every=4)
    assert ranks[NAN_RANK].error.startswith(f"non-finite loss nan at step {NAN_AT_STEP} on rank {NAN_RANK};")
    assert ranks[0].error.startswith(f"non-finite gradient (sum nan) at step {NAN_AT_STEP} on rank 0;")
    assert all("no checkpoint was written before it" in r.error for r in ranks)
    assert [r.last for r in ranks] == [8, 8], "stopped at the first read after the NaN, not before"
    steps = records(tmp_path, "step")
    assert [r["step"] for r in steps] == [4] and all(r["loss"] < 10 for r in steps)
    assert not records(tmp_path, "val") and not records(tmp_path, "epoch")


def test_a_checkpoint_reads_the_flag_first_and_keeps_the_last_good_one(tmp_path):
    """log_every 100 (no read before the epoch's end), a checkpoint every 3 steps: the one after step 3 is
    written; the one due after step 6 reads the flag first, and the run ends there naming step 5."""
    ranks = train(tmp_path, log_every=100, every=3)
    for r in ranks:
        assert f"at step {NAN_AT_STEP} on rank" in r.error, r.error
        assert "its last good checkpoint (after step 3) is kept" in r.error, r.error
    assert [r.last for r in ranks] == [6, 6]
    assert checkpoint_steps(tmp_path) == [3], "no checkpoint after the bad step"
    part = torch.load(next((tmp_path / "checkpoints").glob("*-step3/rank0.pt")), weights_only=True)
    assert all(torch.isfinite(v).all() for v in part["model"].values() if v.is_floating_point())


def test_the_epochs_end_reads_the_flag_before_its_records(tmp_path):
    """No log step and no checkpoint before the epoch's end (step 12): the run ends there, before the
    epoch's validation and records."""
    ranks = train(tmp_path, log_every=1000)
    assert [r.last for r in ranks] == [STEPS_PER_EPOCH] * 2
    assert all(f"at step {NAN_AT_STEP} on rank" in r.error for r in ranks)
    assert not records(tmp_path, "val") and not records(tmp_path, "epoch")


def test_log_every_one_stops_at_the_bad_step_itself(tmp_path):
    ranks = train(tmp_path, log_every=1)
    assert [r.last for r in ranks] == [NAN_AT_STEP] * 2
    assert [r["step"] for r in records(tmp_path, "step")] == list(range(1, NAN_AT_STEP))


def test_skip_still_drops_the_step_on_every_rank_and_trains_on(tmp_path):
    ranks = train(tmp_path, log_every=4, on_nonfinite="skip")
    assert [r.error for r in ranks] == [None, None]
    assert [r.guard.skipped for r in ranks] == [1, 1] and not any(r.guard.deferred for r in ranks)
    assert [r.last for r in ranks] == [EPOCHS * STEPS_PER_EPOCH] * 2
    epochs = records(tmp_path, "epoch")
    assert len(epochs) == EPOCHS and 0 < epochs[-1]["train_loss"] < 10


# -- the guard alone ---------------------------------------------------------------------------------------


def guard_of(model: nn.Module, on_nonfinite: str = "stop", fp16: bool = False) -> Guard:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rule = Rule(RuleContext(SimpleNamespace(size=1), None, model, optimizer))
    guard = Guard(model, optimizer, rule, on_nonfinite, on_nonfinite == "skip", fp16, print, lambda: 3)
    guard.keep()  # (as the loop does before each step)
    return guard


def backward(model: nn.Module, scale: float = 1.0) -> torch.Tensor:
    model.zero_grad()
    loss = model(torch.randn(8, 4)).square().mean() * scale
    loss.backward()
    return loss.detach()


def test_the_deferred_guard_lets_the_steps_through_and_names_the_first_bad_one():
    model = net()
    guard = guard_of(model)
    assert guard.deferred
    for step in range(3):
        assert guard.allows(backward(model), step)
    guard.check()  # all finite: nothing to say
    assert guard.allows(backward(model, float("inf")), 3), "the step is applied; the read decides"
    assert guard.allows(backward(model, float("nan")), 4)
    with pytest.raises(Diverged, match=r"^non-finite loss inf at step 4 on rank 3; lower optim.lr"):
        guard.check()
    with pytest.raises(Diverged, match="no checkpoint was written before it"):
        guard.check_model(5)  # a checkpoint reads the flag before it looks at the model


def test_the_deferred_guard_names_batchnorm_statistics_and_gradients():
    """The cause is recorded on the device at the bad step: statistics not finite with a finite loss (the
    gradient poisoned, as :func:`~runner.rank.guard.poisoned` does), or the gradient alone (its norm)."""
    model = net()
    guard = guard_of(model)
    loss = backward(model)
    model[1].running_var.fill_(float("nan"))
    assert guard.poison(loss, 1.0).isnan(), "the loss backward sees is NaN"
    for p in model.parameters():
        p.grad.fill_(float("nan"))
    guard.allows(loss, 0)
    with pytest.raises(Diverged, match=r"^non-finite BatchNorm statistics at step 1 on rank 3"):
        guard.check()
    model = net()
    guard = guard_of(model)
    guard.allows(backward(model), 0)
    loss = backward(model)
    model[0].weight.grad[0, 0] = float("inf")
    guard.allows(loss, 1)
    with pytest.raises(Diverged, match=r"^non-finite gradient \(norm inf\) at step 2 on rank 3"):
        guard.check()


def test_skip_and_fp16_decide_at_the_step():
    model = net()
    guard = guard_of(model, "skip")
    assert not guard.deferred and not guard.allows(backward(model, float("nan")), 0) and guard.skipped == 1
    guard = guard_of(model, "stop", fp16=True)
    assert not guard.deferred
    with pytest.raises(Diverged, match="non-finite loss nan at step 1"):
        guard.allows(backward(model, float("nan")), 0)


# -- the loss on the device gives the records floats gave ---------------------------------------------------


def meter_records(losses: list, log_every: int) -> tuple[list[tuple], float, dict]:
    """The step records a meter writes for ``losses`` (floats or tensors), its epoch's loss sum, its state."""
    written: list[tuple] = []
    log = SimpleNamespace(write=lambda kind, step, **v: written.append((kind, step, v["loss"])))
    meter = Meter(CommStats(), 2, len(losses), log, log_every, progress=False)
    for step, (loss, _) in enumerate(zip(losses, meter.batches(losses), strict=True), start=1):
        meter.step_done(step, 0, loss, 8, 0.1)
    span = meter.epoch_done()
    return written, float(span.loss), meter.state_dict()


def test_losses_summed_on_the_device_give_the_records_python_floats_gave():
    """Float32 losses: summed as float64 tensors they give exactly the step records and the epoch's sum
    of Python floats (a float32 sum would not, for these numbers)."""
    rng = random.Random(0)
    losses = [torch.tensor(rng.uniform(0.1, 3.0), dtype=torch.float32) for _ in range(37)]
    floats = [t.item() for t in losses]
    as_floats, float_sum, _ = meter_records(floats, log_every=5)
    as_tensors, tensor_sum, state = meter_records(losses, log_every=5)
    assert as_tensors == as_floats and len(as_floats) == 7
    assert tensor_sum == float_sum == sum(floats)
    assert float(torch.stack(losses).sum()) != float_sum, "a float32 sum differs: the test can tell"
    assert all(type(s["loss"]) is float for k, s in state.items() if k != "job"), "checkpoints hold numbers"
    assert state["epoch"]["loss"] == float_sum


def test_the_trainer_leaves_the_steps_loss_on_the_device():
    """No ``.item()`` per step: the step's loss stays a (detached) tensor until a record reads it."""
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rule = Rule(RuleContext(SimpleNamespace(size=1), None, model, optimizer))
    stats, written = CommStats(), []
    log = SimpleNamespace(write=lambda kind, step, **v: written.append(v["loss"]))
    meter = Meter(stats, 1, 2, log, log_every=2, progress=False)
    parts = Parts(
        model, optimizer, rule, ClassificationConfig().build(3), ConstantConfig().build(optimizer, 2)
    )
    place = Place(SimpleNamespace(stats=stats, rank=0, size=1), torch.device("cpu"))
    trainer = Trainer(TrainConfig(), parts, (None, None), place, Records(log, meter, None, None))
    losses = []
    for step, (x, y) in enumerate(meter.batches([(torch.randn(8, 4), torch.randint(0, 3, (8,)))] * 2)):
        assert trainer.step([(x, y)], Position(step))
        assert isinstance(trainer.last_loss, torch.Tensor) and not trainer.last_loss.requires_grad
        losses.append(trainer.last_loss.item())
        meter.step_done(step + 1, 0, trainer.last_loss, len(x), 0.1)
    assert written == [(losses[0] + losses[1]) / 2]
