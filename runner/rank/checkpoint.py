"""Checkpoints of a whole job (the workers' agreement on when to take one: :mod:`runner.rank.agreement`).

Layout of a run folder::

    checkpoints/00003-step120/rank0.pt ... rank<N-1>.pt  the 3rd checkpoint, after step 120: one file per
                                                         rank (workers and servers)
    checkpoints/00003-step120/entry.json                 its index entry, with each part's size and CRC-32
    checkpoints/checkpoint.json                          the index: complete checkpoints, newest last
    STOP                                                 the launcher's request to checkpoint and stop

Every rank writes its own part (``torch.save`` to a temporary file, then ``os.replace``), counting its size
and CRC-32 as it writes; all ranks then gather those, and only then rank 0 writes the checkpoint's
``entry.json`` and adds it to the index (both replaced atomically), and removes the oldest beyond
``checkpoint.keep``. So the index only ever names complete checkpoints, the previous one stays until the
new one is complete, and a damaged index is rebuilt exactly from the folders' ``entry.json``
(:func:`~runner.run_folder.rebuild_checkpoint_index`). Every part is checked against its size and CRC-32
when read (:func:`load_checked`; the launcher checks them too, without torch, to choose the checkpoint to
resume from). A part holds only tensors, numbers, strings, lists and dicts, so
``torch.load(..., weights_only=True)`` reads it. torch and numpy are imported where used.
"""

from __future__ import annotations

import os
import pickle
import random
import shutil
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

from runner.folder_files import create_new, make_folder, open_in_folder
from runner.lazy import lazy_import
from runner.rank.fence import Fence, Partitioned
from runner.rank.state import Owner
from runner.run_folder import (
    CHECKPOINT_ENTRY,
    CHECKPOINT_INDEX,
    CHECKPOINTS,
    DAMAGED_SUFFIX,
    DamagedIndex,
    checkpoint_folder,
    checkpoint_part,
    dumps,
    part_damage,
    read_checkpoint_index,
    rebuild_checkpoint_index,
    write_atomic,
    write_error,
)

if TYPE_CHECKING:
    import numpy as np
    import torch

    from runner.comm import Comm
    from runner.schema.sections import CheckpointConfig
else:
    np, torch = lazy_import("numpy"), lazy_import("torch")


def rng_state() -> dict[str, Any]:
    """Every random generator a rank uses: torch (CPU and CUDA), numpy and Python's."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": pos,
            "has_gauss": has_gauss,
            "gauss": gauss,
        },
        "python": list(random.getstate()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
    )
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class _Digesting:
    """A binary file to write to that counts the bytes written and their CRC-32.

    ``torch.save`` only appends to a file object: it calls ``write`` and ``flush`` alone."""

    def __init__(self, f: Any):
        self.f, self.size, self.crc = f, 0, 0
        self.error: OSError | None = None  # a failed write, which torch reports without its cause

    def write(self, data: Any) -> int:
        view = memoryview(data)
        self.size, self.crc = self.size + view.nbytes, zlib.crc32(view, self.crc)
        try:
            return self.f.write(data)
        except OSError as err:
            self.error = err
            raise

    def flush(self) -> None:
        self.f.flush()


def save_atomic(obj: Any, path: Path) -> dict[str, int]:
    """``torch.save`` to ``path`` through a temporary file, so ``path`` is either absent or complete.

    Returns its size and CRC-32 (``{"bytes", "crc32"}``, as :func:`~runner.run_folder.file_digest`). The
    temporary file is made anew (:func:`~runner.folder_files.create_new`: never written through a link)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with create_new(tmp, binary=True) as f:
            out = _Digesting(f)
            try:
                torch.save(obj, out)
            except RuntimeError:  # torch reports a failed write without its cause ("unexpected pos")
                if out.error is not None:
                    raise out.error from None
                raise
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return {"bytes": out.size, "crc32": out.crc}
    except OSError as err:
        _remove(tmp)
        raise OSError(err.errno, f"cannot write {path}: {write_error(err, path.parent)}") from None
    except BaseException:
        _remove(tmp)
        raise


