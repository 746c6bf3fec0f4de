"""``hydra/launcher=mpitrain_slurm``'s launcher: hydra-submitit-launcher's ``SlurmLauncher``.

With each sweep point's result read from the one task that ran it, and Slurm's job states read without
accounting.

With ``use_srun: false`` a point's batch script runs its Python once (task 0), which starts the ranks with
``mpirun`` in the allocation; the allocation's other tasks (one slot per rank) run nothing and leave no
result, so the plugin's ``job.results()`` (one result per task) fails every point that trained. Here each
point's result is ``job.task(0)``'s, every point is waited for, and a point that did not end ok is named on
the terminal and recorded, as the basic launcher's points are: the sweep goes on, writes its report and exits
with the first such point's status (:mod:`runner.launcher.cli`).

submitit asks ``sacct`` for the states of the jobs (to notice one that ended without a result), which fails on
a cluster without accounting (no slurmdbd: "Slurm accounting storage is disabled") and would then wait
forever: :class:`QueueWatcher` asks ``squeue`` (slurmctld, which keeps ended jobs for ``MinJobAge``) there.
"""

from __future__ import annotations

import logging
import math
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
from omegaconf import OmegaConf, open_dict
from submitit.core.core import Job
from submitit.core.utils import UncompletedJobError
from submitit.slurm.slurm import SlurmInfoWatcher

from runner.launcher import sweep_stop

log = logging.getLogger("runner")

#: The state given to a job that slurmctld no longer lists (ended more than ``MinJobAge`` ago).
PURGED = "PURGED"
#: Slurm states of a job that has not ended (squeue's long names; submitit knows only some of them).
UNFINISHED = {
    "READY", "PENDING", "RUNNING", "UNKNOWN", "REQUEUED", "COMPLETING", "PREEMPTED", "CONFIGURING",
    "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESIZING", "REQUEUE_FED", "REQUEUE_HOLD",
    "RESV_DEL_HOLD", "SPECIAL_EXIT",
}  # fmt: skip
#: What ``sacct`` says (on stderr, exit 1) where Slurm keeps no accounting (no slurmdbd).
NO_ACCOUNTING = "accounting storage is disabled"
#: What ``squeue`` says (exit 1) when none of the jobs asked about is known to slurmctld.
UNKNOWN_JOB = "Invalid job id specified"
#: Seconds between two looks at the points' result files.
POLL_S = 1.0
#: Seconds after its submission from which a job squeue has never listed counts as ended (one it has
#: listed counts as ended as soon as it is no longer listed).
UNLISTED_S = 60.0


class QueueWatcher(SlurmInfoWatcher):
    """submitit's job-state watcher, asking ``sacct`` where Slurm keeps accounting, else ``squeue``.

    It asks ``squeue`` where Slurm does not keep accounting or when ``sacct`` fails; a job slurmctld no longer
    lists has ended (state ``PURGED``)."""

    def __init__(self, delay_s: int = 60) -> None:
        super().__init__(delay_s=delay_s)
        self.accounting: bool | None = None  # None: not known yet; False: ask squeue only
        self.listed: set[str] = set()  # the jobs squeue has listed
        self.since: dict[str, float] = {}  # when each job was registered

    def register_job(self, job_id: str) -> None:
        """Watch ``job_id`` from now on."""
        super().register_job(job_id)
        self.since.setdefault(job_id, time.time())

    def refresh(self) -> None:
        """Ask for the jobs' states at the next look, not after submitit's back-off (up to ``delay_s``)."""
        self._last_status_check = float("-inf")

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        """Whether the job has ended (in any state Slurm ends a job in)."""
        return self.get_state(job_id, mode=mode).upper().split(" ")[0] not in UNFINISHED

    def update(self) -> None:
        """Refresh the states of the unfinished jobs with one ``sacct`` (else ``squeue``) call."""
        pending = self._registered - self._finished
        ids = sorted({job_id.split("_")[0] for job_id in pending})
        if not ids:
            return
        self._num_calls += 1
        text = self._ask_sacct(ids) if self.accounting is not False else None
        if text is None:
            text = self._ask_squeue(ids)
            if text is not None:
                self._info_dict.update(self._with_purged(self.read_info(text), pending))
        else:
            self._info_dict.update(self.read_info(text))
        self._last_status_check = time.time()
        for job_id in pending:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def _with_purged(self, listed: dict[str, dict[str, str]], pending: set[str]) -> dict[str, dict[str, str]]:
        """squeue's states, and PURGED for each job of ``pending`` it no longer lists.

        Also for one it never listed, since :data:`UNLISTED_S` after its submission."""
        self.listed |= pending & set(listed)
        for job_id in pending - set(listed):
            if job_id in self.listed or time.time() - self.since.get(job_id, 0.0) > UNLISTED_S:
                listed[job_id] = {"JobID": job_id, "State": PURGED}
        return listed

    def _ask_sacct(self, ids: list[str]) -> str | None:
        """``sacct``'s answer for the jobs ``ids``, or None (no accounting, or sacct failed: use squeue)."""
        argv = ["sacct", "-o", "JobID,State,NodeList", "--parsable2"] + [a for i in ids for a in ("-j", i)]
        done, error = _call(argv)
        if done is not None and done.returncode == 0:
            self.accounting = True
            return done.stdout
        if error is None and NO_ACCOUNTING not in done.stderr and self.accounting:
            log.warning("sacct failed (%s): asking slurmctld (squeue) this time", done.stderr.strip())
            return None
        if self.accounting is not False:
            said = error or done.stderr.strip() or f"exit status {done.returncode}"
            log.info("sacct cannot give the jobs' states here (%s): asking slurmctld (squeue)", said)
        self.accounting = False
        return None

    def _ask_squeue(self, ids: list[str]) -> str | None:
        """``squeue``'s answer for the jobs ``ids`` in sacct's format, or None (warned) when it failed."""
        argv = ["squeue", "--noheader", "--states=all", f"--jobs={','.join(ids)}", "--format=%i|%T|%N"]
        done, error = _call(argv)
        if done is not None and (done.returncode == 0 or UNKNOWN_JOB in done.stderr):
            return "JobID|State|NodeList\n" + (done.stdout if done.returncode == 0 else "")
        said = error or done.stderr.strip() or f"exit status {done.returncode}"
        log.warning(
            "cannot read the state of Slurm job(s) %s: squeue: %s; without it (or sacct, which needs "
            "slurmdbd) a job that ends without a result is not noticed; trying again",
            ",".join(ids),
            said,
        )
        return None


