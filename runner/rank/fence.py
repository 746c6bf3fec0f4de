"""One side of a partition goes on: the quorum rule after a loss, and the run folder fenced by generation.

Under ULFM a partitioned peer looks exactly like a dead one: when a link between nodes is cut and the
failure detector is on, each side sees the other as failed and shrinks to itself. Were both to go on,
both would write checkpoints, records and the summary into the same run folder (a split brain). Two
rules stop that:

- **Quorum** (:func:`quorum`): after a loss that may be a partition, the survivors go on only if they are
  a strict majority of the membership before it, or exactly half of it holding its rank 0. Since both
  sides shrink from the same membership, at most one side passes. A loss can be a partition only when a
  whole host went silent: a lost rank that shared its host with a survivor was not cut off from it (ranks
  of one node are on the same side of any cut), so it died, and the survivors go on whatever their number.
- **Fencing** (:class:`Fence`): every membership change that goes on claims the next generation with a
  file created exclusively in the run folder (``logs/generation.<g>``); rank 0 checks, before each write of
  the checkpoint index, the lost ranks' record and the summary, that no later generation exists. A side
  that went on wrongly (a quorum decided on different memberships) is stopped before it overwrites the
  records of the side that claimed the generation first.

A side that must not go on raises :class:`Partitioned`: it ends without a checkpoint, naming the cut.

Claims are made one after another from the job's start (the launcher removes an earlier job's), so a
later membership's claims follow this side's without a gap. A ``generation.<g>`` file that does not
(``generation.5`` with no ``generation.1`` to ``4``), or whose name is no number (``generation.²``), or that
is not a regular file, was not written by this job: no membership change made it, so it fences nothing. It
is named in one warning and ignored, rather than stopping a healthy job (a file put there, or left by
hand, says nothing about where the job's workers are).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from runner.folder_files import describe, is_regular, read_bytes, refused
from runner.run_folder import GENERATION, LOGS, parse_number


class Partitioned(RuntimeError):
    """This side of a partition must not go on: it ends without writing to the run folder."""


def quorum(before: Sequence[int], survivors: Sequence[int], hosts: Sequence[str]) -> str | None:
    """Why the ``survivors`` of the membership ``before`` must stop, or None when they may go on.

    Both are launch ranks (``before``: rank 0 first); ``hosts``: every launch rank's host."""
    alive = set(survivors)
    lost = [r for r in before if r not in alive]
    survivor_hosts = {hosts[r] for r in survivors}
    cut_off = sorted({hosts[r] for r in lost if hosts[r] not in survivor_hosts})
    if not cut_off:
        return None  # every lost rank shared a host with a survivor: dead, not partitioned
    if 2 * len(survivors) > len(before):
        return None
    if 2 * len(survivors) == len(before) and before[0] in alive:
        return None
    side = ", ".join(f"rank {r} ({hosts[r]})" for r in survivors)
    other = ", ".join(cut_off)
    if 2 * len(survivors) == len(before):
        why = f"exactly half of the {len(before)} workers, without rank {before[0]} ({hosts[before[0]]})"
    else:
        why = f"{len(survivors)} of {len(before)} workers, not a majority"
    return (
        f"partitioned: {side} lost contact with {other} and {'are' if len(survivors) > 1 else 'is'} {why}; "
        "the other side, if it is alive, goes on and keeps the run folder, so this side stops without a "
        "checkpoint"
    )


class Fence:
    """The membership generation this rank belongs to, and the run folder's check against it."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.dir, self.enabled = run_dir / LOGS, enabled
        self.generation = 0
        self.ignored: set[str] = set()  # the files named as not this job's, named once

    def current(self) -> int:
        """The run folder's latest claimed generation (0: none yet).

        It is the last of the claims 1, 2, ... that follow one another. Files of the form that are no claim
        of this job are warned of, once each."""
        prefix = GENERATION + "."
        try:
            names = [n for n in os.listdir(self.dir) if n.startswith(prefix)]
        except OSError:
            return 0
        claimed = {}
        for name in names:
            number = parse_number(name[len(prefix) :])
            if number and is_regular(self.dir / name):
                claimed[number] = name
        latest = 0
        while latest + 1 in claimed:
            latest += 1
        self._warn(sorted(set(names) - {claimed[g] for g in range(1, latest + 1)}), latest)
        return latest

    def _warn(self, names: list[str], latest: int) -> None:
        """Name the generation files no membership change of this job made (``latest``: its last claim)."""
        why = (
            f"its claims are {GENERATION}.1 to {GENERATION}.{latest}, one after another"
            if latest
            else "no worker was lost, so it claimed no generation"
        )
        for name in names:
            if name not in self.ignored:
                self.ignored.add(name)
                print(
                    f"warning: {self.dir / name} was not written by this job ({why}): ignored; remove it",
                    flush=True,
                )

    def claim(self, members: str) -> bool:
        """Claim the next generation for this rank's membership; False when another side claimed it first.

        ``members``: who, for the file. A fence that is not enabled claims nothing and is never refused.
        Called by the new rank 0 alone; every member then calls :meth:`advance`. A link or special file
        in the claim's place is no side's claim (claims are regular files): it is removed, and claimed over
        (a folder there raises :class:`~runner.folder_files.ForeignFile`)."""
        if not self.enabled:
            return True
        path = self.dir / f"{GENERATION}.{self.generation + 1}"
        flags = os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_NOFOLLOW
        try:
            fd = os.open(path, flags, 0o644)
        except FileExistsError:
            if is_regular(path):
                return False
            what = describe(path, os.lstat(path).st_mode)
            print(f"warning: {path} is {what}, no claim of this job: removed", flush=True)
            try:
                os.unlink(path)  # (the link itself)
                fd = os.open(path, flags, 0o644)
            except FileExistsError:  # another side claimed it meanwhile
                return False
            except OSError:
                raise refused(path) from None
        with os.fdopen(fd, "w") as file:
            file.write(members + "\n")
        return True

    def claim_next(self, members: list[str]) -> int:
        """:meth:`claim` the next generation for ``members``; returns the generation claimed.

        Where that claim is this side's own (it names every one of ``members``: made before another loss cut
        the recovery short), the one after it is claimed. Returns 0 when another side claimed it first
        (disabled: the next one)."""
        while not self.claim(", ".join(members)):
            path = self.dir / f"{GENERATION}.{self.generation + 1}"
            try:
                named = set(read_bytes(path, 1 << 16).decode(errors="replace").strip().split(", "))
            except OSError:
                return 0
            if not set(members) <= named:
                return 0
            self.generation += 1
        return self.generation + 1

    def advance(self) -> None:
        """This rank's membership moved to the next generation (claimed by its rank 0)."""
        self.generation += 1

    def check(self, what: str) -> None:
        """Raise :class:`Partitioned` if a later membership has claimed the run folder.

        Called before writing ``what``."""
        if not self.enabled:
            return
        latest = self.current()
        if latest != self.generation:
            raise Partitioned(
                f"partitioned: the run folder belongs to membership generation {latest}, this side is at "
                f"generation {self.generation}; {what} not written, this side stops without a checkpoint"
                + (self._holder(latest) if latest > self.generation else "")
            )

    def _holder(self, generation: int) -> str:
        """`` (RUN_DIR/logs/generation.2 claims it for 0@a, 1@a)``: the claim of ``generation``, named."""
        path = self.dir / f"{GENERATION}.{generation}"
        try:
            who = read_bytes(path, 200).decode(errors="replace").strip()
        except OSError:
            who = ""
        return f" ({path} claims it{' for ' + who if who else ''})"
