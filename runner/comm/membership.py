"""Who is in the job: ULFM's failure detection and recovery (revoke, agree, shrink) and the job's growth.

The job grows by spawned processes merged in. This module is the part of :class:`runner.comm.mpi.Comm` that
changes its members.

A communicator made tolerant (:meth:`Membership.return_errors`, ``hardware.fault_tolerance=continue`` or
``heal``) raises :class:`~runner.comm.errors.PeerLost` from every call once a peer died; the survivors then
revoke it (everyone comes to recover), agree, and shrink it to themselves, or grow it with new processes.

"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from runner.comm.binding import MPI
from runner.comm.errors import PeerLost, failed_ranks, faulted, is_loss
from runner.comm.routes import load as load_routes
from runner.comm.tags import WATCH

if TYPE_CHECKING:
    from runner.comm.background import Background
    from runner.comm.spares import Pool

#: The order keys of a job's ranks after it grew (:meth:`Membership.grow`): its workers by rank, then the
#: spawned ones, then its servers.
GROWN_KEY = 1 << 20
SERVER_KEY = 1 << 21


def merge_intercomm(inter: Any) -> Any:
    """``MPI_Intercomm_merge`` of the spawning side (a function of its own: a test makes it fail)."""
    return inter.Merge(high=False)


class GrowthFailed(RuntimeError):
    """MPI failed to grow the job on this rank while the others may wait in the growth: the job must end."""


class Membership:
    """The membership half of a communicator over the MPI communicator ``_c``.

    ``ids``: each rank's id in the job, once processes were spawned into it; ``grown``: processes were (then
    MPI_Finalize is not called at the end)."""

    _c: Any
    rank: int
    size: int
    tolerant: bool
    ids: list[int] | None
    grown: bool
    routes_tried: list[Any]
    dist: Any
    _children: list[Any]
    _node_comm: Any
    _background: Background | None
    spares: Pool | None = None  # hardware.spares: the launch's ranks, members and spares (runner.comm.spares)
    #: A call on it raised PeerLost since it was last replaced: this rank's next agreement on it says so.
    saw_loss: bool = False
    #: Its last agreement (:meth:`meet`) failed: the next call on it must be the shrink (:meth:`shrink`).
    _doomed: bool = False

    def return_errors(self) -> None:
        """Failures of peers raise :class:`PeerLost` instead of aborting the job.

        Call before splitting: communicators made from this one inherit it."""
        self._c.Set_errhandler(MPI.ERRORS_RETURN)
        self.tolerant = True

    def launch_rank(self, rank: int | None = None) -> int:
        """The rank in the job as launched (``MPI.COMM_WORLD``) of this communicator's ``rank``."""
        rank = self.rank if rank is None else rank
        if self.ids is not None:  # processes were spawned into it: they are in no common COMM_WORLD
            return self.ids[rank]
        return MPI.Group.Translate_ranks(self._c.Get_group(), [rank], MPI.COMM_WORLD.Get_group())[0]

    @faulted
    def check_peers(self) -> None:
        """Raise :class:`PeerLost` if ULFM knows a peer of this communicator died, or it was revoked."""
        self._c.Iprobe(source=MPI.ANY_SOURCE, tag=WATCH)

    def meet(self, ok: bool = True) -> bool:
        """Collective: ULFM's agreement (``MPI_Comm_agree``) on ``ok``, which every survivor leaves alike.

        True when every survivor said ``ok`` and none was lost before it. On False the next call on this
        communicator, on every survivor, is the shrink (:meth:`shrink`). ULFM's shrink is itself agreements
        on the communicator, which match a survivor's ``MPI_Comm_agree`` as well as its shrink: one survivor
        that went to recovery while the others met here would take their agreement for its shrink's, finish
        a shrink they never began, and wait for them on the new communicator while they wait in their next
        shrink (the kill battery's stall, a loss during the last validation). So every agreement carries
        "I must recover" (``ok`` False, or a call on this communicator raised :class:`PeerLost`), and a
        survivor that recovers meets the others with it before it shrinks. Agreeing completes on a revoked
        communicator too, so a survivor that another's revoke sent to recovery still meets the others."""
        if self._doomed:  # (agreed already: the shrink comes next)
            return False
        try:
            ok = bool(self._c.Agree(int(ok and not self.saw_loss)))
        except MPI.Exception as err:  # a loss: ULFM raises it on every survivor alike
            if not is_loss(err, self.tolerant):
                raise
            ok = False
        self._doomed = not ok
        return ok

    def agree(self) -> None:
        """Collective: :meth:`meet`; raise :class:`PeerLost` on every survivor alike unless all are well."""
        if not self.meet():
            raise PeerLost("agree: a member was lost, or another survivor is recovering")

    def revoke(self) -> None:
        """Revoke this communicator and those split from it.

        Every survivor's pending and later calls on them raise :class:`PeerLost`, wherever it is, so all of
        them come to recover."""
        for comm in [self, *self._children]:
            try:
                comm._c.Revoke()
            except MPI.Exception:
                pass  # revoked already, by a peer

    def lost_peers(self) -> list[int]:
        """Acknowledge the failures this process knows of; the failed ranks, in this communicator.

        Acknowledging them lets wildcard receives go on among the living."""
        self._c.Ack_failed()
        return failed_ranks(self._c)

    def failed_ids(self) -> list[int]:
        """The ids (:meth:`launch_rank`) of the members this process knows died, not acknowledged.

        A local call, safe beside another thread's call on this communicator."""
        return [self.launch_rank(r) for r in failed_ranks(self._c)]

    def lost_peers_ids(self) -> list[int]:
        """:meth:`lost_peers`, as ids in the job (:meth:`launch_rank`)."""
        return [self.launch_rank(r) for r in self.lost_peers()]

    def shrink(self) -> list[int]:
        """Replace the communicator, in place, by one of its survivors (ranks renumbered in order).

        Returns the lost ones' ranks as launched (:meth:`launch_rank`). Collective over the survivors. Split
        communicators are dropped: split anew. The background thread is idle first (its calls on the revoked
        communicator fail)."""
        if self._background is not None:
            self._background.drain()
        before = [self.launch_rank(r) for r in range(self.size)]
        mine = before[self.rank]
        self.meet(False)  # every survivor meets before it shrinks (an agreement that failed was the meeting)
        self._replace(self._c.Shrink(), mine)
        after = set(self.ids or ())
        return [launched for launched in before if launched not in after]

    def _replace(self, new: Any, mine: int, ids: list[int] | None = None) -> None:
        """Make this object wrap ``new`` (this process's id in the job: ``mine``).

        ``ids``: every rank's id, when known (else gathered). Split communicators are dropped (split anew)."""
        self._c = new
        self.saw_loss = self._doomed = False
        if self.tolerant:
            self._c.Set_errhandler(MPI.ERRORS_RETURN)
        self.rank, self.size = self._c.Get_rank(), self._c.Get_size()
        self.ids = ids if ids is not None else self._c.allgather(mine)
        self._children, self._node_comm = [], None
        self.routes_tried = load_routes()  # (what routes kept was for the old communicator)
        if self.dist is not None:  # the transport's group follows: a new one over the new ranks
            self.dist.rebuild(self)

    def fault_barrier(self) -> list[int]:
        """A barrier that completes among the survivors when processes have died (``MPI_Comm_agree``).

        Then it shrinks the communicator if any had; returns the lost ones' ranks as launched. Whether to
        shrink is agreed too: a survivor that alone knows of a loss (ULFM's detector tells each in its own
        time) would otherwise wait in the shrink for the others, which go on, and record them lost as they
        leave (the kill battery, once: a kill at the last validation, ranks 0-2 recorded lost by rank 3)."""
        if self.meet() and self.meet(not self.lost_peers()):
            return []
        return self.shrink()

    # -- growth -----------------------------------------------------------------------------------------
    def grow(
        self,
        argv: list[str],
        count: int,
        key: int,
        wdir: str,
        oversubscribe: bool = False,
        hosts: Sequence[str] = (),
    ) -> str | None:
        """Start ``count`` processes running ``argv`` (``MPI_Comm_spawn``) and merge them in, in place.

        Collective over this communicator (no lost ranks in it). This process takes place ``key`` in the new
        order (the new ones take ``GROWN_KEY + i``). With ``oversubscribe`` (the job was launched so) they
        may share cores, unbound, on ``hosts`` (none: where Open MPI chooses): Open MPI does not pass the
        launch's ``--oversubscribe`` on, maps a spawn by core, and refused one that found no free core.
        Returns why no process was started (MPI's message: no free slot, a command that failed), else
        None."""
        mine = self.launch_rank()
        info = MPI.Info.Create()
        info.Set("wdir", wdir)
        if oversubscribe:
            info.Set("map_by", "slot:OVERSUBSCRIBE")
            info.Set("bind_to", "none")
            if hosts:
                info.Set("host", ",".join(dict.fromkeys(hosts)))
        try:
            inter = self._c.Spawn(argv[0], argv[1:], maxprocs=count, info=info, root=0)
        except MPI.Exception as err:
            self.grown = True  # mpirun counts the failed spawn too
            return err.Get_error_string().strip()
        finally:
            info.Free()
        self.grown = True
        try:
            merged = merge_intercomm(inter)
        except MPI.Exception as err:  # (seen once in CI, on 2 nodes: MPI_ERR_INTERN on rank 0)
            raise GrowthFailed(
                f"the job's growth failed on this rank: MPI_Intercomm_merge of the new worker(s) returned "
                f"{err.Get_error_string().strip()}; the other ranks wait in it for good (ULFM's revoke does "
                "not end it), so the job ends; resume=RUN_DIR continues it from its last checkpoint"
            ) from None
        inter.Disconnect()  # (left connected, MPI_Finalize was seen to crash disconnecting it)
        self._replace(merged.Split(0, key), mine)
        return None

    def adopt(self, new: Any, ids: list[int]) -> None:
        """Wrap ``new`` in place (fault tolerant): the job's world after spares were promoted into it.

        ``ids``: each of its ranks' id in the job (:meth:`launch_rank`)."""
        self.tolerant = True
        self._replace(new, ids[new.Get_rank()], ids)
        self.grown = True

    def merge_parent(self, first: int) -> None:
        """A spawned process, on its world: merge into the job that spawned it, in place (fault tolerant).

        In that job the spawned processes have ids ``first``, ``first + 1``..."""
        mine = first + self.rank
        parent = MPI.Comm.Get_parent()
        merged = parent.Merge(high=True)
        parent.Disconnect()
        self.return_errors()
        order = GROWN_KEY + self.rank
        self._replace(merged.Split(0, order), mine)
        self.grown = True

    @faulted
    def resplit(self, parent: Membership, color: int) -> None:
        """Collective over ``parent``: wrap, in place, ``parent``'s ranks of the same ``color``.

        For a job that grew; ranks keep ``parent``'s order."""
        self.tolerant = parent.tolerant
        self._replace(parent._c.Split(color, parent.rank), parent.launch_rank())
        if self not in parent._children:
            parent._children.append(self)