def _remove(tmp: Path) -> None:
    """Remove a temporary file that was not completed (not a folder in its place)."""
    try:
        if not tmp.is_dir():
            tmp.unlink(missing_ok=True)
    except OSError:
        pass


def latest_checkpoint(run_dir: Path, world_size: int) -> dict[str, Any] | None:
    """The newest complete checkpoint of ``run_dir``, checked against this job's number of ranks."""
    try:
        entries = read_checkpoint_index(run_dir)
    except DamagedIndex as err:  # damaged since the launcher checked it
        raise ValueError(f"{err}: resume= again rebuilds it from the checkpoint folders") from None
    if not entries:
        return None
    entry = entries[-1]
    if entry["world_size"] != world_size:
        raise ValueError(
            f"{run_dir}: its checkpoint {entry['dir']} was written by {entry['world_size']} ranks, this job "
            f"has {world_size}; resume with the run's own devices and rule"
        )
    return entry


def load_checked(
    path: Path,
    record: dict[str, int] | None,
    fix: str,
    map_location: Any = "cpu",
    whole_fix: str | None = None,
) -> Any:
    """``torch.load(path, weights_only=True)`` of a checkpoint part or saved model, checked first.

    The file is checked against its size and CRC-32 (``record``; None: whether it is a whole file). Raises
    ValueError naming the file, what is wrong with it, and ``fix``: one line, not torch's traceback;
    ``whole_fix`` instead where the file is as it was written (its size and CRC-32 match ``record``) and
    torch still refuses it."""
    problem = part_damage(path, record)
    if problem is None:
        try:
            with open_in_folder(path, "rb") as file:  # (not through a link put there since)
                return torch.load(file, map_location=map_location, weights_only=True)
        except (RuntimeError, EOFError, OSError, ValueError, KeyError, pickle.UnpicklingError) as err:
            reason = str(err).strip().splitlines()[0].split(". ")[0] if str(err).strip() else ""
            problem = f"torch.load cannot read it: {type(err).__name__}{': ' + reason if reason else ''}"
            if record is not None and whole_fix is not None:
                fix = whole_fix
    raise ValueError(f"{path} is damaged ({problem}): {fix}")


def load_part(run_dir: Path, entry: dict[str, Any], rank: int) -> dict[str, Any]:
    """This rank's part of the checkpoint ``entry`` (an item of ``read_checkpoint_index``).

    It is checked against the size and CRC-32 written with it (when the entry records them)."""
    parts = entry.get("parts")
    folder = run_dir / CHECKPOINTS / entry["dir"]
    return load_checked(
        checkpoint_part(run_dir, entry["dir"], rank),
        parts[rank] if parts else None,
        f"the checkpoint {entry['dir']} cannot be resumed from; resume= again passes over a damaged "
        "checkpoint to the newest intact one",
        # its bytes are those written with it, so resume= finds nothing damaged and would stop here again
        whole_fix="its size and CRC-32 are those it was written with, so it was written this way, not "
        "damaged since (a file torch refuses to load as weights: not a checkpoint of this runner's); set "
        f"the checkpoint aside (mv {folder} {folder}{DAMAGED_SUFFIX}) and resume= takes the newest one "
        "before it, or start the run again without resume=",
    )


