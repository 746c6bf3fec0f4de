"""Errors of the data, named as such: a loader process's exception by its own type, message and place, not
by torch's wrapper line ("Caught ValueError in DataLoader worker process 0."); non-finite validation data
found where it is."""

from __future__ import annotations

from torch.utils.data import DataLoader

from runner.rank.records.output import root_cause
from tests.helpers.plain_data import BadRecord


def cause_of(loader: DataLoader) -> str:
    """The root cause of the error iterating ``loader`` raises. Its traceback is dropped: it holds the
    loader's iterator in a reference cycle, and an iterator collected by the cycle collector waits 5 s for
    its loader process (its queues are closed before it asks the process to end)."""
    try:
        list(loader)
    except ValueError as err:
        cause = root_cause(err)
        err.__traceback__ = None
        return cause
    raise AssertionError("the loader raised nothing")


def test_a_loader_process_error_is_named_by_its_own_message():
    cause = cause_of(DataLoader(BadRecord(bad=3, size=8), batch_size=2, num_workers=1))
    assert cause.startswith("ValueError: record 3 is damaged (bad checksum in blobs.bin) ("), cause
    assert "plain_data.py:" in cause and cause.endswith(", in DataLoader worker process 0)"), cause


def test_an_error_of_the_training_process_is_named_as_before():
    cause = cause_of(DataLoader(BadRecord(bad=3, size=8), batch_size=2, num_workers=0))
    assert (
        cause.startswith("ValueError: record 3 is damaged (bad checksum in blobs.bin) (")
        and "worker" not in cause
    )


def test_the_first_batch_holding_nan_or_inf_is_found_in_any_batch_structure():
    import torch

    from runner.rank.validation import nonfinite_batch

    clean = [(torch.ones(2, 3), torch.tensor([0, 1]))] * 3
    assert nonfinite_batch(clean) is None
    bad = torch.ones(2, 3)
    bad[1, 2] = float("inf")
    assert nonfinite_batch([*clean, ({"x": bad, "ids": torch.tensor([1, 2])}, torch.zeros(2))]) == (3, 1)
    assert nonfinite_batch([(torch.ones(1), torch.tensor([float("nan")] * 2))]) == (0, 2), "targets too"
