"""The one-sided counter: int64 slots held by one rank, updated by any rank without the host's help.

The slots are in an MPI window (:class:`Counter`, as mpi4py's ``util/sync.py``); for a fault-tolerant job on
one node, in a locked file of the node's memory (:class:`FileCounter`); for any job across nodes, in the
host's memory, served by a thread of the host (:class:`ServedCounter`)."""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import tempfile
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from runner.comm.binding import MPI
from runner.comm.errors import PeerLost, faulted, faults
from runner.comm.tags import COUNTER_CALL, COUNTER_RESULT

if TYPE_CHECKING:
    from runner.comm.membership import Membership


#: How often the idle thread of a :class:`ServedCounter`'s host looks for calls.
PROGRESS_S = 0.001


#: The counters whose host thread runs: stopped before MPI is finalized (:func:`runner.comm.mpi.finalize`).
SERVING: weakref.WeakSet[ServedCounter] = weakref.WeakSet()


class Counter:
    """Shared int64 values held by one rank (``host``) and updated by any rank with MPI's one-sided atomics.

    ``fetch_add`` is ``MPI_Fetch_and_op`` in a passive-target epoch that stays open for the counter's life:
    over shared memory (Open MPI's ``osc/sm``, one node) the origin updates the host's memory itself, so a
    host busy computing does not delay it (about 1-3 µs a call here). Across nodes, Open MPI's TCP transport
    serves a call only when the host enters MPI, and each takes a lock in the host's window over the
    network: a job there takes a :class:`ServedCounter` (where MPI gives threads) instead, which served 6-13×
    the calls a second (:meth:`runner.comm.mpi.Comm.counter`). Collective over ``comm`` to make.
    """

    def __init__(self, comm: Membership, slots: int, host: int = 0):
        self._comm, self.host, self.slots = comm, host, slots
        self._win = MPI.Win.Allocate(8 * slots if comm.rank == host else 0, 8, comm=comm._c)
        if comm.rank == host:
            np.frombuffer(self._win.tomemory(), dtype=np.int64)[:] = 0
        self._win.Lock_all(MPI.MODE_NOCHECK)
        comm._c.Barrier()
        self._one = np.ones(1, dtype=np.int64)

    def fetch_add(self, slot: int = 0, value: int = 1) -> int:
        """Add ``value`` to ``slot`` atomically; the value it held before."""
        return self._fetch_and_op(slot, value, MPI.SUM)

    def fetch_max(self, slot: int, value: int) -> int:
        """Raise ``slot`` to ``value`` atomically (if it is lower); the value it held before."""
        return self._fetch_and_op(slot, value, MPI.MAX)

    @faulted
    def _fetch_and_op(self, slot: int, value: int, op: MPI.Op) -> int:
        self._one[0] = value
        out = np.zeros(1, dtype=np.int64)
        self._win.Fetch_and_op(self._one, out, self.host, slot, op)
        self._win.Flush(self.host)
        return int(out[0])

    @faulted
    def compare_and_swap(self, slot: int, compare: int, value: int) -> int:
        """Replace ``slot`` by ``value`` if it holds ``compare``, atomically; the value it held before."""
        self._one[0] = value
        expected, out = np.array([compare], dtype=np.int64), np.zeros(1, dtype=np.int64)
        self._win.Compare_and_swap(self._one, expected, out, self.host, slot)
        self._win.Flush(self.host)
        return int(out[0])

    @faulted
    def put(self, slot: int, values: Sequence[int]) -> None:
        """Replace ``slot`` and the slots after it by ``values``, each atomically."""
        data = np.asarray(values, dtype=np.int64)
        self._win.Accumulate(data, self.host, (slot, len(data), MPI.INT64_T), MPI.REPLACE)
        self._win.Flush(self.host)

    @faulted
    def read(self, slot: int = 0, count: int = 1) -> list[int]:
        """``count`` values from ``slot`` on, each read atomically."""
        out = np.zeros(count, dtype=np.int64)
        self._win.Get_accumulate(
            np.zeros(count, dtype=np.int64), out, self.host, (slot, count, MPI.INT64_T), MPI.NO_OP
        )
        self._win.Flush(self.host)
        return out.tolist()

    def snapshot(self) -> list[int]:
        """The host only: every slot, read from its own memory (works when other ranks were lost)."""
        assert self._comm.rank == self.host, "only the counter's host holds its slots"
        return np.frombuffer(self._win.tomemory(), dtype=np.int64).tolist()

    def close(self) -> None:
        """Collective: end the access epoch and free the window.

        After a peer was lost, the window is dropped instead (freeing it would wait for the dead)."""
        if self._win is None:
            return
        try:
            self._win.Unlock_all()
            if not self._comm.tolerant:
                self._win.Free()
        except MPI.Exception:
            pass  # a lost peer: the survivors make a new counter
        self._win = None


