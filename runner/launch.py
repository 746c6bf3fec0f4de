"""The launcher: validates a composed config, writes the run folder, starts one job and reports.

Hydra runs only here. Where and how the ranks run is the hardware group's (``runner.hardware``); ranks
read the resolved ``config.yaml`` this module writes; ``mpirun.txt`` holds the exact command line (mpirun
or srun); the job's combined output is streamed to the terminal and kept in ``mpirun.log``. Neither torch
nor MPI is imported here.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from runner.config import schema_paths, validate

log = logging.getLogger("runner")


class JobFailed(RuntimeError):
    """The mpirun job ended with a non-zero status; the message names the failing rank and cause."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def prepare(cfg: DictConfig, run_dir: Path) -> list[str]:
    """Validate ``cfg``, plan the job on its hardware, write the run folder and return the command.

    The run folder gets ``config.yaml`` (resolved, with the threads, binding and launcher the plan settled
    and ``_schemas_`` for :func:`runner.config.load`), ``plan.json`` (GPU placements, when planned) and
    ``mpirun.txt``. Raises ValueError naming the offending key; nothing has been started then.
    """
    checked = validate(cfg)
    launch = checked.hardware.plan_launch(checked.world_size, run_dir)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    resolved["hardware"].update(threads_per_rank=launch.threads, bind=launch.bind)
    if "launcher" in resolved["hardware"]:
        resolved["hardware"]["launcher"] = launch.launcher
    resolved["_schemas_"] = schema_paths(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(resolved))
    if launch.placements:
        (run_dir / "plan.json").write_text(json.dumps([asdict(p) for p in launch.placements], indent=1))
    (run_dir / "mpirun.txt").write_text(shlex.join(launch.argv) + "\n")
    return launch.argv


def _stream(proc: subprocess.Popen, sink: Path) -> None:
    """Copy the job's output to the terminal and to ``sink`` as it comes (progress bars included)."""
    with open(sink, "ab") as out:
        fd = proc.stdout.fileno()
        while chunk := os.read(fd, 65536):
            out.write(chunk)
            out.flush()
            sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()


def failure_report(run_dir: Path, status: int) -> str:
    """Which rank failed first, and why, from the ``logs/rank<r>.error`` files the workers left."""
    errors = sorted((run_dir / "logs").glob("rank*.error"), key=lambda p: p.stat().st_mtime)
    if not errors:
        return (
            f"the mpirun job exited with status {status} and no rank reported an exception "
            f"(killed, or failed to start); see {run_dir / 'mpirun.log'}"
        )
    first = errors[0]
    rank = first.name[len("rank") : -len(".error")]
    cause = first.read_text().splitlines()[0]
    others = [p.name[len("rank") : -len(".error")] for p in errors[1:]]
    also = f" (ranks {', '.join(others)} failed after it)" if others else ""
    return f"rank {rank} failed: {cause}{also}; traceback in {run_dir / 'logs' / f'rank{rank}.log'}"


def write_failure_summary(cfg: DictConfig, run_dir: Path, status: int, reason: str, wall: float) -> None:
    """summary.json for a failed job, with the validations that were recorded before the failure."""
    from runner.metrics import read_metrics

    vals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "val"]
    summary: dict[str, Any] = {
        "status": "failed",
        "exit_status": status,
        "error": reason,
        "rule": schema_paths(cfg)["rule"].split(".")[-2],
        "devices": cfg.devices,
        "wall_time_s": wall,
        "validations": vals,
    }
    if vals:
        summary.update(
            final_val_acc=vals[-1].get("val_acc"), best_val_acc=max(v.get("val_acc", 0) for v in vals)
        )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))


def _die_with_parent() -> None:
    """In the mpirun child: SIGTERM when the launcher dies, even by SIGKILL (Linux), so no job is orphaned."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _terminate(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def launch(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    """Run one training job; returns summary.json's content, or raises JobFailed (ValueError on bad input)."""
    argv = prepare(cfg, run_dir)
    log.info("run folder: %s", run_dir)
    log.info("starting: %s", shlex.join(argv))
    start = time.time()
    previous = signal.signal(signal.SIGTERM, _terminate)
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    try:
        _stream(proc, run_dir / "mpirun.log")
        status = proc.wait()
    except BaseException as err:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        reason = (
            "interrupted" if isinstance(err, (KeyboardInterrupt, SystemExit)) else f"launcher error: {err!r}"
        )
        write_failure_summary(cfg, run_dir, proc.returncode or 130, reason, time.time() - start)
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    wall = time.time() - start
    summary_path = run_dir / "summary.json"
    if status != 0 or not summary_path.exists():
        reason = failure_report(run_dir, status)
        write_failure_summary(cfg, run_dir, status, reason, wall)
        raise JobFailed(reason, status or 1)
    summary = json.loads(summary_path.read_text())
    summary.update(exit_status=0, wall_time_s=wall, run_dir=str(run_dir))
    summary_path.write_text(json.dumps(summary, indent=1))
    log.info(
        "done in %.1f s: final val_acc %.4f (best %.4f), %.0f samples/s, %.1f%% of step time in comm",
        wall,
        summary["final_val_acc"],
        summary["best_val_acc"],
        summary["samples_per_s"],
        100 * summary["comm_fraction"],
    )
    return summary
