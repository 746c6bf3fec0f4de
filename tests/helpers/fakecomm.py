"""An in-process stand-in for :class:`runner.comm.Comm`: ``n`` ranks as threads of one process.

``FakeWorld(n).run(fn)`` calls ``fn(comm)`` on ``n`` threads, one :class:`FakeComm` each, and returns the
results by rank. Semantics (those of MPI that the rules rely on):

* Collectives match by call order per communicator: the k-th collective call of every rank forms round k,
  which fails on every rank if they called different operations or shapes. Each rank deposits a copy of
  its data; the last to arrive computes the result once (sum in float64 in rank order, cast back to the
  tensor's dtype; max; min); each rank copies it in place when its call returns, or, for iallreduce and
  allreduce_background (which return at once), when its request's test/wait completes. Objects travel
  pickled. ``split(color, key)`` gives the ranks of one color a new communicator ranked by (key, rank).
* Point to point: one mailbox per rank and communicator; recv/probe/iprobe take the earliest message that
  matches source and tag (no overtaking); recv requires the numel and dtype sent. Sends are buffered;
  ``sync_sends=True`` makes send block, and an isend request stay pending, until the message is received
  (MPI_Ssend, the strictest behaviour MPI allows: code that works so cannot deadlock on unbuffered sends).
* Accounting as in ``Comm`` (allreduce 2(N-1)/N of the buffer per rank, broadcast (N-1) buffers from the
  root, send the buffer; ``stats.seconds``); ``world.messages`` counts point-to-point messages.
* A wait longer than ``timeout`` raises TimeoutError, and an error in one rank makes the other ranks' calls
  raise :class:`Aborted`, so a deadlock or crash fails the test; ``run`` re-raises the first error.
"""

from __future__ import annotations

import pickle
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import torch

from runner.comm import ANY_SOURCE, ANY_TAG, CommStats  # imports mpi4py without initialising MPI
from runner.comm import wire as wire_ops

_REDUCE: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": lambda s: s.double().sum(0),
    "max": lambda s: s.amax(0),
    "min": lambda s: s.amin(0),
}


class Aborted(RuntimeError):
    """Raised in a rank because another rank failed first."""


class _Group:
    """The shared state of one communicator: the collective rounds in progress and one mailbox per rank."""

    def __init__(self, world: FakeWorld, size: int):
        self.world, self.size = world, size
        self.rounds: dict[int, SimpleNamespace] = {}  # round number: calls, done, result, error, taken
        self.mail: list[list[SimpleNamespace]] = [[] for _ in range(size)]  # source, tag, data, received


class FakeRequest:
    """A pending operation: ``poll(block)`` completes it if it can and says whether it is complete."""

    def __init__(self, comm: FakeComm, poll: Callable[[bool], bool]):
        self._comm, self._poll, self._done = comm, poll, False

    def test(self) -> bool:
        if not self._done:
            with self._comm._clock():
                self._done = self._poll(False)
            if not self._done:
                time.sleep(1e-4)  # a rank spinning on test() leaves the others the interpreter
        return self._done

    def wait(self) -> None:
        if not self._done:
            with self._comm._clock():
                self._done = self._poll(True)


