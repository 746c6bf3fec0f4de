"""The run folder's contract: what the launcher, the ranks, ``eval=`` and the report read and write there.

Every file name of a run folder, the environment the launcher passes to the ranks, the exit statuses, and
strict JSON (no NaN) written whole or not at all are declared here and nowhere else; ``summary.json`` is
built by :func:`summary`. Its files are opened as what they are, regular files of the folder, never through
a link (:mod:`runner.folder_files`; :func:`foreign_files` lists what is not); the numbers in its names and
files have one parser, :func:`parse_number`. This module imports neither torch nor MPI, so every side may
use it.

A run folder (``outputs/DATE/TIME``, or a sweep's ``outputs/multirun/DATE/TIME/N``)::

    config.yaml        the resolved config the ranks read (with ``_schemas_``)    launcher
    run.json           the run's overrides and the keys its sweep varied          launcher
    mpirun.txt         the exact command line; plan.json the GPU placements       launcher
    mpirun.log         mpirun's own output (every rank's lines, as they came)     launcher
    STOP               a request to checkpoint and stop, read at the next step    user / launcher
    JOIN               a request to add N workers (its text: N), read likewise   user
    job.lock           held (flock) by the launcher of the job running there       launcher
    summary.json       how the run ended: status, exit status, metrics, cause     rank 0, then launcher
    metrics.jsonl      one record per line (step, epoch, val, failure, final)    rank 0
    tb/                TensorBoard events, in tb/<run name>/ (logger=tensorboard)  rank 0
    checkpoints/       checkpoint.json (the index) and one folder per checkpoint  every rank
    model.pt           the model the run reports; model.rank<r>.pt per rank       rank 0 / every rank
    bindings.json      the cores and device each rank was bound to                rank 0
    logs/              rank<r>.log, rank<r>.error, rank<r>.beat, lost.json        every rank
                       generation.<g>, rank<r>.partitioned (a partition)
                       (a worker spawned into the job: the next unused r)
    eval.json          the metrics of ``eval=RUN_DIR``                            eval
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import stat
from pathlib import Path
from typing import Any

from runner.folder_files import create_new, describe, disk_fix, open_in_folder, read_text

CONFIG = "config.yaml"
IDENTITY = "run.json"
COMMAND = "mpirun.txt"
PLAN = "plan.json"
MPIRUN_LOG = "mpirun.log"
STOP = "STOP"
JOIN = "JOIN"
LOCK = "job.lock"
PROVENANCE = "provenance"  # the mark of a folder this user's runner wrote (runner.schema.provenance)
SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
TENSORBOARD = "tb"
CHECKPOINTS = "checkpoints"
CHECKPOINT_INDEX = "checkpoint.json"
MODEL = "model.pt"
BINDINGS = "bindings.json"
LOGS = "logs"
LOST = "lost.json"
#: ``logs/generation.<g>``: membership generation g claimed the run folder (:mod:`runner.rank.fence`).
GENERATION = "generation"
#: ``logs/rank<r>.partitioned``: rank r stopped on the minority side of a partition (its reason).
PARTITIONED = "partitioned"
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
#: Set by the launcher for every rank: the SHA-256 of the ``config.yaml`` it wrote for this job, which it
#: vouches for (the user's own command line, or a run folder's config it checked for ``resume=``): a rank
#: whose file has that hash does not check again what it names (:func:`runner.schema.config.load`).
CONFIG_SHA_ENV = "MPITRAIN_CONFIG_SHA256"
#: Set in the ranks' environment when mpirun was told ``--oversubscribe`` (the job's hosts, comma-separated,
#: or "1" on one machine): Open MPI does not pass that on to ``MPI_Comm_spawn``, whose workers must then be
#: mapped with the same leave (heal, growth), on hosts mpirun knows by these names.
OVERSUBSCRIBED_ENV = "MPITRAIN_OVERSUBSCRIBED"
#: Starts a line of rank 0's progress for the launcher's bar (given ``MPITRAIN_TTY=1``), JSON after it:
#: ``{"n": step, "total": steps, "text": "epoch 0, loss ...", "final": false}``; the launcher draws the bar
#: from these lines (:mod:`runner.launcher.progress`) and keeps them out of the terminal and ``mpirun.log``.
PROGRESS_RECORD = "@mpitrain:progress "

#: status -> exit status of ``python -m runner`` ("invalid" has no summary: nothing was started). The table
#: with each status's meaning is in :mod:`runner.launcher.launch`.
EXIT = {"ok": 0, "failed": 1, "invalid": 2, "diverged": 3, "stalled": 4, "preempted": 5, "interrupted": 130}


#: The most digits of a number in a run folder's file names and files (a rank, a checkpoint's seq and step, a
#: membership generation, JOIN's count): more is no number the runner wrote.
MOST_DIGITS = 9
_NUMBER = re.compile(f"[0-9]{{1,{MOST_DIGITS}}}")


def parse_number(text: str) -> int | None:
    """``text`` as a whole number when it is 1 to :data:`MOST_DIGITS` ASCII digits, else None.

    The one parser of the numbers in a run folder's names and files: ``str.isdigit`` takes ``²`` and other
    scripts' digits, which ``int`` refuses or reads as other numbers."""
    return int(text) if _NUMBER.fullmatch(text) else None


