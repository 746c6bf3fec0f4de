"""Fixtures of the multi-node tier (``-m cluster``): nodes with their own network and hostname, and Slurm.

``cluster`` (alias ``nodes2``): one 2-node cluster for the whole session, with Slurm where it is installed,
for tests that leave it as they found it. ``make_nodes(n, slurm=False, cpus=2)``: a cluster of the test's
own, torn down after it (kill a node, cut a link). ``mpitrain(nodes, run_dir, *overrides)`` runs the
launcher on node 1 across the nodes. Where namespaces cannot be made, the tier skips with the reason;
where Slurm is missing, only the tests that use it skip.
"""

from __future__ import annotations

import functools
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.cluster.nodes import NETNS_DIR, RUN_PREFIX, Nodes, slurm_missing, why_unsupported
from tests.conftest import ROOT, Run, cli_argv


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every ``cluster`` test is also ``slow``."""
    for item in items:
        if item.get_closest_marker("cluster") and not item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.slow)


@functools.lru_cache(maxsize=1)
def _unsupported() -> str | None:
    return why_unsupported()


def require_nodes() -> None:
    """Skip the calling test where test nodes cannot be made here (the reason is printed)."""
    reason = _unsupported()
    if reason:
        pytest.skip(reason)


def require_slurm() -> None:
    """Skip the calling test where test nodes or Slurm are missing (the reason is printed)."""
    require_nodes()
    missing = slurm_missing()
    if missing:
        pytest.skip(f"Slurm is not installed here (missing: {', '.join(missing)})")


def leftovers(tag: str, inodes: set[int] = frozenset()) -> list[str]:
    """Everything on this machine that still names run ``tag``: namespaces, processes in its namespaces
    (``inodes``: their inodes, noted while it was up), mounts, and files in /etc/netns, /run, /tmp, /dev/shm.

    Written apart from ``nodes.py``'s teardown, so that a step the teardown skips shows up here."""
    found = [f"netns {n}" for n in (os.listdir(NETNS_DIR) if NETNS_DIR.is_dir() else ()) if tag in n]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            net = os.readlink(f"/proc/{pid}/ns/net")
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if int(re.sub(r"\D", "", net) or 0) in inodes or (tag in cmd and int(pid) != os.getpid()):
            found.append(f"process {pid} ({net}): {cmd.strip()[:120]}")
    found += [
        f"mount {line.split()[4]}"
        for line in Path("/proc/self/mountinfo").read_text().splitlines()
        if tag in line
    ]
    for folder in ("/etc/netns", "/run", tempfile.gettempdir(), "/dev/shm"):
        found += [f"file {path}" for path in _names_in(folder, depth=2) if tag in path.name]
    return found


def _names_in(folder: str, depth: int) -> list[Path]:
    """The paths in ``folder`` and, ``depth`` - 1 levels down, in its sub-folders (links not followed)."""
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return []
    found = list(entries)
    if depth > 1:
        for entry in entries:
            if entry.is_dir() and not entry.is_symlink():
                found += _names_in(str(entry), depth - 1)
    return found


def netns_inodes(nodes: Nodes) -> set[int]:
    """The inodes of ``nodes``' network namespaces (nodes and switch), to find their processes later."""
    return {(NETNS_DIR / n).stat().st_ino for n in [*nodes.names, nodes.switch] if (NETNS_DIR / n).exists()}


def _report_leftovers(nodes: Nodes, inodes: set[int]) -> None:
    left = leftovers(nodes.tag, inodes)
    if left:
        message = f"test nodes {nodes.tag}: teardown left {len(left)} things:\n  " + "\n  ".join(left)
        print(message)
        pytest.fail(message, pytrace=False)


