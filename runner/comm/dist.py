"""Device tensors on ``torch.distributed``: NCCL on GPUs (gloo on CPU), bootstrapped from the MPI job.

MPI keeps launching, binding, control, the small messages and ULFM's failure detection; this transport
carries the large tensors' collectives, as Horovod splits the work. Rank 0 of the MPI communicator opens a
``TCPStore`` on port 0 (the operating system picks a free port, so there is no race) and broadcasts its
address over MPI; every rank then makes a process group of the backend over that store. The store is the
job's own: it listens only where the ranks reach it (the loopback on one node, ``store_host``'s address on
several), on a socket bound here and handed to torch (``master_listen_fd``), and its keys live under a random
secret rank 0 makes and broadcasts over MPI (which connects only the job's ranks), new per generation, so a
process that finds the port can neither guess nor overwrite them. The groups are
torch's backend objects used directly, not ``init_process_group``'s global one, so that a new group can
replace one that lost a rank (:meth:`Transport.rebuild`): the store moves to the new rank 0, a survivor, and
the old group is aborted and kept, never destroyed (destroying waits for operations a dead peer will never
finish). It imports no MPI binding: the MPI communicator is handed in by :mod:`runner.comm.mpi`.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import socket
from typing import TYPE_CHECKING, Any

import torch
from torch._C import _distributed_c10d as c10d

if TYPE_CHECKING:
    from runner.comm.face import CommLike as Comm

#: The reduction of each ``op`` name :class:`~runner.comm.mpi.Comm` accepts.
_OPS = {"sum": c10d.ReduceOp.SUM, "max": c10d.ReduceOp.MAX, "min": c10d.ReduceOp.MIN}
#: The device type each backend carries.
DEVICE = {"nccl": "cuda", "gloo": "cpu"}
#: NCCL's error handling while peers may die: ``2`` (CleanUpOnly) aborts the communicators and raises in the
#: waiting call. torch's default (``3``, SkipCleanUp) has its watchdog thread end the process about a minute
#: after a collective fails, even once the survivors have gone on over a new group (torch 2.11's
#: ProcessGroupNCCL). Read when a group is made.
NCCL_ERRORS = ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def nccl_version() -> str | None:
    """The NCCL version torch runs with (``2.28.3``), or None without CUDA or NCCL."""
    try:
        return ".".join(str(v) for v in torch.cuda.nccl.version()) if torch.cuda.is_available() else None
    except (AttributeError, RuntimeError):
        return None


def store_host(comm: Comm) -> str:
    """Collective: the address the other ranks reach rank 0's store at.

    The loopback when every rank is on its node, else its host name (``MPITRAIN_STORE_HOST`` overrides it,
    e.g. with a fast network's address)."""
    forced = os.environ.get("MPITRAIN_STORE_HOST")
    if forced:
        return forced
    return "127.0.0.1" if comm.local_size() == comm.size else socket.gethostname()


def listen(host: str, one_node: bool) -> tuple[int, str, int]:
    """A socket listening for the store on a free port (port 0: no race).

    Returns its descriptor, which torch's store takes over (and closes), the address the ranks connect to, and
    the port. On one node it is on the loopback only; on several on ``host``'s address only (the first this
    machine can bind that is not a loopback one), else, where ``host`` names none, on every interface: the
    secret keys still keep the store the job's."""
    if one_node:
        addresses = [(socket.AF_INET, "127.0.0.1")]
    else:
        try:
            infos = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)
        except OSError:
            infos = []
        addresses = [(info[0], str(info[4][0])) for info in infos if not _loopback(str(info[4][0]))]
    for family, address in addresses:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((address, 0))
            sock.listen(socket.SOMAXCONN)
        except OSError:
            sock.close()
            continue
        port = sock.getsockname()[1]
        return sock.detach(), address, port
    sock = socket.create_server(("", 0), backlog=socket.SOMAXCONN)
    port = sock.getsockname()[1]
    return sock.detach(), host, port


def _loopback(address: str) -> bool:
    """Whether ``address`` (numeric, IPv4 or IPv6) is a loopback one."""
    return ipaddress.ip_address(address.split("%")[0]).is_loopback


