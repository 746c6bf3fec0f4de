"""The launcher: validates a composed config, writes the run folder, starts one job and reports how it ended.

Hydra runs only here. Where and how the ranks run is the hardware group's (``runner.hardware``); ranks
read the resolved ``config.yaml`` this module writes; ``mpirun.txt`` holds the exact command line (mpirun
or srun); :mod:`runner.launcher.supervise` streams the job's output, handles signals and watches for stalls.
Neither torch nor MPI is imported here.

Exit status of ``python -m runner`` (a single run), and ``status`` in ``summary.json``:

====  ===========  ================================================================================
exit  status       meaning
====  ===========  ================================================================================
0     ok           the job trained to the end
1     failed       a rank failed (its exception, or the signal that killed it, is named), or the launcher
                   could not write the run folder
2     (none)       invalid input: a config that does not compose or does not pass the checks; nothing
                   was started (no summary.json)
3     diverged     a non-finite loss or gradient with ``train.on_nonfinite=stop``, or a validation loss
                   above ``train.diverge_at`` times the run's first
4     stalled      a rank made no progress for ``train.stall_timeout`` seconds; the stuck ranks are named
5     preempted    stopped by SIGTERM, SIGUSR1 or SIGINT after writing a checkpoint: resumable
130   interrupted  stopped by a signal without a final checkpoint (a second signal, or the ranks did not
                   stop within the grace period)
====  ===========  ================================================================================
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner import run_folder
from runner.folder_files import disk_fix, read_text
from runner.hardware.base import Launch
from runner.launcher.echo import faults_line
from runner.launcher.failures import Failure, failure_report, unexplained
from runner.launcher.supervise import Outcome, Supervisor
from runner.results import final_and_best
from runner.run_folder import (
    COMMAND,
    CONFIG,
    CONFIG_SHA_ENV,
    EXIT,
    GENERATION,
    IDENTITY,
    JOIN,
    LOGS,
    LOST,
    METRICS,
    PARTITIONED,
    PLAN,
    STOP,
    SUMMARY,
    parse_number,
    read_checkpoint_index,
    read_json,
    read_metrics,
)
from runner.schema import option_name, provenance
from runner.schema.config import Config, schema_paths, validate
from runner.schema.secrets import hidden

log = logging.getLogger("runner")


class JobEnded(RuntimeError):
    """The job did not end ``ok``: ``status`` (a key of :data:`EXIT`) and the message naming the cause."""

    def __init__(self, message: str, status: str):
        super().__init__(message)
        self.status, self.code = status, EXIT[status]

    def __reduce__(self) -> tuple:
        """Pickled whole (a sweep point run by submitit sends it back to the launcher).

        The default would call ``__init__`` with the message alone."""
        return _job_ended, (type(self), self.args[0], self.status)


def _job_ended(cls: type[JobEnded], message: str, status: str) -> JobEnded:
    err = cls.__new__(cls)
    JobEnded.__init__(err, message, status)
    return err


class RunFolderError(JobEnded):
    """The launcher could not write a file of the run folder (full disk, read-only folder): status failed."""

    def __init__(self, message: str):
        super().__init__(message, "failed")


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all.

    It writes a temporary file, then renames it: an earlier ``path`` stays intact when writing fails. Raises
    RunFolderError naming the file and the OS error."""
    try:
        run_folder.write_atomic(path, text)
    except OSError as err:
        raise RunFolderError(str(err.strerror)) from None


def _prepare(
    cfg: DictConfig,
    run_dir: Path,
    ident: dict[str, Any] | None = None,
    reserve: bool = False,
    share: int = 1,
) -> tuple[Launch, Config]:
    checked = validate(cfg)
    launch = checked.hardware.plan_launch(checked.launched, run_dir, reserve=reserve, share=share)
    try:
        _write_run_folder(cfg, run_dir, ident, launch, checked.data.absolute_paths())
    except BaseException:
        if launch.lease is not None:
            launch.lease.release()
        raise
    return launch, checked