#: The operations of a call on a :class:`ServedCounter` (its message's first value).
ADD, MAX, SWAP, PUT, READ = range(5)


class ServedCounter:
    """:class:`Counter`'s values in the host's memory, each call a message to a thread of the host.

    The counter of a job across nodes. Open MPI's one-sided atomics there (``osc/rdma``) take
    a lock in the host's window, through the network, for every update. A rank killed while it holds it
    leaves every other rank, the host too, waiting in ``MPI_Fetch_and_op`` or ``MPI_Accumulate`` for ever,
    where no failure is reported: ASGD on 32 ranks over 16 nodes hung so in 2 runs of 7. Here the host's
    thread applies each call whole, one at a time: a caller lost at any instant holds nothing, and a lost
    host fails its callers' receives. A call costs a round trip, plus up to :data:`PROGRESS_S` when the
    thread was idle; the host's own calls take the thread's lock. Needs ``MPI_THREAD_MULTIPLE``. Collective
    over ``comm`` to make.
    """

    def __init__(self, comm: Membership, slots: int, host: int = 0):
        self._comm, self.host, self.slots = comm, host, slots
        self._lock = threading.Lock()  # the host: its thread's calls against its own; a caller: its threads'
        with faults(comm, "counter"):
            # (its own communicator: the failures its thread acknowledges are not the job's to notice)
            self._c = comm._c.Dup()
        self._values = np.zeros(slots, dtype=np.int64) if comm.rank == host else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if comm.rank == host:
            self._thread = threading.Thread(target=self._serve, name="counter-host", daemon=True)
            self._thread.start()
            SERVING.add(self)

    def _apply(self, op: int, slot: int, arg: int, values: np.ndarray) -> np.ndarray:
        """The host, under the lock: one call on its slots; what the call returns."""
        v = self._values
        assert v is not None, "only the counter's host holds its slots"
        old = v[slot : slot + (arg if op == READ else 1)].copy()
        if op == ADD:
            v[slot] += arg
        elif op == MAX:
            v[slot] = max(int(v[slot]), arg)
        elif op == SWAP and v[slot] == arg:
            v[slot] = values[0]
        elif op == PUT:
            v[slot : slot + len(values)] = values
            return old[:0]
        return old

    def _serve(self) -> None:
        """The host's thread: answer each call, in the order they come, until :meth:`stop_serving`."""
        c, status = self._c, MPI.Status()
        call = np.empty(3 + self.slots, dtype=np.int64)
        while not self._stop.is_set():
            try:
                if not c.Iprobe(MPI.ANY_SOURCE, COUNTER_CALL, status):
                    self._stop.wait(PROGRESS_S)
                    continue
                source, n = status.Get_source(), status.Get_count(MPI.INT64_T)
                c.Recv([call, n, MPI.INT64_T], source, COUNTER_CALL)
            except MPI.Exception:  # a rank was lost: go on serving the living once it is acknowledged
                with contextlib.suppress(MPI.Exception):
                    c.Ack_failed()
                self._stop.wait(PROGRESS_S)
                continue
            with self._lock:
                result = self._apply(int(call[0]), int(call[1]), int(call[2]), call[3:n].copy())
            with contextlib.suppress(MPI.Exception):  # a caller lost since it called
                c.Send([result, MPI.INT64_T], source, COUNTER_RESULT)

    @faulted
    def _call(self, op: int, slot: int, arg: int = 0, values: Sequence[int] = ()) -> np.ndarray:
        data = np.asarray(values, dtype=np.int64)
        if self._comm.rank == self.host:
            with self._lock:
                return self._apply(op, slot, arg, data)
        call = np.concatenate([np.array([op, slot, arg], dtype=np.int64), data])
        out = np.empty(arg if op == READ else 0 if op == PUT else 1, dtype=np.int64)
        with self._lock:
            self._c.Send([call, MPI.INT64_T], self.host, COUNTER_CALL)
            self._c.Recv([out, MPI.INT64_T], self.host, COUNTER_RESULT)
        return out

    def fetch_add(self, slot: int = 0, value: int = 1) -> int:
        """Add ``value`` to ``slot`` atomically; the value it held before."""
        return int(self._call(ADD, slot, value)[0])

    def fetch_max(self, slot: int, value: int) -> int:
        """Raise ``slot`` to ``value`` atomically (if it is lower); the value it held before."""
        return int(self._call(MAX, slot, value)[0])

    def compare_and_swap(self, slot: int, compare: int, value: int) -> int:
        """Replace ``slot`` by ``value`` if it holds ``compare``, atomically; the value it held before."""
        return int(self._call(SWAP, slot, compare, [value])[0])

    def put(self, slot: int, values: Sequence[int]) -> None:
        """Replace ``slot`` and the slots after it by ``values``, atomically."""
        self._call(PUT, slot, 0, values)

    def read(self, slot: int = 0, count: int = 1) -> list[int]:
        """``count`` values from ``slot`` on, read atomically."""
        return self._call(READ, slot, count).tolist()

    def snapshot(self) -> list[int]:
        """The host only (as :meth:`Counter.snapshot`): every slot."""
        assert self._comm.rank == self.host, "only the counter's host holds its slots"
        return self.read(0, self.slots)

    def stop_serving(self) -> None:
        """The host: end its thread (when the counter closes, or before MPI is finalized)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            SERVING.discard(self)

    def close(self) -> None:
        """End this rank's use of the counter (not collective: the survivors of a loss drop theirs).

        The host stops answering: it closes once no rank will call again (after a collective, such as making
        the counter that replaces it). Its communicator is left unfreed, as a window after a loss is (freeing
        may wait for the dead)."""
        self.stop_serving()


def _memory_dir() -> str:
    """Where a node's counter file lives: the node's memory (``/dev/shm``) where there is one."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()