#: ``logs/rank<r>.stacks``; the signal that has a rank write them (:mod:`faulthandler`, any thread, in C).
STACKS = "stacks"
STACKS_SIGNAL = signal.SIGUSR2


def rank_file_name(rank: int, kind: str) -> str:
    """The name ``rank<r>.<kind>`` of a rank's file in ``logs/``.

    ``kind``: ``log`` (its output), ``error`` (its failure), ``beat``, ``partitioned`` (it stopped on the
    minority side of a partition), ``stacks`` (its threads' Python stacks, written when the launcher found the
    job stalled)."""
    assert kind in ("log", "error", "beat", PARTITIONED, STACKS), kind
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
    """The checkpoints recorded in ``checkpoints/checkpoint.json``, oldest first ([] when there is none).

    Raises :class:`DamagedIndex` (a ValueError naming the file) when it is not JSON or not an index of
    checkpoints (:func:`rebuild_checkpoint_index` makes it again from the checkpoint folders)."""
    path = run_dir / CHECKPOINTS / CHECKPOINT_INDEX
    try:
        data = json.loads(read_text(path))
    except FileNotFoundError:
        return []
    except ValueError as err:  # not JSON, or not even text
        raise DamagedIndex(path, f"not JSON: {err}") from None
    problem = index_problem(data)
    if problem is not None:
        raise DamagedIndex(path, problem)
    return data["checkpoints"]


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
    """Write ``path`` whole or not at all: a temporary file beside it, then a rename.

    So an earlier ``path`` stays intact when writing fails. The OSError raised names the file (and the fix,
    for a full disk). The temporary file is made anew (a link in its place is removed, not written through);
    the rename replaces a link at ``path`` rather than writing where it points."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with create_new(tmp) as file:
            file.write(text)
        os.replace(tmp, path)
    except OSError as err:
        try:
            if not tmp.is_dir():
                tmp.unlink(missing_ok=True)
        except OSError:
            pass
        raise OSError(err.errno, f"cannot write {path}: {write_error(err, path.parent)}") from None


def write_error(err: OSError, folder: Path) -> str:
    """Why a file could not be written in ``folder``, and the fix where it is the disk's fault.

    The reason is ``err``'s; the disk's fault: full, over quota, read-only; the fix is
    :func:`runner.folder_files.disk_fix`'s."""
    fix = disk_fix(err, folder)
    return f"{err.strerror or err}" + (f"; {fix}" if fix else "")


def read_json(path: Path) -> dict[str, Any]:
    """A run-folder JSON object (summary.json, run.json), or {} when it is missing, torn or not an object."""
    try:
        data = json.loads(read_text(path))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics.jsonl (a torn last line, from a killed job, is skipped)."""
    try:
        text = read_text(path)
    except FileNotFoundError:
        return []
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def foreign_files(run_dir: Path) -> list[str]:
    """What in ``run_dir`` is not its own, each as ``PATH is a symbolic link (to X)``.

    Every link and special file among its entries and those of its folders (``logs/``, ``checkpoints/`` and
    the checkpoints in it, ``tb/``, ``.hydra/``). The run folder itself may be a link (a user's choice of
    where it is)."""
    found: list[str] = []

    def look(folder: Path, depth: int) -> None:
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:  # none, or unreadable: the lock's own open names that
            return
        for entry in entries:
            path = Path(entry.path)
            try:
                mode = entry.stat(follow_symlinks=False).st_mode
            except OSError:  # removed meanwhile
                continue
            if stat.S_ISDIR(mode):
                if depth and (folder != run_dir or entry.name in (LOGS, CHECKPOINTS, TENSORBOARD, HYDRA_DIR)):
                    look(path, depth - 1)
            elif not stat.S_ISREG(mode):
                found.append(f"{path} is {describe(path, mode)}")

    look(run_dir, 2)
    return found


def summary(status: str, **fields: Any) -> dict[str, Any]:
    """``summary.json``'s content: the status and its exit status first, then ``fields`` (strict JSON)."""
    assert status in EXIT and status != "invalid", status
    return strict({"status": status, "exit_status": EXIT[status], **fields})