def _write_run_folder(
    cfg: DictConfig, run_dir: Path, ident: dict[str, Any] | None, launch: Launch, paths: dict[str, str]
) -> None:
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["data"].update(paths)  # relative paths made absolute: the folder reads the same files anywhere
    resolved["hardware"].update(threads_per_rank=launch.threads, bind=launch.bind)
    if "launcher" in resolved["hardware"]:
        resolved["hardware"]["launcher"] = launch.launcher
    resolved["_schemas_"] = schema_paths(cfg)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(run_dir, int(cfg.hardware.folder_mode, 8))  # private to the user by default
        (run_dir / STOP).unlink(missing_ok=True)  # a previous job's stop request
        (run_dir / JOIN).unlink(missing_ok=True)  # and its join request
        (run_dir / LOGS / LOST).unlink(missing_ok=True)  # and the ranks it lost
        for claimed in (run_dir / LOGS).glob(f"{GENERATION}.*"):  # and its memberships
            claimed.unlink(missing_ok=True)
    except OSError as err:
        fix = disk_fix(err, run_dir, "hydra.run.dir")
        raise RunFolderError(
            f"cannot write the run folder {run_dir}: {err.strerror or err}" + (f"; {fix}" if fix else "")
        ) from None
    text = OmegaConf.to_yaml(hidden(resolved))  # hardware.env's values: secrets
    write_atomic(run_dir / CONFIG, text)
    if (own := provenance.mark(run_dir, text)) is not None:  # this user's folder (runner.schema.provenance)
        write_atomic(run_dir / provenance.MARK, own)
    launch.env[CONFIG_SHA_ENV] = hashlib.sha256(text.encode()).hexdigest()  # the ranks' config, vouched for
    if ident is not None:
        write_atomic(run_dir / IDENTITY, json.dumps(hidden(ident), indent=1))
    if launch.placements:
        write_atomic(run_dir / PLAN, json.dumps([asdict(p) for p in launch.placements], indent=1))
    write_atomic(run_dir / COMMAND, shlex.join(launch.argv) + "\n")


def prepare(cfg: DictConfig, run_dir: Path) -> list[str]:
    """Validate ``cfg``, plan the job on its hardware, write the run folder and return the command.

    The run folder gets ``config.yaml`` (resolved, with the threads, binding and launcher the plan settled
    and ``_schemas_`` for :func:`runner.schema.config.load`), ``plan.json`` (GPU placements, when planned) and
    ``mpirun.txt``. Raises ValueError naming the offending key (nothing has been started then), or
    RunFolderError when the folder cannot be written.
    """
    return _prepare(cfg, run_dir)[0].argv


def load_average() -> float | None:
    """The machine's 1-minute load average, or None where the OS keeps none."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def machine_load(start: float | None) -> dict[str, Any]:
    """summary.json's ``load``: the 1-minute load average at the job's ``start`` and now, at its end.

    It also has the machine's CPU count (the report flags wall times taken under different loads)."""
    return {"start": start, "end": load_average(), "cpus": os.cpu_count()}


def write_failure_summary(
    cfg: DictConfig,
    run_dir: Path,
    status: str,
    reason: str,
    wall: float,
    load_start: float | None = None,
    **fields: Any,
) -> None:
    """summary.json for a job that did not end ok (``status``: failed, diverged, stalled, interrupted).

    It holds the validations recorded before the job ended and the machine's load (``load_start``: at the
    job's start). Raises RunFolderError if it cannot be written."""
    try:
        vals = [r for r in read_metrics(run_dir / METRICS) if r.get("kind") == "val"]
    except OSError:
        vals = []
    numbers = [{k: v for k, v in r.items() if isinstance(v, (int, float))} for r in vals]
    ident = read_json(run_dir / IDENTITY)
    rule = option_name(OmegaConf.get_type(cfg.rule))
    given = {"error": reason, **fields, **ident, "rule": rule, "devices": cfg.devices, "wall_time_s": wall}
    given["load"] = machine_load(load_start)
    summary = run_folder.summary(status, **given, validations=vals, **final_and_best(numbers))
    write_atomic(run_dir / SUMMARY, run_folder.dumps(summary, indent=1))


