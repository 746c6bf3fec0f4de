"""A worker of a server-based rule (ASGD, async EASGD, async DiLoCo) killed at and after a validation is
survived under ``continue`` and ``heal``: the checkpoints are written whole and the job ends ok.

At these moments the job stalled until the watchdog ended it (exit 4, naming the server rank), or failed:

* Right after the run's last validation, as it takes its part of the final checkpoint: it had asked the
  servers to save, so they saved with the survivors' first try and then waited for its last message, which
  never came once the job-wide barrier had dropped it; the survivors' second try asked them again. (A
  collective it had entered could also complete on some survivors and fail on others, and the first went
  on to the job-wide barrier while the others recovered, each waiting for the other.)
* In that checkpoint's job-wide barrier, which goes on without it: the run's results, gathered over the
  workers after it, failed (``PeerLost``, exit 1).
* Within an epoch whose meetings each take a checkpoint (``checkpoint.every=1``), with validations taken
  alone (``train.val_every=0.25``): a survivor that noticed the loss before a meeting the others had passed
  (cut off in its checkpoint) took that checkpoint alone after the recovery.
"""

from __future__ import annotations

import pytest

from runner.run_folder import checkpoint_part, read_checkpoint_index
from tests.conftest import run_cli

#: Dies as it enters its first ``allgather_object``: the one that gathers the chunks each worker holds for
#: the final checkpoint, right after the last validation (tests/helpers/dies.py).
IN_THE_FINAL_CHECKPOINT = ["train.epochs=1", "model.die_at=0", "model.die_in=allgather_object"]
#: Dies as it enters the final checkpoint's job-wide barrier (its first ``fault_barrier``).
IN_ITS_BARRIER = ["train.epochs=1", "model.die_at=0", "model.die_in=fault_barrier"]
#: Dies at its 11th step, in an epoch of checkpoints at every meeting and validations taken alone.
AT_A_MEETING = ["train.epochs=2", "model.die_at=11", "checkpoint.every=1", "train.val_every=0.25"]

#: (rule, fault tolerance, the launch rank killed, when): each rule, each tolerance, rank 0 (which holds the
#: records and the dealer's counter) and others.
DRAWS = [
    (["rule=asgd"], "continue", 0, IN_THE_FINAL_CHECKPOINT),
    (["rule=easgd", "rule.variant=async"], "heal", 2, IN_THE_FINAL_CHECKPOINT),
    (["rule=async_diloco", "rule.inner_steps=5"], "continue", 1, IN_THE_FINAL_CHECKPOINT),
    (["rule=asgd"], "heal", 3, IN_ITS_BARRIER),
    (["rule=asgd"], "continue", 2, AT_A_MEETING),
]


@pytest.mark.slow
@pytest.mark.mpi
def test_a_server_rule_worker_killed_after_a_validation_is_survived(tmp_path):
    """4 workers; each draw kills one worker once (SIGKILL); the job must end ok within the stall timeout."""
    for i, (rule, tolerance, die, when) in enumerate(DRAWS):
        run = run_cli(
            tmp_path / f"run{i}",
            "hydra.searchpath=[file://tests/conf]",
            "model=dies",
            "devices=4",
            "hardware.oversubscribe=true",
            f"hardware.fault_tolerance={tolerance}",
            *rule,
            f"model.die_rank={die}",
            *when,
            "train.stall_timeout=60",  # a deadlock ends the job (exit 4), not the test's timeout
            timeout=150,
        )
        what = f"{rule} {tolerance}, rank {die} killed ({when})"
        assert run.returncode == 0, f"{what}:\n{run.output}"
        summary = run.summary
        assert summary["status"] == "ok" and summary["workers_at_end"] in (3, 4), (what, summary)
        [failure] = summary["failures"]
        assert failure["rank"] == die, (what, failure)
        if when is not AT_A_MEETING:  # noticed at the end
            assert failure["step"] == summary["steps"] and summary["workers_at_end"] == 3, (what, summary)
        latest = read_checkpoint_index(run.dir)[-1]
        assert latest["end"] and latest["world_size"] == summary["workers_at_end"] + 1, (what, latest)
        for rank in range(latest["world_size"]):  # the survivors' parts and the server's
            assert checkpoint_part(run.dir, latest["dir"], rank).is_file(), (what, rank)