def write_summary(run_dir: Path, status: str, **fields: Any) -> dict[str, Any]:
    """Write ``summary.json`` (:func:`summary`) atomically; returns it. Raises the OSError."""
    content = summary(status, **fields)
    write_atomic(run_dir / SUMMARY, dumps(content, indent=1))
    return content


# -- checkpoints: checked when read, the index rebuilt from the folders ----------------------------------

#: In every checkpoint folder, written by rank 0 once every part is: the checkpoint's index entry, with each
#: part's size and CRC-32 (``parts``), from which a damaged ``checkpoint.json`` is rebuilt exactly.
CHECKPOINT_ENTRY = "entry.json"
#: A damaged checkpoint that ``resume=`` passed over is renamed ``<folder>.damaged`` (kept, never read).
DAMAGED_SUFFIX = ".damaged"
#: Bytes read at a time to checksum a file.
CHUNK = 1 << 22


class DamagedIndex(ValueError):
    """``checkpoint.json`` cannot be read as an index of checkpoints: ``path`` and ``problem`` say why."""

    def __init__(self, path: Path, problem: str):
        super().__init__(f"{path} is damaged ({problem})")
        self.path, self.problem = path, problem


def checkpoint_folder(seq: int, step: int) -> str:
    """The name of the ``seq``-th checkpoint's folder, taken after ``step`` steps: ``00003-step120``."""
    return f"{seq:05d}-step{step}"


def _count(value: Any) -> bool:
    """Whether ``value`` is a whole number, 0 or more (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def entry_problem(entry: Any) -> str | None:
    """What makes ``entry`` no index entry (None when it is one).

    An entry has ``dir``, ``seq``, ``step``, ``world_size`` that agree with each other, and ``parts`` (absent
    in checkpoints written before parts were checksummed) one ``{"bytes", "crc32"}`` per rank."""
    if not isinstance(entry, dict):
        return f"an entry is {type(entry).__name__}, not an object"
    if not all(_count(entry.get(k)) for k in ("seq", "step", "world_size")) or entry["world_size"] < 1:
        return f"entry {entry.get('dir')!r} lacks a count among seq, step, world_size"
    if entry.get("dir") != checkpoint_folder(entry["seq"], entry["step"]):
        return f"entry {entry.get('dir')!r} is not the folder of seq {entry['seq']}, step {entry['step']}"
    parts = entry.get("parts")
    if parts is not None and not (
        isinstance(parts, list)
        and len(parts) == entry["world_size"]
        and all(isinstance(p, dict) and _count(p.get("bytes")) and _count(p.get("crc32")) for p in parts)
    ):
        return f"entry {entry['dir']!r} does not record one size and checksum per rank"
    return None


def index_problem(data: Any) -> str | None:
    """What makes ``data`` (a parsed ``checkpoint.json``) no index (None when it is one).

    An index is an object with ``checkpoints``, a list of entries (:func:`entry_problem`) in increasing
    ``seq``."""
    if not isinstance(data, dict) or not isinstance(data.get("checkpoints"), list):
        return 'not an object with a list "checkpoints"'
    entries = data["checkpoints"]
    for entry in entries:
        problem = entry_problem(entry)
        if problem is not None:
            return problem
    seqs = [e["seq"] for e in entries]
    if seqs != sorted(set(seqs)):
        return f"its checkpoints are not in order: seq {seqs}"
    return None


def file_digest(path: Path) -> dict[str, int]:
    """``{"bytes": size, "crc32": CRC-32}`` of the file at ``path``, read in chunks. Raises the OSError."""
    import zlib

    crc, size = 0, 0
    with open_in_folder(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc, size = zlib.crc32(chunk, crc), size + len(chunk)
    return {"bytes": size, "crc32": crc}


def part_damage(path: Path, record: dict[str, int] | None) -> str | None:
    """What is wrong with a checkpoint part or a saved model (None when it is intact), checked without torch.

    Its size and CRC-32 against ``record`` (written with it), or, with no record (a file saved before parts
    were checksummed, or ``model.pt``), whether it ends as a whole ``torch.save`` file (a zip) does."""
    import zipfile

    try:
        with open_in_folder(path, "rb") as file:  # (a link in its place is refused, not followed)
            size = os.fstat(file.fileno()).st_size
            if record is None:
                try:
                    zipfile.ZipFile(file).close()
                except zipfile.BadZipFile:
                    return f"not a whole torch.save file: truncated or overwritten, {size} bytes"
                return None
        written = record["bytes"]
        if size != written:
            return f"{'truncated' if size < written else 'wrong size'}: {size} of {written} bytes"
        crc = file_digest(path)["crc32"]
    except FileNotFoundError:
        return "missing"
    except OSError as err:
        return f"unreadable: {err.strerror or err}"
    if crc != record["crc32"]:
        return f"checksum mismatch: CRC-32 {crc:08x}, written {record['crc32']:08x}"
    return None


def checkpoint_damage(run_dir: Path, entry: dict[str, Any]) -> tuple[Path, str] | None:
    """The first damaged part of the checkpoint ``entry`` (an index entry) and what is wrong with it.

    What is wrong: :func:`part_damage`'s answer; None when every part is intact."""
    parts = entry.get("parts")
    for rank in range(entry["world_size"]):
        path = checkpoint_part(run_dir, entry["dir"], rank)
        problem = part_damage(path, parts[rank] if parts else None)
        if problem is not None:
            return path, problem
    return None


