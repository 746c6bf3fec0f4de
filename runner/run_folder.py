"""The run folder's contract: what the launcher, the ranks, ``eval=`` and the report read and write there.

Every file name of a run folder, the environment the launcher passes to the ranks, the exit statuses, and
strict JSON (no NaN) written whole or not at all are declared here and nowhere else; ``summary.json`` is
built by :func:`summary`. This module imports neither torch nor MPI, so every side may use it.

A run folder (``outputs/DATE/TIME``, or a sweep's ``outputs/multirun/DATE/TIME/N``)::

    config.yaml        the resolved config the ranks read (with ``_schemas_``)    launcher
    run.json           the run's overrides and the keys its sweep varied          launcher
    mpirun.txt         the exact command line; plan.json the GPU placements       launcher
    mpirun.log         mpirun's own output (every rank's lines, as they came)     launcher
    STOP               a request to checkpoint and stop, read at the next step    user / launcher
    job.lock           held (flock) by the launcher of the job running there       launcher
    summary.json       how the run ended: status, exit status, metrics, cause     rank 0, then launcher
    metrics.jsonl      one record per line (step, epoch, val, failure, final)    rank 0
    tb/                TensorBoard event files                                    rank 0
    checkpoints/       checkpoint.json (the index) and one folder per checkpoint  every rank
    model.pt           the model the run reports; model.rank<r>.pt per rank       rank 0 / every rank
    bindings.json      the cores and device each rank was bound to                rank 0
    logs/              rank<r>.log, rank<r>.error, rank<r>.beat, lost.json        every rank
    eval.json          the metrics of ``eval=RUN_DIR``                            eval
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

CONFIG = "config.yaml"
IDENTITY = "run.json"
COMMAND = "mpirun.txt"
PLAN = "plan.json"
MPIRUN_LOG = "mpirun.log"
STOP = "STOP"
LOCK = "job.lock"
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
TENSORBOARD = "tb"
CHECKPOINTS = "checkpoints"
CHECKPOINT_INDEX = "checkpoint.json"
MODEL = "model.pt"
BINDINGS = "bindings.json"
LOGS = "logs"
LOST = "lost.json"
EVAL = "eval.json"
#: Hydra's records of the run (overrides.yaml, hydra.yaml); a sweep folder has multirun.yaml.
HYDRA_DIR = ".hydra"
HYDRA_OVERRIDES = "overrides.yaml"
HYDRA_CONFIG = "hydra.yaml"
SWEEP_CONFIG = "multirun.yaml"

#: Set by the launcher for every rank: ``1`` when the launcher's output is a terminal, ``0`` when not (the
#: ranks' own pseudo-terminals under mpirun are 0x0); a launcher started with it set to ``0`` gives ``0``:
#: concurrent sweep points must not draw over each other.
TTY_ENV = "MPITRAIN_TTY"
#: Starts a line of rank 0's progress for the launcher's bar (given ``MPITRAIN_TTY=1``), JSON after it:
#: ``{"n": step, "total": steps, "text": "epoch 0, loss ...", "final": false}``; the launcher draws the bar
#: from these lines (:mod:`runner.launcher.progress`) and keeps them out of the terminal and ``mpirun.log``.
PROGRESS_RECORD = "@mpitrain:progress "

#: status -> exit status of ``python -m runner`` ("invalid" has no summary: nothing was started). The table
#: with each status's meaning is in :mod:`runner.launcher.launch`.
EXIT = {"ok": 0, "failed": 1, "invalid": 2, "diverged": 3, "stalled": 4, "preempted": 5, "interrupted": 130}


def rank_file_name(rank: int, kind: str) -> str:
    """``rank<r>.<kind>`` in ``logs/``: a rank's ``log`` (its output), ``error`` (its failure), ``beat``."""
    assert kind in ("log", "error", "beat"), kind
    return f"rank{rank}.{kind}"


def rank_file(run_dir: Path, rank: int, kind: str) -> Path:
    """``logs/rank<r>.<kind>`` of ``run_dir`` (:func:`rank_file_name`)."""
    return run_dir / LOGS / rank_file_name(rank, kind)


def rank_model(run_dir: Path, rank: int) -> Path:
    """``model.rank<r>.pt``: rank ``rank``'s own model (``train.save_model=all``)."""
    return run_dir / f"model.rank{rank}.pt"


def checkpoint_part(run_dir: Path, folder: str, rank: int) -> Path:
    """Rank ``rank``'s part of the checkpoint in ``checkpoints/<folder>``."""
    return run_dir / CHECKPOINTS / folder / f"rank{rank}.pt"


def read_checkpoint_index(run_dir: Path) -> list[dict[str, Any]]:
    """The checkpoints recorded in ``checkpoints/checkpoint.json``, oldest first ([] when there is none)."""
    path = run_dir / CHECKPOINTS / CHECKPOINT_INDEX
    if not path.exists():
        return []
    return json.loads(path.read_text())["checkpoints"]


def strict(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None, so ``json.dumps`` writes strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def dumps(obj: Any, **kwargs: Any) -> str:
    """Strict JSON (NaN and infinities become null)."""
    return json.dumps(strict(obj), allow_nan=False, **kwargs)


def write_atomic(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, then a rename, so an earlier
    ``path`` stays intact when writing fails. The OSError raised names the file."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as err:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise OSError(err.errno, f"cannot write {path}: {err.strerror or err}") from None


def read_json(path: Path) -> dict[str, Any]:
    """A run-folder JSON object (summary.json, run.json), or {} when it is missing, torn or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (a torn last line, from a killed job, is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def summary(status: str, **fields: Any) -> dict[str, Any]:
    """``summary.json``'s content: the status and its exit status first, then ``fields`` (strict JSON)."""
    assert status in EXIT and status != "invalid", status
    return strict({"status": status, "exit_status": EXIT[status], **fields})


def write_summary(run_dir: Path, status: str, **fields: Any) -> dict[str, Any]:
    """Write ``summary.json`` (:func:`summary`) atomically; returns it. Raises the OSError."""
    content = summary(status, **fields)
    write_atomic(run_dir / SUMMARY, dumps(content, indent=1))
    return content