def conclude(
    cfg: DictConfig, run_dir: Path, outcome: Outcome, wall: float, load_start: float | None = None
) -> dict[str, Any]:
    """Record how the job ended in summary.json; returns it when the job ended ok, else raises JobEnded.

    The summary is the ranks' own, completed, or one written here, with the machine's load since
    ``load_start``. RunFolderError is raised when summary.json cannot be written."""
    summary_path = run_dir / SUMMARY
    sent = {"signal": outcome.signal} if outcome.signal else {}
    job = read_json(summary_path) if outcome.returncode == 0 else grown_job(summary_path, outcome, wall)
    if outcome.stall is not None:
        status, reason = "stalled", outcome.stall.message
        fields: dict[str, Any] = {"stalled_ranks": outcome.stall.ranks, "cause": outcome.stall.message}
    elif outcome.lost is not None:
        status, reason = "failed", f"{outcome.lost.message}; {last_checkpoint(run_dir)}"
        fields = {"failed_rank": outcome.lost.ranks[0], "cause": outcome.lost.message}
    elif outcome.interrupted is not None:
        status, reason = (
            "interrupted",
            f"{outcome.interrupted}; {checkpoint_since(run_dir, outcome.stop_time)}",
        )
        fields = {"cause": outcome.interrupted}
    elif job.get("status") in ("ok", "preempted", "diverged"):
        return _complete(job, summary_path, run_dir, outcome, wall, load_start)
    else:
        failure = failure_report(run_dir, outcome.returncode, outcome.log_start, outcome.said)
        if failure.cause == unexplained(0) and outcome.returncode == 0:  # (ULFM: MPI_Abort exits 0)
            failure = stopped_partitioned(run_dir, wall) or Failure(
                "the job exited 0 but wrote no summary.json", None, "no summary.json"
            )
        status, reason = failure.status, failure.message
        fields = {"failed_rank": failure.rank, "cause": failure.cause, "mpirun_status": outcome.returncode}
        if outcome.signal and status == "failed":  # the stop signal reached mpirun too (Slurm sends it so)
            status = "interrupted"
            reason = (
                f"{outcome.signal} reached the job's own processes too (as Slurm's scancel and time limit "
                f"send it), which ended before its ranks could stop after a checkpoint: {reason}; "
                f"{checkpoint_since(run_dir, outcome.stop_time)}"
            )
    try:
        write_failure_summary(cfg, run_dir, status, reason, wall, load_start, **fields, **sent)
    except RunFolderError as err:
        raise RunFolderError(f"{err}; the job itself: {status}: {reason}") from None
    raise JobEnded(reason, status)


def grown_job(summary_path: Path, outcome: Outcome, wall: float) -> dict[str, Any]:
    """The ranks' summary.json of an ended job that spawned workers (:mod:`runner.rank.resilience.elastic`).

    mpirun exits non-zero for it whatever happened (MPI_Finalize is not called: with spawned processes it was
    seen to crash, so the ranks meet in a last barrier after every write and leave without it). Rank 0 writes
    its summary, during this job (the last ``wall`` seconds), only after every rank agreed the run ended; else
    nothing (a failed job)."""
    try:
        fresh = summary_path.stat().st_mtime >= time.time() - wall - 1
    except OSError:
        return {}
    job = read_json(summary_path) if fresh else {}
    if job.get("spawned") and job.get("status") in ("ok", "preempted") and not outcome.said:
        log.debug("mpirun exited %d after the end of a job that spawned workers", outcome.returncode)
        return job
    return {}


def partitioned(run_dir: Path, since: float) -> dict[int, str]:
    """The ranks that stopped on the minority side of a partition during this job (since ``since``).

    Each comes with its reason (``logs/rank<r>.partitioned``, :mod:`runner.rank.fence`)."""
    found = {}
    for path in sorted((run_dir / LOGS).glob(f"rank*.{PARTITIONED}")):
        rank = parse_number(path.name[4 : -len(PARTITIONED) - 1])
        try:
            if rank is not None and path.lstat().st_mtime >= since:
                found[rank] = read_text(path, errors="replace").strip()
        except OSError:
            continue
    return dict(sorted(found.items()))


def stopped_partitioned(run_dir: Path, wall: float) -> Failure | None:
    """Why a job that wrote no summary.json ended, when its ranks stopped as the minority side of a partition.

    They stopped during the job (the last ``wall`` seconds) and no side went on; the reason is the first
    one's."""
    cut = partitioned(run_dir, time.time() - wall - 1)
    if not cut:
        return None
    rank, why = next(iter(cut.items()))
    where = run_dir / LOGS / f"rank{rank}.{PARTITIONED}"
    return Failure(f"rank {rank} stopped: {why} (no side went on; see {where})", rank, why)


def newest_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The run's newest checkpoint entry, or None (no index, an empty or a damaged one: nothing to name)."""
    try:
        return read_checkpoint_index(run_dir)[-1]
    except Exception:
        return None


def last_checkpoint(run_dir: Path) -> str:
    """What a failed job left to resume from: its newest checkpoint, or none."""
    latest = newest_checkpoint(run_dir)
    if latest is None:
        return "it wrote no checkpoint"
    return f"its last checkpoint is {latest['dir']}: continue from it with resume={run_dir}"


