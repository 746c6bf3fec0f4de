"""No host synchronisation in the steady-state training step on a GPU (skipped without CUDA), and its
stand-in on CPU, which runs everywhere.

The real ``Trainer.train_span`` (BSP alone, a small convolutional net with BatchNorm, pinned batches copied
one step ahead on a side stream, the non-finite guard deferred, the loss summed on the device, the progress
bar peeking at it) runs a few steps after a warm-up under ``torch.cuda.set_sync_debug_mode("error")``, which
raises at any call that waits for the device. The host reads the device only every ``train.log_every``
steps: those reads are outside the window, and their results are checked after it. On CPU nothing waits,
so the stand-in counts instead every read of a tensor's value by the host (``item``, ``float``, ``bool``,
``tolist``, ...) the same steps make: a ``loss.item()`` put back in the loop fails it on any machine."""

from __future__ import annotations

import io
import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from runner.comm import CommStats
from runner.rank.agreement import Decision
from runner.rank.guard import Diverged
from runner.rank.loop import Parts, Place, Records, Trainer
from runner.rank.prefetch import Prefetch
from runner.rank.records.meter import Meter
from runner.rank.state import Position
from runner.rules.base import RuleContext
from runner.rules.bsp import BSPConfig
from runner.run_folder import TTY_ENV
from runner.schedule.constant import ConstantConfig
from runner.schema.sections import TrainConfig
from runner.tasks.classification import ClassificationConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
#: The ways Python reads a tensor's value on the host: on a GPU, each one waits for the device.
READS = ("item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__", "__format__")

BATCH, LOG_EVERY, WARMUP = 16, 1000, 3


def trainer_on(
    device: torch.device, data: TensorDataset, bar: bool = True, loader: DataLoader | None = None
) -> tuple[Trainer, list[float]]:
    """A Trainer as ``runner.rank.worker.build`` makes one, on ``device``, alone (BSP with one worker): its
    loader pins its batches; records are collected; no heartbeat, agreement or checkpoint is ever due.
    ``bar``: the meter writes a progress record at every step (the loss peeked at, not waited for). Each
    ``train_span`` iterates the loader from its first batch (in order)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 10),
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    stats = CommStats()
    alone = SimpleNamespace(stats=stats, rank=0, size=1)
    rule = BSPConfig().build(RuleContext(alone, alone, model, optimizer, 100))
    parts = Parts(
        model, optimizer, rule, ClassificationConfig().build(10), ConstantConfig().build(optimizer, 100)
    )
    loader = loader or DataLoader(data, batch_size=BATCH, pin_memory=device.type == "cuda")
    written: list[float] = []
    log = SimpleNamespace(write=lambda kind, step, **v: written.append(v["loss"]))
    meter = Meter(stats, 1, 100, log, LOG_EVERY, terminal=io.StringIO() if bar else None, progress=bar)
    meter.every_s = 0.0
    checkpointer = SimpleNamespace(due=lambda s: False, seconds=0.0)
    control = SimpleNamespace(poll=lambda step: Decision(), seconds=0.0, checkpointer=checkpointer)
    records = Records(log, meter, SimpleNamespace(progress=lambda step: None, seconds=0.0), control)
    cfg = TrainConfig(batch_size=BATCH, log_every=LOG_EVERY)
    return Trainer(cfg, parts, (loader, None), Place(alone, device), records), written


def images(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 16, 16, generator=g), torch.randint(0, 10, (n,), generator=g))


def steady(trainer: Trainer, pos: Position, steps: int) -> None:
    """``steps`` more steps of ``trainer.train_span`` under the sync debug mode "error"."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer.train_span(pos, 0, pos.step + steps)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@contextmanager
