"""A worker of a server-based rule (ASGD, async EASGD) killed right after another worker took a validation
alone and sent worker 0 its results: under ``continue`` and ``heal`` the survivors go on and the job ends
ok. The message went with the communicator the survivors replaced; worker 0 used to wait for it at the
epoch's end while the others waited for worker 0 (the stall watchdog ended the job, exit 4)."""

from __future__ import annotations

import pytest

from tests.conftest import run_cli

RULES = {"asgd": ["rule=asgd"], "easgd-async": ["rule=easgd", "rule.variant=async"]}


#: Each rule once and each tolerance once: the survivors' replaced communicator is the same under both
#: (heal then grows it), and a job is 15-25 s of CI.
@pytest.mark.parametrize("rule, tolerance", [("asgd", "continue"), ("easgd-async", "heal")])
@pytest.mark.slow
@pytest.mark.mpi
def test_a_worker_killed_after_a_validation_taken_alone_is_survived(tmp_path, rule, tolerance):
    """3 workers, validations every 4 chunks, each taken by the worker that draws its chunk: worker 2 dies
    as soon as worker 1 validated (tests/helpers/dies.py), while worker 0 sleeps a second in a step, so
    worker 1's results wait for it when the survivors replace their communicator. Workers 0 and 2 are
    15 ms a step slower, so worker 1 draws validation chunks whatever the machine's load."""
    run = run_cli(
        tmp_path / "run",
        "hydra.searchpath=[file://tests/conf]",
        "model=dies",
        "devices=3",
        "hardware.oversubscribe=true",
        f"hardware.fault_tolerance={tolerance}",
        *RULES[rule],
        "model.die_rank=2",
        "model.die_at=0",
        f"model.val_marker={tmp_path / 'validated'}",
        "model.hold_rank=0",
        "model.hold_s=1",
        "train.val_every=0.1",
        # workers 0 and 2 a little slower than worker 1, so that worker 1 draws validation chunks on any
        # machine (without it, worker 1 once drew none: the marker never came and nothing was tested)
        "simulate.straggler_ranks=[0,2]",
        "simulate.straggler_ms=15",
        f"train.epochs={2 if tolerance == 'heal' else 1}",  # heal: an agreement after a late loss too
        "train.stall_timeout=60",  # a deadlock ends the job (exit 4), not the test's timeout
        timeout=150,
    )
    assert run.returncode == 0, run.output
    summary = run.summary
    assert summary["status"] == "ok" and summary["exit_status"] == 0
    [failure] = summary["failures"]
    assert failure["rank"] == 2
    assert summary["workers_at_end"] == (3 if tolerance == "heal" else 2), summary
    alone = [r for r in run.records("val") if r.get("alone")]
    assert any(r["by"] == 1 for r in alone), "worker 1 validated alone, and worker 0 recorded it"
    if tolerance == "heal":
        [join] = summary["joins"]
        assert join["rank"] == 4 and join["step"] >= failure["step"]
