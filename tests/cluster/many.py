"""The test bed at size: one small job laid out on up to 16 namespaced nodes, shared by the cluster tier's
many-node tests and ``benchmarks/many_ranks.py``.

A job of N ranks runs on N/2 nodes of 2 ranks, at most 16 nodes (then more ranks a node). Each rank trains
an MLP on synthetic data with one torch thread, the same 20 steps an epoch whatever N (the data grows with
the workers: weak scaling), a checkpoint every 10 steps. The ranks share this machine's cores, so the job
is oversubscribed, and waiting ranks yield.
"""

from __future__ import annotations

import math
import os
import signal
import time
from pathlib import Path

from tests.cluster.nodes import Nodes
from tests.helpers.rules import needs

MAX_NODES = 16
STEPS, BATCH = 20, 16
#: Per rule: what makes it exchange within a short run.
SETTINGS = {
    "easgd": ["rule.tau=4"],
    "diloco": ["rule.inner_steps=4"],
    "async_diloco": ["rule.inner_steps=4"],
    "streaming_diloco": ["rule.inner_steps=4", "rule.fragments=2"],
    "sparseloco": ["rule.inner_steps=4"],
}
#: Rules with server ranks (``rule.servers``, the last ranks): one, two from 16 ranks on.
SERVED = ("asgd", "async_diloco")


def layout(ranks: int, max_nodes: int = MAX_NODES) -> tuple[int, int]:
    """``(nodes, slots)``: 2 ranks a node up to ``max_nodes`` nodes, then more a node."""
    nodes = min(max_nodes, max(1, ranks // 2))
    return nodes, math.ceil(ranks / nodes)


def servers_of(rule: str, ranks: int) -> int:
    """The server ranks of ``rule`` in a job of ``ranks`` ranks."""
    return (2 if ranks >= 16 else 1) if rule in SERVED else 0


def job(
    rule: str, ranks: int, names: list[str], epochs: int = 2, spare: int = 0, stall_timeout: int = 300
) -> list[str]:
    """The overrides of the job at ``ranks`` ranks on the first nodes of ``names``.

    ``spare``: free slots on the last node (where heal's replacement starts); ``stall_timeout``: a test
    sets it below its own timeout, so that a stalled job ends with its ranks' stacks before the test does."""
    count, slots = layout(ranks, len(names))
    servers = servers_of(rule, ranks)
    workers = ranks - servers
    hosts = [f"{n}:{slots + (spare if i == count - 1 else 0)}" for i, n in enumerate(names[:count])]
    return [
        f"rule={rule}",
        *SETTINGS.get(rule, []),
        *needs(rule),
        *([f"rule.servers={servers}"] if servers else []),
        f"devices={workers}",
        "hardware=cluster",
        f"hardware.hosts=[{','.join(hosts)}]",
        "hardware.threads_per_rank=1",
        "hardware.oversubscribe=true",  # 32 to 64 ranks share this machine's cores
        "+hardware.mca.mpi_yield_when_idle=1",  # so waiting ranks yield
        "model=mlp",
        "data=synthetic",
        "data.shape=[64]",
        f"data.train_size={workers * BATCH * STEPS}",
        "data.val_size=256",
        f"train.batch_size={BATCH}",
        f"train.epochs={epochs}",
        "train.log_every=1",
        "train.progress=false",
        f"train.stall_timeout={stall_timeout}",  # (300, the default: 64 ranks took 110 s to start on 2 cores)
        "checkpoint.every=10",
    ]


def ranks_on(nodes: Nodes, node: int) -> dict[int, int]:
    """``{rank: pid}`` of mpitrain's workers on node index ``node`` (their launch ranks)."""
    found = {}
    for pid in nodes.rank_pids(node):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        rank = next((v.split(b"=")[1] for v in environ if v.startswith(b"OMPI_COMM_WORLD_RANK=")), None)
        if rank is not None:
            found[int(rank)] = pid
    return found


def kill_rank(nodes: Nodes, node: int, rank: int | None = None) -> float | None:
    """SIGKILL launch rank ``rank`` on node index ``node`` (None: its highest); when (wall time), or None."""
    ranks = ranks_on(nodes, node)
    if not ranks:
        return None
    pid = ranks[max(ranks) if rank is None else rank]
    os.kill(pid, signal.SIGKILL)
    return time.time()


def prioritize(nodes: Nodes, serving: dict[int, set[int]], nice: int = -15) -> int:
    """Raise the priority of every thread of the launch ranks ``serving`` ({node index: ranks}), as their
    own cores would; the threads changed.

    The ranks that serve others' calls (the counter's host, servers) share this machine's cores with every
    other rank; on nodes of their own they would not wait for them. Threads started later are caught by the
    next call (a new thread takes its creator's priority, so one call after the start is enough)."""
    changed = 0
    for node, ranks in serving.items():
        for rank, pid in ranks_on(nodes, node).items():
            if rank not in ranks:
                continue
            try:
                tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue
            for tid in tids:
                try:
                    if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                        os.setpriority(os.PRIO_PROCESS, tid, nice)
                        changed += 1
                except OSError:  # (a thread that ended)
                    continue
    return changed


def serving_ranks(rule: str, ranks: int) -> dict[int, set[int]]:
    """``{node index: launch ranks}`` of the ranks that serve the others' calls: worker 0 (the dealer's
    counter, the board) and the servers (the last ranks, on the last node)."""
    count, _ = layout(ranks)
    served = {0: {0}}
    servers = servers_of(rule, ranks)
    if servers:
        served.setdefault(count - 1, set()).update(range(ranks - servers, ranks))
    return served


def cpu_seconds(pid: int) -> float | None:
    """A process's own CPU seconds (user + system, its children's not counted); None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def ranks_usage(nodes: Nodes, count: int) -> tuple[float, float, int]:
    """``(MB, CPU seconds, ranks)``: the resident memory and the CPU time (user + system) of every mpitrain
    rank now running on the first ``count`` nodes, and how many there are."""
    rss_kb, cpu, found = 0, 0.0, 0
    for name in nodes.names[:count]:
        for pid in nodes.rank_pids(name, "runner.rank"):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            seconds = cpu_seconds(pid)
            if seconds is None:
                continue
            rss_kb += next((int(x.split()[1]) for x in status.splitlines() if x.startswith("VmRSS")), 0)
            cpu, found = cpu + seconds, found + 1
    return rss_kb / 1024, cpu, found