def _call(argv: list[str]) -> tuple[subprocess.CompletedProcess[str] | None, str | None]:
    """Run ``argv`` with its output captured: (the process, None), or (None, why it could not start)."""
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=120), None
    except (OSError, subprocess.TimeoutExpired) as err:
        return None, str(err)


class MpitrainSlurmLauncher(SlurmLauncher):
    """hydra-submitit-launcher's SlurmLauncher, taking each point's result from task 0 (the one that ran it).

    It waits for every point, and reports each that did not end ok (the sweep goes on)."""

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        """Send the points to Slurm as one job array; their results, in order, once every one has ended."""
        jobs = self.submit(job_overrides, initial_job_idx)
        return self.collect(jobs, job_overrides, initial_job_idx)

    def submit(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> list[Job[Any]]:
        """The plugin's submission (one array task per point), unchanged; returns submitit's jobs."""
        import submitit

        assert self.config is not None and len(job_overrides) > 0
        init_keys = {"submitit_folder", "max_num_timeout"}
        init = {"folder": self.params["submitit_folder"]}
        init.update({f"{self._EXECUTOR}_{k}": v for k, v in self.params.items() if k == "max_num_timeout"})
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        base, prefix = set(OmegaConf.structured(BaseQueueConf).keys()), f"{self._EXECUTOR}_"
        params = {k: v for k, v in self.params.items() if k not in init_keys}
        executor.update_parameters(**{(k if k in base else prefix + k): v for k, v in params.items()})
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            sweep_dir.chmod(int(str(self.config.hydra.sweep.mode), 8))
        job_params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append(
                (list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state())
            )
        return list(executor.map_array(self, *zip(*job_params, strict=True)))

    def collect(
        self, jobs: Sequence[Job[Any]], job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> list[JobReturn]:
        """Each point's JobReturn from its job's task 0, taken as the points end.

        Their state is from :class:`QueueWatcher`. A point that did not end ok is logged, recorded, and
        returned as NaN."""
        watcher = QueueWatcher()
        tasks = [job.task(0) for job in jobs]
        for task in tasks:
            task.watcher = watcher  # this job's states only: submitit's own watcher stays as it is
            watcher.register_job(task.job_id)
        returns: list[JobReturn | None] = [None] * len(tasks)
        stops = 0
        try:
            while None in returns:
                # a stop first: Slurm must not start a pending point between a look and the scancel
                seen, stops = stops, self.follow_stop(tasks, returns, stops)
                if stops > seen:  # (the jobs it cancelled: seen ended at the next look)
                    watcher.refresh()
                for i, task in enumerate(tasks):
                    if returns[i] is None and task.done():
                        returns[i] = self.point_return(task, job_overrides[i], initial_job_idx + i)
                if None in returns:
                    time.sleep(POLL_S)
        except KeyboardInterrupt:
            waiting = " ".join(t.job_id for t, r in zip(tasks, returns, strict=True) if r is None)
            log.warning("the sweep's Slurm jobs still queued or running go on: scancel %s", waiting)
            raise
        return [r for r in returns if r is not None]

    def follow_stop(self, tasks: Sequence[Job[Any]], returns: Sequence[JobReturn | None], seen: int) -> int:
        """Cancel the jobs of the points not ended once the sweep was stopped; the stop requests dealt with.

        ``seen``: those dealt with before (:mod:`runner.launcher.sweep_stop`). At the first, the jobs Slurm
        has not started (the running points read the stop in the sweep folder, then checkpoint and stop);
        at the second, all of them (their processes get Slurm's SIGTERM, mpirun too: ``interrupted``)."""
        asked = len(sweep_stop.requested())
        waiting = [t.job_id for t, r in zip(tasks, returns, strict=True) if r is None]
        if asked <= seen or not waiting:
            return max(asked, seen)
        argv = ["scancel", *(["--state=PENDING"] if asked == 1 else []), *waiting]
        done, error = _call(argv)
        if done is None or done.returncode != 0:
            said = error or done.stderr.strip() or f"exit status {done.returncode}"
            log.warning("the sweep stops, but %s failed: %s; cancel its jobs yourself", " ".join(argv), said)
        else:
            which = "not yet started" if asked == 1 else "still running"
            log.warning("the sweep stops: its Slurm jobs %s are cancelled (%s)", which, " ".join(argv))
        return asked

    def point_return(self, task: Job[Any], overrides: Sequence[str], idx: int) -> JobReturn:
        """The JobReturn of one ended point (task 0 of its job).

        Its own, or a failed one when Slurm ended the job without a result; a point that did not end ok is
        reported and given NaN.

        A point whose job a stop of the sweep cancelled before it started is none of these: it is said and
        given NaN, without submitit's wait for a result file (15 s a point, one after the other)."""
        if not task.paths.result_pickle.exists() and self.unstarted(task, overrides, idx):
            return JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED, _return_value=math.nan)
        try:
            ret = task.result()
        except (UncompletedJobError, OSError):  # (OSError: its submitit folder is gone)
            ret = self.lost_point(task, overrides, idx)
        except Exception as err:  # FailedJobError (raised outside the task), an unreadable result
            ret = JobReturn(overrides=list(overrides), status=JobStatus.FAILED, _return_value=err)
        if ret.status == JobStatus.COMPLETED:
            log.info("[%s] ok (Slurm job %s)", self.ident(list(overrides))["name"], task.job_id)
            return ret
        self.not_ok(list(overrides), ret._return_value)
        ret.status, ret.return_value = JobStatus.COMPLETED, math.nan
        return ret

    def not_ok(self, overrides: list[str], err: BaseException) -> None:
        """Name a point that did not end ok on the terminal and record it for the sweep's exit status."""
        from runner.launcher import outcomes
        from runner.launcher.launch import JobEnded
        from runner.run_folder import EXIT

        if isinstance(err, JobEnded):
            status, code = err.status, err.code
        else:
            status = "invalid" if outcomes.invalid_input(err) else "failed"
            code = EXIT[status]
        name = self.ident(overrides)["name"]
        (log.warning if status == "preempted" else log.error)("[%s] job %s: %s", name, status, err)
        outcomes.NOT_OK.append((name, status, code))

    def ident(self, overrides: list[str]) -> dict[str, Any]:
        """The point's identity (overrides, swept values, name) in this sweep."""
        from runner.schema.identity import identity

        assert self.config is not None
        return identity(overrides, list(self.config.hydra.overrides.task))

    def unstarted(self, task: Job[Any], overrides: Sequence[str], idx: int) -> bool:
        """Whether the point ended without a result because the sweep was stopped before its job started.

        (No config of its job in its folder.) It is then said in one line."""
        from runner.run_folder import CONFIG

        if not sweep_stop.requested():
            return False
        try:
            if (self.point_dir(overrides, idx, task.job_id) / CONFIG).exists():
                return False
        except Exception:  # (its folder cannot be named: reported as lost, as before)
            return False
        name = self.ident(list(overrides))["name"]
        log.warning("[%s] not started: the sweep was stopped (Slurm job %s cancelled)", name, task.job_id)
        return True

    def lost_point(self, task: Job[Any], overrides: Sequence[str], idx: int) -> JobReturn:
        """A point whose job Slurm ended without a result (cancelled, time limit, node failure, ...).

        Gives a failed JobReturn, and a summary.json saying so in its run folder unless it has one."""
        from runner.run_folder import SUMMARY, write_summary

        state = task.state
        said = "no longer listed by slurmctld" if state == PURGED else f"Slurm state {state}"
        reason = f"Slurm job {task.job_id} ended without a result ({said})"
        if task.paths.stdout.exists():
            reason += f"; its output: {task.paths.stdout}"
        try:
            run_dir = self.point_dir(overrides, idx, task.job_id)
            if not (run_dir / SUMMARY).exists():
                run_dir.mkdir(parents=True, exist_ok=True)
                fields = {"cause": said, "slurm_job": task.job_id, **self.ident(list(overrides))}
                write_summary(run_dir, "failed", error=reason, **fields)
        except Exception as err:  # the report then lacks the point; the terminal still names it
            log.warning("could not record the lost point %s: %s", task.job_id, err)
        return JobReturn(
            overrides=list(overrides), status=JobStatus.FAILED, _return_value=RuntimeError(reason)
        )

    def point_dir(self, overrides: Sequence[str], idx: int, job_id: str) -> Path:
        """Point ``idx``'s run folder (``hydra.sweep.dir``/``hydra.sweep.subdir``), as its job names it."""
        assert self.hydra_context is not None and self.config is not None
        cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(cfg.hydra.job):
            cfg.hydra.job.num, cfg.hydra.job.id = idx, job_id
        return Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