class FileCounter:
    """:class:`Counter`'s values in a file of the node's memory, each update under a POSIX record lock.

    The counter of a fault-tolerant job whose ranks share one node.

    Open MPI's one-sided atomics over shared memory (``osc/sm``) take a spinlock in the host's segment for
    every update; a process killed while it holds it (a worker SIGKILLed in a draw) leaves every other rank
    spinning inside MPI for ever, where no failure is reported. The kernel drops a dead process's record
    locks (and a forked loader process does not inherit them), so here a rank lost at any instant holds up
    nobody. The file is unlinked once every rank opened it: nothing is left behind, whoever dies. Collective
    over ``comm`` to make.

    """

    def __init__(self, comm: Membership, slots: int, host: int = 0):
        self._comm, self.host, self.slots = comm, host, slots
        self._thread_lock = threading.Lock()  # (record locks are per process: its threads take turns here)
        path = None
        if comm.rank == host:
            fd, path = tempfile.mkstemp(prefix="mpitrain-counter-", dir=_memory_dir())
            os.ftruncate(fd, 8 * slots)
            os.close(fd)
        try:
            with faults(comm, "counter"):
                path = comm._c.bcast(path, root=host)
                try:
                    self._fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                except FileNotFoundError:  # the host gave up on a lost peer and removed it
                    raise PeerLost("counter: its file is gone (a peer was lost while it was made)") from None
                comm._c.Barrier()
        finally:
            if comm.rank == host:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        self._map = mmap.mmap(self._fd, 8 * slots)
        self._slots: np.ndarray | None = np.frombuffer(self._map, dtype=np.int64)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[np.ndarray]:
        assert self._slots is not None, "the counter was closed"
        with self._thread_lock:
            fcntl.lockf(self._fd, fcntl.LOCK_EX)
            try:
                yield self._slots
            finally:
                fcntl.lockf(self._fd, fcntl.LOCK_UN)

    def fetch_add(self, slot: int = 0, value: int = 1) -> int:
        """Add ``value`` to ``slot`` atomically; the value it held before."""
        with self._locked() as s:
            old = int(s[slot])
            s[slot] = old + value
        return old

    def fetch_max(self, slot: int, value: int) -> int:
        """Raise ``slot`` to ``value`` atomically (if it is lower); the value it held before."""
        with self._locked() as s:
            old = int(s[slot])
            s[slot] = max(old, value)
        return old

    def compare_and_swap(self, slot: int, compare: int, value: int) -> int:
        """Replace ``slot`` by ``value`` if it holds ``compare``, atomically; the value it held before."""
        with self._locked() as s:
            old = int(s[slot])
            if old == compare:
                s[slot] = value
        return old

    def put(self, slot: int, values: Sequence[int]) -> None:
        """Replace ``slot`` and the slots after it by ``values``, atomically."""
        with self._locked() as s:
            s[slot : slot + len(values)] = values

    def read(self, slot: int = 0, count: int = 1) -> list[int]:
        """``count`` values from ``slot`` on, read atomically."""
        with self._locked() as s:
            return s[slot : slot + count].tolist()

    def snapshot(self) -> list[int]:
        """The host only (as :meth:`Counter.snapshot`): every slot."""
        assert self._comm.rank == self.host, "only the counter's host holds its slots"
        return self.read(0, self.slots)

    def close(self) -> None:
        """End this rank's use of the counter (not collective: the survivors of a loss drop theirs)."""
        if self._slots is None:
            return
        self._slots = None  # (the map cannot close while an array exports it)
        self._map.close()
        os.close(self._fd)