class FakeWorld:
    """``n`` ranks: ``comms[r]`` is rank r's world communicator; ``run(fn)`` runs them."""

    def __init__(self, n: int, timeout: float = 20.0, sync_sends: bool = False):
        self.n, self.timeout, self.sync_sends = n, timeout, sync_sends
        self.cond = threading.Condition()
        self.failed: BaseException | None = None
        self.messages = 0
        group = _Group(self, n)
        self.comms = [FakeComm(group, r, CommStats()) for r in range(n)]

    def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Wait (holding ``cond``) until ``ready()``; raise on timeout or when another rank failed."""
        deadline = time.monotonic() + self.timeout
        while not ready():
            if self.failed is not None:
                raise Aborted(f"{what}: another rank failed ({self.failed!r})")
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{what} waited {self.timeout} s: deadlock?")
            self.cond.wait(left)

    def abort(self, error: BaseException) -> None:
        with self.cond:
            self.failed = self.failed or error
            self.cond.notify_all()

    def run(self, fn: Callable[[FakeComm], Any], timeout: float | None = None) -> list[Any]:
        """``fn(comm)`` on every rank, each in its own thread; the results by rank, or the first error."""
        results: list[Any] = [None] * self.n

        def main(rank: int) -> None:
            try:
                results[rank] = fn(self.comms[rank])
            except BaseException as err:
                self.abort(err)

        threads = [
            threading.Thread(target=main, args=(r,), name=f"rank{r}", daemon=True) for r in range(self.n)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + (self.timeout + 5 if timeout is None else timeout)
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in threads if t.is_alive()]
        if stuck:
            self.abort(TimeoutError(f"{stuck} still running: deadlock?"))
        if self.failed is not None:
            raise self.failed
        return results


class FakeComm:
    """One rank's view of a communicator: it satisfies :class:`runner.comm.face.CommLike`, as ``Comm`` does
    (tests/comm/test_comm_face.py compares their signatures)."""

    cuda_aware = False

    def __init__(self, group: _Group, rank: int, stats: CommStats):
        self._g, self._w = group, group.world
        self.rank, self.size, self.stats = rank, group.size, stats
        self._seq = 0
        self.background_ended = False

    def routes(self, t: torch.Tensor) -> bool:
        """No ``torch.distributed`` transport here: every tensor is combined in memory."""
        return False

    @contextmanager
    def _clock(self):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.stats.seconds += time.perf_counter() - t0

    def _check(self) -> None:
        if self._w.failed is not None:
            raise Aborted(f"rank {self.rank}: another rank failed ({self._w.failed!r})")

    def _sent(self, t: torch.Tensor, factor: float = 1.0) -> None:
        self.stats.bytes_sent += int(t.numel() * t.element_size() * factor)

    # -- collectives ------------------------------------------------------------------------------
    def _collective(self, kind: tuple, data: Any, combine: Callable[[list], Any]) -> Callable[[bool], Any]:
        """Join this rank's next round; returns ``poll(block)``: (done, result)."""
        with self._w.cond:
            self._check()
            seq, self._seq = self._seq, self._seq + 1
            rnd = self._g.rounds.setdefault(seq, SimpleNamespace(calls={}, done=False, taken=0, error=None))
            rnd.calls[self.rank] = (kind, data)
            if len(rnd.calls) == self.size:
                kinds = [rnd.calls[r][0] for r in range(self.size)]
                try:
                    assert len(set(kinds)) == 1, f"collective #{seq} differs between ranks: {kinds}"
                    rnd.result = combine([rnd.calls[r][1] for r in range(self.size)])
                except BaseException as err:
                    rnd.error = repr(err)
                rnd.done = True
                self._w.cond.notify_all()

        def poll(block: bool) -> tuple[bool, Any]:
            with self._w.cond:
                if block:
                    self._w.wait_for(lambda: rnd.done, f"rank {self.rank}: {kind[0]} #{seq}")
                elif not rnd.done:
                    self._check()
                    return False, None
                rnd.taken += 1
                if rnd.taken == self.size:
                    del self._g.rounds[seq]
                if rnd.error is not None:
                    raise RuntimeError(rnd.error)
                return True, rnd.result

        return poll

    def _tensor_request(self, t: torch.Tensor, poll: Callable[[bool], Any]) -> FakeRequest:
        def complete(block: bool) -> bool:
            done, result = poll(block)
            if done:
                with torch.no_grad():
                    t.copy_(result)
            return done

        return FakeRequest(self, complete)

    def iallreduce(self, t: torch.Tensor, op: str = "sum") -> FakeRequest:
        reduce = _REDUCE[op]
        with self._clock():
            kind = ("allreduce", op, tuple(t.shape), t.dtype)
            poll = self._collective(kind, t.detach().clone(), lambda xs: reduce(torch.stack(xs)).to(t.dtype))
            if self.size > 1:
                self._sent(t, 2 * (self.size - 1) / self.size)
        return self._tensor_request(t, poll)

    def allreduce_background(
        self, t: torch.Tensor, op: str = "sum", wire: torch.dtype | None = None, encoding: Any = None
    ):
        """At once with ``wire`` or ``encoding`` (its request holds the bytes sent, as the thread's does)."""
        before = self.stats.bytes_sent
        if (wire is None and encoding is None) or self.size == 1:
            request = self.iallreduce(t, op)
        else:
            self.allreduce(t, op, wire, encoding)
            request = FakeRequest(self, lambda block: True)
        request.sent = self.stats.bytes_sent - before
        return request

    def end_background(self) -> None:
        """No thread here: says that it was ended (``background_ended``)."""
        self.background_ended = True

    def keep(self, t: torch.Tensor) -> None:
        """Nothing to prepare in-process."""

    def allreduce(
        self, t: torch.Tensor, op: str = "sum", wire: torch.dtype | None = None, encoding: Any = None
    ) -> torch.Tensor:
        """With ``wire``, runner/comm/wire.py's 16-bit algorithm itself, and with ``encoding`` the encoding
        itself, over this fake's all-to-all and all-gather."""
        if encoding is not None:
            return encoding.reduce(self, t)
        if wire is not None and self.size > 1:
            with torch.no_grad():
                return wire_ops.allreduce(self, t, wire)
        self.iallreduce(t, op).wait()
        return t

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        n, me = self.size, self.rank
        kind = ("alltoall", send.numel(), send.dtype)
        poll = self._collective(kind, send.detach().clone().view(n, -1), lambda xs: torch.stack(xs))
        self._sent(send, (n - 1) / n)
        recv.view(n, -1).copy_(poll(True)[1][:, me])

    def allgather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        kind = ("allgather", send.numel(), send.dtype)
        poll = self._collective(kind, send.detach().clone(), lambda xs: torch.cat(xs))
        self._sent(send, self.size - 1)
        recv.copy_(poll(True)[1])

    def broadcast(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        with self._clock():
            data = t.detach().clone() if self.rank == root else None
            poll = self._collective(("broadcast", root, tuple(t.shape), t.dtype), data, lambda xs: xs[root])
            if self.rank == root:
                self._sent(t, self.size - 1)
        self._tensor_request(t, poll).wait()
        return t

    def _objects(self, kind: tuple, obj: Any, combine: Callable[[list], Any]) -> Any:
        """A collective over picklable objects: ``combine`` maps the ranks' objects to the result."""

        def combined(xs: list) -> bytes:
            return pickle.dumps(combine([pickle.loads(x) for x in xs]))

        with self._clock():
            return pickle.loads(self._collective(kind, pickle.dumps(obj), combined)(True)[1])

    def barrier(self) -> None:
        self._objects(("barrier",), None, lambda xs: None)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self._objects(("allgather_object",), obj, lambda xs: xs)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self._objects(("broadcast_object", root), obj, lambda xs: xs[root])

    def allreduce_values(self, values: Sequence[float], op: str = "sum") -> list[float]:
        """Reduced in float64, like ``Comm.allreduce_values``."""
        combine = _REDUCE[op]
        kind = ("allreduce_values", op, len(values))
        return self._objects(
            kind, list(values), lambda xs: combine(torch.tensor(xs, dtype=torch.float64)).tolist()
        )

    def split(self, color: int, key: int | None = None, keep: bool = True) -> FakeComm:
        """Collective: the ranks of one ``color`` ranked by (key, rank); ``keep`` changes nothing here."""

        def combine(members: list) -> dict[int, tuple[_Group, int]]:  # members: (color, key, old rank)
            placed = {}
            for c in {m[0] for m in members}:
                ranks = [old for _, _, old in sorted(m for m in members if m[0] == c)]
                group = _Group(self._w, len(ranks))
                placed.update({old: (group, new) for new, old in enumerate(ranks)})
            return placed

        mine = (color, self.rank if key is None else key, self.rank)
        with self._clock():
            group, rank = self._collective(("split",), mine, combine)(True)[1][self.rank]
        return FakeComm(group, rank, self.stats)

    def counter(self, slots: int = 1, host: int = 0) -> FakeCounter:
        """Collective, like ``Comm.counter``: shared int64 slots, all zero."""
        with self._clock():
            shared = self._collective(("counter", slots), None, lambda xs: [0] * slots)(True)[1]
        return FakeCounter(shared, self._w.cond)

    tolerant = False  # no process of a fake world dies

    def launch_rank(self, rank: int | None = None) -> int:
        """The rank as launched: a fake world is never shrunk, so the rank itself."""
        return self.rank if rank is None else rank

    def local_size(self) -> int:
        return self.size

    def local_rank(self) -> int:
        return self.rank

    # -- point to point ---------------------------------------------------------------------------
    def isend(self, t: torch.Tensor, dest: int, tag: int = 0, wire: torch.dtype | None = None) -> FakeRequest:
        assert 0 <= dest < self.size, f"rank {self.rank}: send to rank {dest} of {self.size}"
        if wire is not None:
            t = t.to(wire)
        data = t.detach().clone(memory_format=torch.contiguous_format)
        msg = SimpleNamespace(source=self.rank, tag=tag, data=data, received=False)
        with self._clock(), self._w.cond:
            self._check()
            self._g.mail[dest].append(msg)
            self._w.messages += 1
            self._w.cond.notify_all()
        self._sent(t)

        def delivered(block: bool) -> bool:
            if not self._w.sync_sends:
                return True
            with self._w.cond:
                if block:
                    self._w.wait_for(lambda: msg.received, f"rank {self.rank}: send to {dest} tag {tag}")
                self._check()
                return msg.received

        return FakeRequest(self, delivered)

    def send(self, t: torch.Tensor, dest: int, tag: int = 0, wire: torch.dtype | None = None) -> None:
        self.isend(t, dest, tag, wire).wait()

    def _find(self, source: int, tag: int) -> int | None:
        """Index of the earliest message in this rank's mailbox that matches (``cond`` held)."""
        for i, m in enumerate(self._g.mail[self.rank]):
            if source in (ANY_SOURCE, m.source) and tag in (ANY_TAG, m.tag):
                return i
        return None

    def _wait_match(self, source: int, tag: int) -> int:
        self._check()
        self._w.wait_for(
            lambda: self._find(source, tag) is not None, f"rank {self.rank}: recv {source} {tag}"
        )
        return self._find(source, tag)

    def probe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[int, int]:
        with self._clock(), self._w.cond:
            m = self._g.mail[self.rank][self._wait_match(source, tag)]
            return m.source, m.tag

    def iprobe(self, source: int = ANY_SOURCE, tag: int = ANY_TAG) -> tuple[int, int] | None:
        with self._clock(), self._w.cond:
            self._check()
            i = self._find(source, tag)
            m = None if i is None else self._g.mail[self.rank][i]
        if m is None:
            time.sleep(1e-4)  # a rank polling in a loop leaves the others the interpreter
            return None
        return m.source, m.tag

    def recv(
        self, t: torch.Tensor, source: int = ANY_SOURCE, tag: int = ANY_TAG, wire: torch.dtype | None = None
    ) -> tuple[int, int]:
        if wire is not None:
            narrow = torch.empty(t.shape, dtype=wire)
            found = self.recv(narrow, source, tag)
            with torch.no_grad():
                t.copy_(narrow)
            return found
        with self._clock(), self._w.cond:
            m = self._g.mail[self.rank].pop(self._wait_match(source, tag))
            m.received = True
            self._w.cond.notify_all()
        if (m.data.numel(), m.data.dtype) != (t.numel(), t.dtype):
            raise ValueError(
                f"rank {self.rank}: {m.data.numel()} {m.data.dtype} from {m.source} tag {m.tag} "
                f"into a buffer of {t.numel()} {t.dtype}"
            )
        with torch.no_grad():
            t.copy_(m.data.view(t.shape))
        return m.source, m.tag


class FakeCounter:
    """:class:`runner.comm.face.CounterLike` over a list every rank of a fake world shares."""

    def __init__(self, values: list[int], lock: threading.Condition):
        self.values, self._lock = values, lock

    def fetch_add(self, slot: int = 0, value: int = 1) -> int:
        with self._lock:
            before = self.values[slot]
            self.values[slot] += value
            return before

    def fetch_max(self, slot: int, value: int) -> int:
        with self._lock:
            before = self.values[slot]
            self.values[slot] = max(before, value)
            return before

    def compare_and_swap(self, slot: int, compare: int, value: int) -> int:
        with self._lock:
            before = self.values[slot]
            if before == compare:
                self.values[slot] = value
            return before

    def put(self, slot: int, values: Sequence[int]) -> None:
        with self._lock:
            self.values[slot : slot + len(values)] = list(values)

    def read(self, slot: int = 0, count: int = 1) -> list[int]:
        with self._lock:
            return self.values[slot : slot + count]

    def snapshot(self) -> list[int]:
        return self.read(0, len(self.values))

    def close(self) -> None:
        pass