def checkpoint_since(run_dir: Path, since: float | None) -> str:
    """What an interrupted job left to resume from.

    The checkpoint written after its first stop signal (at ``since``), or that it ended without one."""
    latest = newest_checkpoint(run_dir) if since is not None else None
    if latest is None or latest.get("time", 0.0) < since:
        return "ended without a final checkpoint"
    return (
        f"its checkpoint {latest['dir']} was written after the stop request: continue with resume={run_dir}"
    )


def _complete(
    job: dict[str, Any], path: Path, run_dir: Path, outcome: Outcome, wall: float, load_start: float | None
) -> dict[str, Any]:
    """The ranks' summary.json with the launcher's fields added; JobEnded unless its status is ok."""
    status = job.pop("status")
    job.pop("exit_status", None)
    signal = {"signal": outcome.signal} if outcome.signal else {}
    added = {"wall_time_s": wall, "load": machine_load(load_start), "run_dir": str(run_dir), **signal}
    if cut := partitioned(run_dir, time.time() - wall - 1):
        added["partitioned"] = cut
        names = ", ".join(f"rank {r}" for r in cut)
        log.warning(
            "%s stopped on the minority side of a partition (%s): this run folder holds the other side's "
            "history alone",
            names,
            run_dir / LOGS / f"rank{next(iter(cut))}.{PARTITIONED}",
        )
    job = run_folder.summary(status, **{**job, **added})
    try:
        write_atomic(path, run_folder.dumps(job, indent=1))
    except RunFolderError as err:
        raise RunFolderError(f"{err}; the job itself ended {status}") from None
    if status == "preempted":
        raise JobEnded(
            f"by {outcome.signal or 'a stop request'}: checkpoint {job.get('checkpoint')} written after "
            f"step {job.get('steps')}; continue with: python -m runner resume={run_dir}",
            "preempted",
        )
    if status == "diverged":
        raise JobEnded(str(job.get("error", "a non-finite loss or gradient")), "diverged")
    return job


def launch(
    cfg: DictConfig,
    run_dir: Path,
    ident: dict[str, Any] | None = None,
    label: str | None = None,
    share: int = 1,
) -> dict[str, Any]:
    """Run one training job; returns summary.json's content if it ended ok, else raises JobEnded.

    ValueError on bad input, before anything starts. ``ident`` (:func:`runner.schema.identity.identity`)
    goes to run.json and the summary; ``label`` prefixes its terminal lines (a sweep's points); ``share``:
    the jobs running at once on this machine, sharing its cores."""
    planned, checked = _prepare(cfg, run_dir, ident, reserve=True, share=share)
    argv = planned.argv
    tag = f"[{label}] " if label else ""  # points of a sweep that run at once: whose line is it
    log.info("%srun folder: %s", tag, run_dir.absolute())  # (a resumed point's may be given relative)
    if planned.warning:
        log.warning("%s%s", tag, planned.warning)
    log.debug("starting: %s", shlex.join(argv))  # also in mpirun.txt; shown with hydra.verbose=runner
    start, load_start = time.time(), load_average()
    supervisor = Supervisor(
        argv,
        run_dir,
        checked.launched,
        checked.train.stall_timeout,
        label,
        env=planned.env,
        servers=range(checked.devices, checked.world_size),  # the last ranks serve (rules.base.split_roles)
    )
    try:
        outcome = supervisor.run()
    except BaseException as err:
        reason = f"launcher error: {err!r}"
        try:
            write_failure_summary(cfg, run_dir, "failed", reason, time.time() - start, load_start)
        except RunFolderError:
            pass
        raise
    finally:
        if planned.lease is not None:
            planned.lease.release()
        try:  # a join request the job did not take: not for the next job on this folder
            (run_dir / JOIN).unlink(missing_ok=True)
        except OSError:
            pass
    summary = conclude(cfg, run_dir, outcome, time.time() - start, load_start)
    monitor = summary.get("monitor", "val_acc")
    log.info(
        "%sdone in %.1f s: final %s %.4f (best %.4f), %.0f samples/s, %.1f%% of step time in comm",
        tag,
        summary["wall_time_s"],
        monitor,
        summary.get(f"final_{monitor}") or 0.0,
        summary.get(f"best_{monitor}") or 0.0,
        summary.get("samples_per_s") or 0.0,
        100 * (summary.get("comm_fraction") or 0.0),
    )
    if (faults := faults_line(summary)) is not None:
        log.info("%s%s", tag, faults)
    return summary
