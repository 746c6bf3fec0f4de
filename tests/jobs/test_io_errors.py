"""Real jobs against bad files, full disks and a model that does not fit its data: the cause is named,
nothing hangs, nothing written is lost."""

from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.mpi]


def test_a_corrupt_data_file_is_named_in_the_last_line_and_the_summary(tmp_path):
    root = tmp_path / "cifar"
    root.mkdir()
    rng = np.random.default_rng(0)
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        batch = {b"data": rng.integers(0, 255, (16, 3072), dtype=np.uint8), b"labels": [1] * 16}
        (root / name).write_bytes(pickle.dumps(batch))
    (root / "data_batch_3").write_bytes(b"not a pickle")
    run = run_cli(tmp_path / "run", "data=cifar10", f"data.root={root}", "model=mlp", "data.workers=0")
    assert run.returncode == 1, run.output
    cause = f"{root / 'data_batch_3'} is not a CIFAR-10 batch file"
    last = [line for line in run.output.splitlines() if line.strip()][-1]
    assert cause in last, last
    s = run.summary
    assert s["status"] == "failed" and cause in s["cause"] and s["failed_rank"] in (0, 1)
    assert run.output.count("Traceback") == 0, "tracebacks belong in the rank logs, not on the console"


@pytest.fixture
def small_disk(tmp_path):
    """A 1.5 MB tmpfs (needs root and the right to mount, as on our CI machines; skipped otherwise)."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1536k", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_ends_the_job_with_a_clear_error_and_keeps_complete_checkpoints(small_disk):
    """Checkpoints after every step and kept: the disk fills within the first epoch. The job must end
    (no hang), say why, and leave only complete checkpoints in the index."""
    run = run_cli(
        small_disk / "run", "checkpoint.every=1", "checkpoint.keep=1000", "train.epochs=2", timeout=120
    )
    assert run.returncode == 1, run.output
    last = run.output.strip().splitlines()[-1]
    assert "No space left on device" in last and str(small_disk / "run") in last, last
    index = small_disk / "run/checkpoints/checkpoint.json"
    assert index.exists(), "no checkpoint fitted at all: make the tmpfs larger"
    entries = json.loads(index.read_text())["checkpoints"]
    assert entries
    for entry in entries:
        for rank in (0, 1):
            torch.load(small_disk / "run/checkpoints" / entry["dir"] / f"rank{rank}.pt", weights_only=True)
    for line in (small_disk / "run/metrics.jsonl").read_text().splitlines()[:-1]:
        json.loads(line)


def test_an_unwritable_checkpoint_folder_fails_clearly(tmp_path):
    """A run folder whose checkpoint folder cannot be made (a file is in the way): the rank names the path
    and the error, and the launcher still writes summary.json."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("in the way")
    run = run_cli(run_dir, "checkpoint.every=5", "train.epochs=1", "model=mlp", timeout=120)
    assert run.returncode == 1, run.output
    assert "checkpoints" in run.summary["cause"] and "Error" in run.summary["cause"]
    assert Path(run_dir / "summary.json").exists()


def test_a_model_that_does_not_take_the_data_fails_at_the_first_step_naming_the_shapes(tmp_path):
    """model.input_shape set by hand, as a user's own model might get it wrong: not checkable before the
    model exists, so the first step says what went in and what the model expected."""
    run = run_cli(tmp_path / "run", "model=mlp", "model.input_shape=[100]", timeout=120)
    assert run.returncode == 1, run.output
    cause = run.summary["cause"]
    assert "MLP does not take this data: inputs [32, 1, 8, 8]" in cause
    assert "(32x64 and 100x128)" in cause and "model.input_shape" in cause


def test_nan_in_the_validation_data_is_named_as_the_data_not_as_a_collapse(tmp_path):
    """One validation record of worker 1's share is NaN (tests/helpers/plain_data.py NaNRecord): the job
    fails naming the data and where, not "the run collapsed; lower optim.lr"."""
    data = (
        "data=dataset",
        "data.train._target_=tests.helpers.plain_data.Blobs",
        "+data.val._target_=tests.helpers.plain_data.NaNRecord",
        "data.shape=[4]",
        "data.num_classes=3",
    )
    run = run_cli(tmp_path / "run", *data, "model=mlp", "train.epochs=1", "hardware.bind=none")
    assert run.returncode == 1, run.output
    s = run.summary
    assert s["status"] == "failed" and "collapsed" not in run.output, run.output
    assert "the validation data is not finite (batch 0 of worker 1's share holds 4 NaN" in s["cause"], s