class Transport:
    """A process group of ``backend`` (``nccl`` or ``gloo``) over the ranks of the MPI communicator ``comm``.

    The ranks keep ``comm``'s order; collective over ``comm`` to make. Its operations return torch's ``Work``
    objects: the caller waits (:meth:`runner.comm.mpi.Comm.await_work`), so that under fault tolerance a wait
    can watch MPI for lost peers."""

    def __init__(self, comm: Comm, backend: str, timeout_s: float = 1800.0):
        assert backend in DEVICE, backend
        self.backend, self.device_type = backend, DEVICE[backend]
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.generation = 0  # groups made so far: each one's keys live under its own store prefix
        self.retired: list[Any] = []  # groups that lost a rank: aborted, kept alive (see the module's text)
        self.store: Any = None
        self.group: Any = None
        self.rebuild(comm)

    def rebuild(self, comm: Comm) -> None:
        """Collective over ``comm``: a new store on its rank 0 and a new group over its ranks.

        ``comm``'s ranks may have changed. The previous group is aborted (operations a lost peer left pending
        end there)."""
        if self.group is not None:
            self._retire(self.group)
        host = store_host(comm)  # collective (it asks which ranks share a node)
        if comm.rank == 0:
            fd, host, port = listen(host, comm.local_size() == comm.size)
            store = c10d.TCPStore(
                host, port, comm.size, True, self.timeout, wait_for_workers=False, master_listen_fd=fd
            )
            self.generation += 1
            secret = secrets.token_hex(16)  # the keys' names: only the job's ranks learn them (over MPI)
            comm.broadcast_object((host, port, self.generation, secret))
        else:  # rank 0's count names the keys, so that every rank uses the same ones
            host, port, self.generation, secret = comm.broadcast_object(None)
            store = c10d.TCPStore(host, port, comm.size, False, self.timeout)
        self.port: int = port
        self.store = c10d.PrefixStore(secret, store)  # (it keeps ``store`` alive)
        prefixed = c10d.PrefixStore(f"mpitrain/{self.generation}", self.store)
        self.group = self._group(prefixed, comm)

    def _group(self, store: Any, comm: Comm) -> Any:
        rank, size = comm.rank, comm.size
        if self.backend == "gloo":
            return c10d.ProcessGroupGloo(store, rank, size, self.timeout)
        if comm.tolerant:  # peers may die: no error of a group may end this process
            os.environ[NCCL_ERRORS[0]] = NCCL_ERRORS[1]
        options = c10d.ProcessGroupNCCL.Options()
        options._timeout = self.timeout
        options.group_name = f"mpitrain{self.generation}"  # (NCCL's logs and torch's flight recorder)
        group = c10d.ProcessGroupNCCL(store, rank, size, options)
        group._set_sequence_number_for_group()  # torch's own helper calls it (a no-op for NCCL in 2.11)
        group.eager_connect_single_device(torch.device("cuda", torch.cuda.current_device()))
        return group

    def _retire(self, group: Any) -> None:
        try:
            group.abort()
        except RuntimeError:
            pass  # gloo's abort is a no-op or refused: its pending operations fail when peers close
        self.retired.append(group)

    def takes(self, t: torch.Tensor) -> bool:
        """Whether ``t`` travels on this transport (a tensor of its device type)."""
        return t.device.type == self.device_type

    # -- operations: each returns a Work to wait for -----------------------------------------------------
    def allreduce(self, t: torch.Tensor, op: str = "sum") -> Any:
        opts = c10d.AllreduceOptions()
        opts.reduceOp = _OPS[op]
        return self.group.allreduce([_plain(t)], opts)

    def broadcast(self, t: torch.Tensor, root: int) -> Any:
        opts = c10d.BroadcastOptions()
        opts.rootRank, opts.rootTensor = root, 0
        return self.group.broadcast([_plain(t)], opts)

    def alltoall(self, send: torch.Tensor, recv: torch.Tensor) -> Any:
        return self.group.alltoall_base(_plain(recv), _plain(send), [], [], c10d.AllToAllOptions())

    def allgather(self, send: torch.Tensor, recv: torch.Tensor) -> Any:
        return self.group._allgather_base(_plain(recv), _plain(send), c10d.AllgatherOptions())


def _plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the backends take it: contiguous, and 16-bit floats moved as bytes by gloo.

    gloo has no bfloat16 (only data movement is asked in 16 bits: the 16-bit exchange sums in float32)."""
    assert t.is_contiguous(), "transport buffers must be contiguous"
    if t.element_size() == 2 and t.device.type == "cpu":
        return t.detach().view(torch.uint8)
    return t.detach()
