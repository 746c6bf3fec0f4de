"""``hydra/launcher=mpitrain_slurm``'s launcher without a Slurm: each point's result from the task that ran
it, and the jobs' states from ``squeue`` where ``sacct`` has no accounting to read.

The Slurm commands are stand-ins on PATH that answer as Slurm 22.05 does (``AccountingStorageType=
accounting_storage/none``, no slurmdbd); their answers were taken from a real slurmctld. The real sweep on
real Slurm is ``tests/cluster/test_slurm_sweep.py``.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest

pytest.importorskip(
    "hydra_plugins.hydra_submitit_launcher",
    reason='hydra-submitit-launcher is not installed: pip install -e ".[slurm]"',
)

from hydra.core.utils import JobReturn, JobStatus  # noqa: E402
from submitit.core import core  # noqa: E402
from submitit.core.utils import cloudpickle_dump  # noqa: E402
from submitit.slurm.slurm import SlurmJob  # noqa: E402

from runner.launcher.launch import JobEnded  # noqa: E402
from runner.launcher.slurm_sweep import PURGED, UNLISTED_S, QueueWatcher  # noqa: E402
from tests.conftest import CONF  # noqa: E402

#: What sacct of Slurm 22.05 says without accounting (on stderr, exit status 1).
NO_ACCOUNTING = "Slurm accounting storage is disabled"
#: squeue --noheader --states=all --jobs=1 --format=%i|%T|%N on Slurm 22.05: an array of 4 tasks, 2 at a
#: time (the pending ones on one line), then the same array once every task ended.
SQUEUE_RUNNING = "1_[2-3%2]|PENDING|\n1_0|RUNNING|swn[1-2]\n1_1|RUNNING|swn[1-2]\n"
SQUEUE_ENDED = "1_2|CANCELLED|\n1_1|COMPLETED|swn[1-2]\n1_0|TIMEOUT|swn[1-2]\n"


def stand_in(folder: Path, name: str, body: str) -> None:
    """An executable ``folder/name`` that logs its arguments to ``folder/calls`` and runs ``body`` (sh)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(f'#!/bin/sh\necho "{name} $*" >> "{folder}/calls"\n{body}\n')
    path.chmod(0o755)


@pytest.fixture
def slurm(tmp_path, monkeypatch):
    """Stand-in ``sacct`` (no accounting) and ``squeue`` (prints ``slurm.answer``, or fails with
    ``slurm.squeue_error``) first on PATH; ``slurm.calls()`` lists the commands run."""

    class Slurm:
        bin = tmp_path / "bin"
        answer = bin / "squeue.answer"

        def calls(self) -> list[str]:
            path = self.bin / "calls"
            return path.read_text().splitlines() if path.exists() else []

        def say(self, text: str) -> None:
            self.answer.write_text(text)

    stand_in(Slurm.bin, "sacct", f'echo "{NO_ACCOUNTING}" >&2; exit 1')
    squeue = f'[ -f "{Slurm.bin}/squeue.error" ] && {{ cat "{Slurm.bin}/squeue.error" >&2; exit 1; }}'
    stand_in(Slurm.bin, "squeue", f'{squeue}\ncat "{Slurm.answer}"')
    stand_in(Slurm.bin, "srun", "exit 1")  # submitit's test for a Slurm cluster
    monkeypatch.setenv("PATH", f"{Slurm.bin}{os.pathsep}{os.environ['PATH']}")
    return Slurm()


def watching(*job_ids: str) -> QueueWatcher:
    watcher = QueueWatcher()
    for job_id in job_ids:
        watcher.register_job(job_id)
    return watcher


def test_without_accounting_the_states_come_from_squeue(slurm):
    """sacct fails (no slurmdbd) once; from then on squeue alone answers, pending array tasks included; a
    job slurmctld no longer lists has ended. (submitit's watcher would say UNKNOWN forever.)"""
    slurm.say(SQUEUE_RUNNING)
    watcher = watching("1_0", "1_1", "1_2", "1_3")
    assert watcher.get_state("1_3", mode="force") == "PENDING"
    states = [watcher.get_state(j, mode="cache") for j in ("1_0", "1_1", "1_2")]
    assert states == ["RUNNING", "RUNNING", "PENDING"]
    assert not any(watcher.is_done(j, mode="cache") for j in ("1_0", "1_1", "1_2", "1_3"))
    slurm.say(SQUEUE_ENDED)  # 1_3 ended more than MinJobAge ago: no longer listed
    watcher.update()
    states = [watcher.get_state(j, mode="cache") for j in ("1_0", "1_1", "1_2", "1_3")]
    assert states == ["TIMEOUT", "COMPLETED", "CANCELLED", PURGED]
    assert all(watcher.is_done(j, mode="cache") for j in ("1_0", "1_1", "1_2", "1_3"))
    calls = slurm.calls()
    assert calls[0] == "sacct -o JobID,State,NodeList --parsable2 -j 1", calls
    assert calls[1:] == ["squeue --noheader --states=all --jobs=1 --format=%i|%T|%N"] * 2, calls


def test_sacct_is_kept_where_it_works(slurm):
    """With accounting (slurmdbd) sacct answers (its job steps, 7_0.batch, left out); squeue is not run."""
    stand_in(slurm.bin, "sacct", 'printf "JobID|State|NodeList\\n7_0|RUNNING|n1\\n7_0.batch|RUNNING|n1\\n"')
    watcher = watching("7_0")
    assert watcher.get_state("7_0", mode="force") == "RUNNING" and watcher.accounting is True
    assert not any(call.startswith("squeue") for call in slurm.calls())