def _folder_entry(folder: Path) -> tuple[dict[str, Any] | None, str | None]:
    """The index entry that a checkpoint folder's ``entry.json`` keeps, or None and why not."""
    try:
        entry = json.loads(read_text(folder / CHECKPOINT_ENTRY))
    except FileNotFoundError:
        return None, f"no {CHECKPOINT_ENTRY} (written before checkpoints kept their entry)"
    except (OSError, ValueError) as err:
        return None, f"{CHECKPOINT_ENTRY} unreadable: {err}"
    problem = entry_problem(entry)
    if problem is None and entry["dir"] != folder.name:
        problem = f"{CHECKPOINT_ENTRY} names {entry['dir']!r}"
    return (None, problem) if problem else (entry, None)


def rebuild_checkpoint_index(run_dir: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The index entries kept in the checkpoint folders, oldest first, and a note per folder left out.

    Each folder keeps its entry in ``entry.json`` (:data:`CHECKPOINT_ENTRY`); a note reads
    ``"00001-step20: no entry.json ..."``.

    A folder has its ``entry.json`` only once all its parts are written, so every entry is a complete
    checkpoint. The entries are the newest one written and those before it in ``seq``: the folders of an
    attempt that a resumed run went back from (a checkpoint never indexed) are left out."""
    root = run_dir / CHECKPOINTS
    found, skipped = [], []
    for folder in sorted(root.iterdir()) if root.is_dir() else []:
        seq, _, step = folder.name.partition("-step")
        if parse_number(seq) is None or parse_number(step) is None:
            continue  # the index itself, temporary files, checkpoints set aside as damaged
        if folder.is_symlink():
            skipped.append(f"{folder.name}: a symbolic link, not a checkpoint of the run's own")
            continue
        if not folder.is_dir():
            continue
        entry, why = _folder_entry(folder)
        if entry is None:
            skipped.append(f"{folder.name}: {why}")
        else:
            found.append(entry)
    chain: list[dict[str, Any]] = []
    for entry in sorted(found, key=lambda e: (_written(e), e["seq"]), reverse=True):
        if chain and entry["seq"] >= chain[-1]["seq"]:
            skipped.append(f"{entry['dir']}: left by an attempt that {chain[0]['dir']} replaced")
        else:
            chain.append(entry)
    return chain[::-1], skipped


def _written(entry: dict[str, Any]) -> float:
    """When rank 0 indexed the checkpoint ``entry`` (0 when it does not say)."""
    when = entry.get("time")
    return float(when) if isinstance(when, (int, float)) else 0.0