def host_reads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Every read of a tensor's value by the host while inside, each named by the innermost line of
    ``runner/`` that led to it, but the data loader's own (its sampler's indices and worker seeds live in
    host memory whatever the device)."""
    seen: list[str] = []

    def counting(name: str, method):  # noqa: ANN001
        def read(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
            stack = traceback.extract_stack()[:-1]
            if f"torch{os.sep}utils{os.sep}data" not in stack[-1].filename:
                where = next((f for f in reversed(stack) if "/runner/" in f.filename), stack[-1])
                seen.append(f"{name} at {where.filename.split('/runner/')[-1]}:{where.lineno}")
            return method(self, *args, **kwargs)

        return read

    with monkeypatch.context() as patch:
        for name in READS:
            patch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
        yield seen


def test_the_steady_state_step_reads_nothing_on_the_host_on_cpu(monkeypatch):
    """The CPU stand-in of the test below: the same steps read no tensor's value on the host; the bar is
    off (on CPU it reads the loss directly, on a GPU through an event the test below checks)."""
    trainer, written = trainer_on(torch.device("cpu"), images(20 * BATCH), bar=False)
    assert trainer.guard.deferred
    pos = Position()
    trainer.train_span(pos, 0, WARMUP)
    with host_reads(monkeypatch) as seen:
        trainer.train_span(pos, 0, pos.step + 8)
    assert pos.step == WARMUP + 8 and seen == [] and written == []
    with host_reads(monkeypatch) as seen:  # the counting itself works: the deferred read is one
        trainer.guard.check()
    assert seen, "the deferred check reads the device: the counting missed it"


@pytest.mark.slow
@cuda
def test_the_steady_state_step_does_not_synchronise(monkeypatch):
    monkeypatch.setenv(TTY_ENV, "1")
    device = torch.device("cuda")
    trainer, written = trainer_on(device, images(20 * BATCH))
    assert trainer.guard.deferred and trainer.meter.display.mode == "bar"
    pos = Position()
    trainer.train_span(pos, 0, WARMUP)  # the first step's checks, the allocator, cuDNN
    steady(trainer, pos, 8)
    assert pos.step == WARMUP + 8 and written == []
    assert isinstance(trainer.last_loss, torch.Tensor) and trainer.last_loss.is_cuda
    trainer.guard.check()  # the deferred read: every step was finite
    trainer.meter.log_every = pos.step + 1
    trainer.train_span(pos, 0, pos.step + 1)  # one step more: its record reads the device once
    assert len(written) == 1 and 0 < written[0] < 10


@pytest.mark.slow
@cuda
def test_batches_gathered_in_gpu_memory_are_the_hosts_and_do_not_synchronise():
    """A data set held as tensors moves to the GPU (``ClassificationData.place``); its batches are gathered
    there (the indices copied from pinned memory), equal to the host's, and the step still never waits."""
    from runner.data.base import ClassificationData, TensorData

    device = torch.device("cuda")
    data = images(20 * BATCH)
    x, y = data.tensors
    held = ClassificationData(TensorData(x, y), TensorData(x[:BATCH], y[:BATCH]), (3, 16, 16), 10)
    assert held.place(device) == x.nbytes + y.nbytes + BATCH * (x[0].nbytes + y[0].nbytes)
    assert held.resident and held.train.x.is_cuda and held.workers == 0
    gx, gy = held.train.__getitems__([5, 0, 17])
    assert gx.is_cuda and torch.equal(gx.cpu(), x[[5, 0, 17]]) and torch.equal(gy.cpu(), y[[5, 0, 17]])
    loader = held.train_loader(0, 1, BATCH, seed=0)
    trainer, written = trainer_on(device, data, bar=False, loader=loader)
    pos = Position()
    trainer.train_span(pos, 0, WARMUP)
    steady(trainer, pos, 8)
    assert pos.step == WARMUP + 8 and written == []
    trainer.guard.check()


@pytest.mark.slow
@cuda
def test_a_nan_on_the_gpu_is_named_at_the_read_without_a_sync_at_its_step():
    data = images(20 * BATCH)
    trainer, _ = trainer_on(torch.device("cuda"), data, bar=False)
    pos = Position()
    trainer.train_span(pos, 0, WARMUP)
    data.tensors[0][2 * BATCH] = float("nan")  # in the 3rd batch of the next span: its step WARMUP + 3
    steady(trainer, pos, 6)  # the step goes on, and nothing waits for the device
    with pytest.raises(Diverged, match=rf"non-finite loss nan at step {WARMUP + 3} on rank 0"):
        trainer.guard.check()


@pytest.mark.slow
@cuda
def test_prefetched_batches_arrive_whole_and_in_order():
    """Copied on the side stream one step ahead, each group is the host's, on the device, in order, and
    the current stream computes on it only once it is there."""
    device = torch.device("cuda")
    host = [
        [(torch.full((64, 256), float(i)).pin_memory(), torch.full((64,), i).pin_memory())] for i in range(6)
    ]
    total = torch.zeros((), device=device)
    for i, [(x, y)] in enumerate(Prefetch(device)(iter(host))):
        assert x.is_cuda and y.is_cuda
        total += x.sum() + y.sum()  # on the current stream
        assert torch.equal(x.cpu(), host[i][0][0]) and torch.equal(y.cpu(), host[i][0][1])
    assert total.item() == sum(i * (64 * 256 + 64) for i in range(6))