def test_a_job_slurmctld_forgot_has_ended_and_a_silent_slurm_is_named(slurm, caplog):
    """squeue's 'Invalid job id' (exit 1): none of the jobs is listed any more, so they ended (one never
    listed: a minute after its submission). squeue failing otherwise (no controller): the state stays
    unknown, with a warning naming what is needed."""
    slurm.say("3|RUNNING|swn1\n")
    watcher = watching("3", "5")
    assert watcher.get_state("3", mode="force") == "RUNNING"
    assert watcher.get_state("5", mode="cache") == "UNKNOWN", "never listed: maybe not yet"
    (slurm.bin / "squeue.error").write_text("slurm_load_jobs error: Invalid job id specified")
    watcher.update()
    assert watcher.get_state("3", mode="cache") == PURGED and not watcher.is_done("5", mode="cache")
    watcher.since["5"] -= UNLISTED_S
    watcher.update()
    assert watcher.get_state("5", mode="cache") == PURGED
    (slurm.bin / "squeue.error").write_text("squeue: error: Unable to contact slurm controller")
    watcher = watching("4_0")
    with caplog.at_level(logging.WARNING, logger="runner"):
        assert not watcher.is_done("4_0", mode="force")
    assert "Unable to contact slurm controller" in caplog.text and "slurmdbd" in caplog.text


class FakeArray:
    """``submitit.AutoExecutor(cluster="slurm")`` as a sweep sees it on Slurm with ``use_srun: false``:
    one array job (8) of one task per point with ``nodes × tasks_per_node`` tasks each, of which only task
    0 runs the point and writes a result; ``RESULTS`` are those (None: the job ended without one)."""

    RESULTS: list[JobReturn | None] = []

    def __init__(self, cluster: str, folder: str, **kwargs) -> None:
        assert cluster == "slurm"
        self.folder, self.parameters = folder, {}

    def update_parameters(self, **parameters) -> None:
        self.parameters.update(parameters)

    def map_array(self, launcher, *args) -> list[SlurmJob]:
        assert len(args[0]) == len(self.RESULTS)
        tasks = range(self.parameters["nodes"] * self.parameters["tasks_per_node"])
        jobs = [SlurmJob(folder=self.folder, job_id=f"8_{i}", tasks=tasks) for i in range(len(args[0]))]
        for job, result in zip(jobs, self.RESULTS, strict=True):
            job.paths.folder.mkdir(parents=True)  # (where submitit puts the point's pickled call)
            if result is not None:
                cloudpickle_dump(("success", result), job.task(0).paths.result_pickle)
        return jobs


def slurm_launcher(sweep_dir: Path, overrides: list[str]):
    """``hydra/launcher=mpitrain_slurm`` as Hydra instantiates it for a multirun of ``overrides``."""
    from hydra import initialize_config_dir
    from hydra._internal.callbacks import Callbacks
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.plugins import Plugins
    from hydra.core.utils import setup_globals
    from hydra.types import HydraContext, RunMode

    from runner.launcher.register import register

    register()
    setup_globals()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        argv = ["hydra/launcher=mpitrain_slurm", "hardware=slurm", "devices=4", "hydra.launcher.nodes=2"]
        cfg = loader.load_configuration(
            "config", argv + [f"hydra.sweep.dir={sweep_dir}", *overrides], RunMode.MULTIRUN
        )
        context = HydraContext(config_loader=loader, callbacks=Callbacks())
        return Plugins.instance().instantiate_launcher(hydra_context=context, task_function=None, config=cfg)


@pytest.mark.timeout(60)
def test_every_point_reports_the_result_of_the_task_that_ran_it(slurm, tmp_path, monkeypatch):
    """A 3-point sweep of 4-task jobs: ok, diverged, and cancelled by Slurm before it started. Every point
    is taken from task 0 (hydra-submitit-launcher waits for a result from all 4 tasks: forever here, or
    UncompletedJobError for task 1), the two not ok are named and recorded for the exit status, and the
    cancelled one gets a summary.json, so the report has all three."""
    import runner.launcher.outcomes as outcomes

    monkeypatch.setattr("submitit.AutoExecutor", FakeArray)
    monkeypatch.setattr(core.Job, "_results_timeout_s", 0)  # no result is coming: do not wait for one
    monkeypatch.setattr(outcomes, "NOT_OK", [])
    slurm.say("8_2|CANCELLED|\n8_1|COMPLETED|swn[1-2]\n8_0|COMPLETED|swn[1-2]\n")
    points = [["optim.lr=0.05"], ["optim.lr=0.1"], ["optim.lr=0.2"]]
    FakeArray.RESULTS = [
        JobReturn(overrides=points[0], status=JobStatus.COMPLETED, _return_value=0.97),
        JobReturn(
            overrides=points[1], status=JobStatus.FAILED, _return_value=JobEnded("nan at step 3", "diverged")
        ),
        None,
    ]
    sweep = tmp_path / "sweep"
    launcher = slurm_launcher(sweep, ["optim.lr=0.05,0.1,0.2"])
    assert type(launcher).__name__ == "MpitrainSlurmLauncher"
    returns = launcher.launch(points, initial_job_idx=0)
    assert [r.status for r in returns] == [JobStatus.COMPLETED] * 3, "the sweep goes on to its report"
    assert returns[0].return_value == 0.97 and all(math.isnan(r.return_value) for r in returns[1:])
    assert outcomes.NOT_OK == [("optim.lr=0.1", "diverged", 3), ("optim.lr=0.2", "failed", 1)]
    lost = json.loads((sweep / "2" / "summary.json").read_text())
    assert lost["status"] == "failed" and lost["name"] == "optim.lr=0.2" and lost["slurm_job"] == "8_2"
    assert "Slurm state CANCELLED" in lost["error"]
    assert sum(call.startswith("sacct") for call in slurm.calls()) == 1