@pytest.fixture(scope="session")
def cluster() -> Iterator[Nodes]:
    """A 2-node cluster for the session (Slurm on it where installed); leave it as you found it.

    At the session's end it is torn down and checked: anything of it left on the machine fails loudly."""
    require_nodes()
    nodes = Nodes.up(2, slurm=not slurm_missing())
    print(f"\ntest nodes {nodes.tag} up in {nodes.timings['up']:.2f} s ({nodes.timings})")
    inodes = netns_inodes(nodes)
    try:
        yield nodes
    finally:
        nodes.down()
        print(f"\ntest nodes {nodes.tag} down in {nodes.timings['down']:.2f} s")
        _report_leftovers(nodes, inodes)


@pytest.fixture(scope="session")
def nodes2(cluster: Nodes) -> Nodes:
    """The session's 2-node cluster (:func:`cluster`)."""
    return cluster


@pytest.fixture
def slurm_cluster(cluster: Nodes) -> Nodes:
    """The session's cluster, for a test that needs Slurm on it (skips where Slurm is missing)."""
    require_slurm()
    assert cluster.slurm, "Slurm is installed but not up on the session's cluster"
    return cluster


@pytest.fixture
def make_nodes() -> Iterator[Callable[..., Nodes]]:
    """Call as ``make_nodes(n, slurm=False, cpus=2, latency_ms=None)`` for a cluster of this test's own, torn
    down after it."""
    require_nodes()
    made: list[Nodes] = []

    def make(
        n: int, slurm: bool = False, cpus: int = 2, latency_ms: float | list[float] | None = None
    ) -> Nodes:
        if slurm:
            require_slurm()
        nodes = Nodes.up(n, slurm=slurm, cpus=cpus, latency_ms=latency_ms)
        print(
            f"test nodes {nodes.tag}: {n} up{' with Slurm' if slurm else ''} in {nodes.timings['up']:.2f} s"
        )
        made.append(nodes)
        return nodes

    yield make
    errors = []
    for nodes in made:
        try:
            nodes.down()
        except Exception as err:  # tear every cluster down before failing
            errors.append(err)
    if errors:
        raise errors[0]


#: Every node sees all of this machine's cores, so each rank would take them all: on 2 cores, two nodes'
#: ranks with 2 torch threads each made every step 10-20x slower (a gosgd epoch 13 s against 5 s).
ONE_THREAD = "hardware.threads_per_rank=1"


def default_hosts(nodes: Nodes, slots: int = 2) -> list[str]:
    """``hardware=cluster 'hardware.hosts=[<n1>:S,<n2>:S,...]'``: every node with ``slots`` slots."""
    return ["hardware=cluster", "hardware.hosts=[" + ",".join(f"{n}:{slots}" for n in nodes.names) + "]"]


def mpitrain(
    nodes: Nodes, run_dir: Path, *overrides: str, timeout: float = 180, env: dict[str, str] | None = None
) -> Run:
    """``python -m runner OVERRIDES`` on node 1 across ``nodes`` (default ``hardware=cluster`` with every
    node, 2 slots each); past ``timeout`` its whole process group is killed and the test fails with its
    output.

    ``env``: the whole environment (default: this one + ``nodes.mpi_env()``)."""
    if not any(o.startswith(("hardware=", "hardware.hosts", "hardware.hostfile")) for o in overrides):
        overrides = (*default_hosts(nodes), *overrides)
    if not any(o.startswith("hardware.threads_per_rank") for o in overrides):
        overrides = (*overrides, ONE_THREAD)
    argv = cli_argv(Path(run_dir), *overrides)
    env = {**(env if env is not None else {**os.environ, **nodes.mpi_env()}), "PYTHONUNBUFFERED": "1"}
    proc = nodes.popen(
        0,
        argv,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    start = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        try:
            out, err = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            out, err = "", "(no output: the pipes stayed open after the kill)"
        pytest.fail(f"mpitrain on {nodes.tag} hung: killed after {timeout:g} s\n{out}\n{err}", pytrace=False)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    print(f"mpitrain on {nodes.tag}: exit {proc.returncode} after {time.monotonic() - start:.1f} s")
    return Run(subprocess.CompletedProcess(argv, proc.returncode, out, err), Path(run_dir))


__all__ = ["RUN_PREFIX", "default_hosts", "leftovers", "mpitrain", "netns_inodes", "require_slurm"]
