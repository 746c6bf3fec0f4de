"""Records of a language model's run: tokens/s beside samples/s, and validation on a fixed spread."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import TensorDataset

from runner.data.base import spread
from runner.rank.records.meter import Timing
from tests.conftest import checked_config


def test_tokens_per_second_is_samples_per_second_times_the_window():
    t = Timing(data=0.5, compute=1.0, comm=0.5, samples=12, steps=1)
    rates = t.rates(world=4, tokens_per_sample=64)
    assert rates["samples_per_s"] == pytest.approx(12 * 4 / 2.0)
    assert rates["tokens_per_s"] == pytest.approx(12 * 4 * 64 / 2.0)
    assert "tokens_per_s" not in Timing(compute=1.0, samples=3, steps=1).rates(world=1)  # not a LM


def test_the_language_model_task_counts_a_sequence_s_tokens_others_none():
    lm = checked_config(["task=language_model"]).task
    assert lm.tokens_per_sample([64]) == 64
    assert checked_config([]).task.tokens_per_sample([1, 8, 8]) is None


@pytest.mark.parametrize("count", [1, 7, 100, 999])
def test_validation_samples_are_spread_evenly_and_the_same_for_any_run(count):
    data = TensorDataset(torch.arange(1000))
    kept = spread(data, count)
    picked = [int(kept[i][0]) for i in range(len(kept))]
    assert len(picked) == count == len(set(picked)) and picked == sorted(picked)
    assert picked[0] == 0 and picked[-1] >= 1000 - 1000 // count - 1  # reaches the end of the set
    assert picked == [int(spread(data, count)[i][0]) for i in range(count)]


def test_no_count_or_a_larger_one_keeps_the_whole_set():
    data = TensorDataset(torch.arange(10))
    assert spread(data, None) is data and spread(data, 10) is data and spread(data, 50) is data


def test_val_samples_is_checked():
    with pytest.raises(ValueError, match=r"train\.val_samples=0 is invalid"):
        checked_config(["train.val_samples=0"])


def test_a_checkpoint_s_timings_are_what_older_runs_wrote_and_take_the_task_s_tokens_back():
    from unittest.mock import MagicMock

    from runner.rank.records.meter import Meter

    meter = Meter(MagicMock(seconds=0.0, emulated_seconds=0.0), 2, 10, MagicMock(), 5, tokens_per_sample=64)
    meter.total = Timing(compute=2.0, samples=24, steps=2)
    state = meter.state_dict()
    assert all("tokens_per_sample" not in span for span in state.values())  # as before tokens were counted
    again = Meter(MagicMock(seconds=0.0, emulated_seconds=0.0), 2, 10, MagicMock(), 5, tokens_per_sample=64)
    again.load_state_dict(state, step=2, mid_epoch=False)
    assert again.total.samples == 24 and again.total.rates(2, again.tokens_per_sample)[
        "tokens_per_s"
    ] == pytest.approx(24 * 2 * 64 / 2)


def test_the_tokens_seen_count_every_workers_samples_once_when_workers_are_lost_or_join():
    """The job-wide count (the epoch records' and the summary's ``tokens``) adds each worker's samples since
    the last count: a worker that joined took worker 0's records (timings and totals) and counts from its
    join, not worker 0's samples again; a lost worker's counted ones stay counted."""
    from runner.comm.stats import CommStats
    from runner.rank.records.meter import Meter

    def meter() -> Meter:
        return Meter(CommStats(), 2, 100, SimpleNamespace(write=lambda *a, **k: None), 10, progress=False)

    def train(m: Meter, samples: int) -> None:  # a step, and its epoch's end (the loop counts there)
        for _ in m.batches([0]):
            m.step_done(1, 0, 0.5, samples, 0.1)
        m.epoch_done()

    def count(*workers: Meter) -> list[float]:
        new = sum(m.new_samples() for m in workers)
        for m in workers:
            m.count_job(new)
        return [m.job_samples for m in workers]

    a, b = meter(), meter()
    train(a, 100), train(b, 80)
    assert count(a, b) == [180, 180]
    c = meter()  # joins between epochs: takes worker 0's state, as the package gives it
    c.load_state_dict(a.state_dict(), 1, False)
    c.rebase()
    train(a, 50), train(b, 40), train(c, 30)
    assert count(a, b, c) == [300, 300, 300], "not 400: worker 0's 100 again"
    d = meter()
    for i in a.batches([20, 10]):  # worker 0's epoch: 20 samples, a worker joins (mid-epoch), 10 more
        a.step_done(1, 0, 0.5, i, 0.1)
        if i == 20:
            d.load_state_dict(a.state_dict(), 1, True)  # the epoch's timing too: its end adds it
            d.rebase()
    a.epoch_done()
    train(d, 5)
    assert count(a, d) == [335, 335], "worker 0's 30 and the joined worker's 5, not its 20 again"
    train(a, 10), train(d, 10)  # b and c are lost after a count: what they trained stays counted
    assert count(a, d) == [355, 355]
    old = a.state_dict()
    del old["job"]  # a checkpoint from before the count: each worker's whole total counts, as it did
    d = meter()
    d.load_state_dict(old, 1, False)
    assert d.new_samples() == a.total.samples
