"""Streaming DiLoCo under ``hardware.fault_tolerance=heal``: a worker killed just after a step began is
replaced, and every worker goes on at the same step and batch to the end, where ``model.pt`` is written.

Killed there, the loss surfaces on the survivors at different points: the per-step agreement's
non-blocking all-reduce completes on some of them and fails on others, and those go on with a step of
their own (Streaming DiLoCo's steps are local) and notice the loss a step later. The survivors behind
then take the state and position of the one ahead (``Recovery._agree``) without having drawn its
batches: they used to train them all the same, a step ahead of the others from then on, and the job hung
at the end of the epoch or of the run (issue 45), until the stall watchdog ended it without ``model.pt``.
Worker 1 sleeping in the step before the kill has all workers start the killed step together, so the kill
lands at the same point of it each time: each draw below misaligned the workers and hung the job in 5 of 5
runs before the fix (kills timed from a step's start alone: 5 of 16).
"""

from __future__ import annotations

import re

import pytest

from tests.conftest import Run, run_cli

HEAL = [
    "hydra.searchpath=[file://tests/conf]",
    "model=dies_midstep",
    "rule=streaming_diloco",
    "devices=4",
    "hardware.oversubscribe=true",
    "hardware.fault_tolerance=heal",
    "train.epochs=4",  # 12 steps an epoch; a misalignment in the last one is hidden by the run's end
    "train.stall_timeout=30",  # a hang ends the job (exit 4) well before the test's timeout
]
#: Per draw: launch rank 1 sleeps 1.5 s in its step k, launch rank 2 dies 10 ms into its step k + 1
#: (training forward calls, counted from 1).
DRAWS = [22, 34]

CHECKPOINT = re.compile(r"checkpoint after step (\d+) \((?:epoch (\d+), batch (\d+)|end of epoch (\d+))\)")


def checkpoints(run: Run, rank: int, after: int) -> list[tuple[int, ...]]:
    """(step, epoch, batch) of every checkpoint after step ``after`` that ``logs/rank<rank>.log`` names (the
    end of epoch E: epoch E + 1, batch 0)."""
    text = (run.dir / "logs" / f"rank{rank}.log").read_text()
    found = [
        (int(m[1]), int(m[2]), int(m[3])) if m[4] is None else (int(m[1]), int(m[4]) + 1, 0)
        for m in CHECKPOINT.finditer(text)
    ]
    return [c for c in found if c[0] > after]


@pytest.mark.slow
@pytest.mark.mpi
def test_streaming_diloco_heals_a_worker_killed_mid_step_and_the_workers_stay_level(tmp_path):
    for k in DRAWS:
        draw = f"rank 2 killed 10 ms into its step {k + 1}"
        timing = [f"model.holds=[[1,{k},1500]]", f"model.kills=[[2,{k + 1},10]]"]
        run = run_cli(tmp_path / f"run{k}", *HEAL, *timing, timeout=150)
        assert run.returncode == 0, f"{draw}:\n{run.output}"
        assert (run.dir / "model.pt").exists(), draw
        summary = run.summary
        assert summary["status"] == "ok" and summary["workers_at_end"] == 4, (draw, summary)
        [failure], [join] = summary["failures"], summary["joins"]
        assert failure["rank"] == 2 and join["rank"] == 4, (draw, summary)
        assert [r["step"] for r in run.records("epoch")] == [12, 24, 36, 48], draw
        # the workers checkpointed at the same steps and batches after the join, the last after step 48
        seen = {r: checkpoints(run, r, join["step"]) for r in (0, 1, 3, 4)}
        assert seen[4] and seen[4][-1] == (48, 4, 0), (draw, seen)
        assert all(c == seen[4] for c in seen.values()), (draw, seen)