class Checkpointer(Owner):
    """Writes this rank's part of a checkpoint; collective over every rank of the job (``world``)."""

    STATE = ("count", "latest")
    TRANSIENT = {
        **dict.fromkeys(("cfg", "world", "servers", "fence"), "given"),
        "root": "the run folder's checkpoints folder",
        "last_time": "checkpoint.every_minutes counts this job's time",
        "seconds": "the last checkpoint's time, a measurement of this job (summary.json)",
    }

    def __init__(
        self,
        cfg: CheckpointConfig,
        run_dir: Path,
        world: Comm,
        resumed: dict[str, Any] | None,
        fence: Fence | None = None,
        servers: int = 0,
    ):
        self.cfg, self.world = cfg, world
        #: Whether the world has server ranks (under fault tolerance its barrier then goes on without a lost
        #: worker, whom the workers' own agreement names; without them the world is the workers'
        #: communicator, and a loss there sends them all to recovery, to take the checkpoint again).
        self.servers = servers
        self.fence = fence or Fence(run_dir, world.tolerant)
        self.root = make_folder(run_dir / CHECKPOINTS)
        self.last_time = time.time()
        self.count = resumed["seq"] if resumed else 0
        self.latest: str | None = resumed["dir"] if resumed else None
        self.seconds = 0.0  # the last checkpoint's, from its fence to the index (summary.json)

    def due(self, step: int) -> bool:
        """Whether the step count alone asks for a checkpoint after ``step`` steps (the same on all ranks)."""
        return self.cfg.every is not None and step % self.cfg.every == 0

    def due_between(self, before: int, after: int) -> bool:
        """Whether the step count asks for a checkpoint between ``before`` and ``after`` steps.

        Under dynamic assignment these are the run's chunks per worker at two meetings."""
        every = self.cfg.every
        return every is not None and after // every > before // every

    def time_due(self) -> bool:
        minutes = self.cfg.every_minutes
        return minutes is not None and time.time() - self.last_time >= 60 * minutes

    def save(self, step: int, part: dict[str, Any], info: dict[str, Any] | None = None) -> None:
        """Write this rank's ``part`` of the job's next checkpoint, taken after ``step`` steps.

        Once every rank has written, rank 0 indexes it with ``info``. Every rank saves the same sequence of
        checkpoints, so the k-th is in the same folder everywhere."""
        name, start = checkpoint_folder(self.count + 1, step), time.perf_counter()
        if self.world.tolerant and self.servers:  # ranks may have died: the parts are the survivors'
            self.world.fault_barrier()
            self.fenced(f"checkpoint {name}")
        elif self.world.tolerant:  # (the workers' communicator: a loss raises PeerLost, never shrinks it
            self.world.agree()  # unnoticed, behind the workers' recovery)
            self.fenced(f"checkpoint {name}")
        self.count += 1
        make_folder(self.root / name)
        digest = save_atomic(part, checkpoint_part(self.root.parent, name, self.world.rank))
        parts = self.world.allgather_object(digest)  # and a barrier: every rank has written its part
        self.latest = name
        self.last_time = time.time()
        self.seconds = time.perf_counter() - start
        if self.world.rank != 0:
            return
        entry = {
            "step": step,
            "seq": self.count,
            "dir": name,
            "world_size": self.world.size,
            "time": time.time(),
            **(info or {}),
            "parts": parts,
        }
        write_atomic(self.root / name / CHECKPOINT_ENTRY, dumps(entry, indent=1))
        self.index(entry)
        self.seconds = time.perf_counter() - start

    def fenced(self, what: str) -> None:
        """Collective: raise :class:`Partitioned` on every rank if a later membership claimed the run folder.

        Rank 0 looks (:mod:`runner.rank.fence`), before anything of ``what`` is written."""
        why = None
        if self.world.rank == 0:
            try:
                self.fence.check(what)
            except Partitioned as err:
                why = str(err)
        why = self.world.broadcast_object(why, root=0)
        if why is not None:
            raise Partitioned(why)

    def index(self, entry: dict[str, Any]) -> None:
        """Rank 0: add ``entry`` to the index and remove the checkpoints beyond ``checkpoint.keep``.

        The index is rebuilt from the folders if it is damaged."""
        try:
            entries = read_checkpoint_index(self.root.parent)
        except DamagedIndex as err:
            entries, _ = rebuild_checkpoint_index(self.root.parent)
            print(f"{err}: rebuilt from the checkpoint folders", flush=True)
        entries = [e for e in entries if e["seq"] < entry["seq"]] + [entry]
        self.fence.check("the checkpoint index")
        write_atomic(
            self.root / CHECKPOINT_INDEX, dumps({"checkpoints": entries[-self.cfg.keep :]}, indent=1)
        )
        for old in entries[: -self.cfg.keep]:
            shutil.rmtree(self.root / old["dir"], ignore_errors=True)
