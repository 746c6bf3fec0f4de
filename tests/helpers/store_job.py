"""A two-rank BSP job on the gloo transport whose rank 0 reports where the store listens and, asked to, lets
a foreign client write keys under the names torch's store had before they were secret; prints the model.

``python -m mpi4py tests/helpers/store_job.py [plain|attacked]``: rank 0 prints ``listens HOST PORT`` for
each listening socket of its process on the store's port, then ``model: ...`` once 5 steps of a linear
model, its gradients averaged on the transport, are done. ``attacked``: between the store's start and the
group's rendezvous another process, knowing only the port, writes garbage under ``mpitrain/G/0/R`` (the
keys gloo's rendezvous of generation G reads), and rank 1 joins after it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from typing import Any

import torch

from runner.comm import dist
from runner.comm.mpi import init

FOREIGN = """
import datetime, sys
from torch._C import _distributed_c10d as c10d
client = c10d.TCPStore("127.0.0.1", int(sys.argv[1]), None, False, datetime.timedelta(seconds=10))
for generation in range(3):
    for rank in range(2):
        client.set(f"mpitrain/{generation}/0/{rank}", b"garbage from another user")
"""


def listening(pid: str = "self") -> list[tuple[str, int]]:
    """The (address, port) of each listening TCP socket of process ``pid``, read from /proc."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    found.append(_address(fields[1]))
    return found


def _address(text: str) -> tuple[str, int]:
    """/proc/net/tcp's ``HEX_ADDRESS:HEX_PORT`` as a printable address and a port."""
    import ipaddress

    raw, port = text.split(":")
    data = bytes.fromhex(raw)
    words = b"".join(data[i : i + 4][::-1] for i in range(0, len(data), 4))  # host-order 32-bit words
    return str(ipaddress.ip_address(words)), int(port, 16)


def main(mode: str) -> None:
    mpi = init()
    comm = mpi.split(0)
    made = dist.Transport._group

    def group(transport: dist.Transport, store: Any, on: Any) -> Any:
        if on.rank == 0:
            store_port = getattr(transport, "port", None) or transport.store.port  # (before: the store)
            for host, port in listening():
                if port == store_port:
                    print(f"listens {host} {port}", flush=True)
            if mode == "attacked":
                subprocess.run([sys.executable, "-c", FOREIGN, str(store_port)], check=True, timeout=60)
        on.barrier()
        if on.rank == 1 and mode == "attacked":
            time.sleep(2)  # rank 0 reads rank 1's address before rank 1 writes it
        return made(transport, store, on)

    dist.Transport._group = group  # type: ignore[method-assign]
    comm.use_transport("gloo", timeout_s=30)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    data = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(16, 4, generator=data), torch.randn(16, 1, generator=data)
    for _ in range(5):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                comm.allreduce(p.grad)
                p -= 0.1 * p.grad / comm.size
    comm.barrier()
    if comm.rank == 0:
        values = torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
        print("model: " + " ".join(f"{v:.9g}" for v in values), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "plain")
