"""The multi-node test bed itself (tests/cluster/nodes.py): what a node is, what reaches across nodes (names,
mpirun through the agent, Slurm), the failures it can cause, and a teardown that leaves nothing behind."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.cluster import nodes as nodes_mod
from tests.cluster.conftest import leftovers, netns_inodes, require_slurm
from tests.cluster.nodes import Nodes, processes_in, wait_for_step
from tests.conftest import ROOT

pytestmark = pytest.mark.cluster

MPIRUN = str(Path(sys.executable).parent / "mpirun")
#: Each rank prints its rank and processor name once every rank is up, then sleeps argv[1] seconds.
HELLO = """from mpi4py import MPI
import sys, time
MPI.COMM_WORLD.Barrier()
print(MPI.COMM_WORLD.Get_rank(), MPI.Get_processor_name(), flush=True)
time.sleep(float(sys.argv[1]))
"""


def mpirun_argv(nodes: Nodes, script: Path, ranks_per_node: int = 1, seconds: float = 0) -> list[str]:
    """mpirun on every node of ``nodes`` (``ranks_per_node`` each) running ``script`` (HELLO)."""
    n = ranks_per_node * len(nodes.names)
    hosts = ",".join(f"{name}:{ranks_per_node}" for name in nodes.names)
    return [
        MPIRUN,
        "--allow-run-as-root",
        "--host",
        hosts,
        "-n",
        str(n),
        "--map-by",
        "node",
        "--mca",
        "mpi_yield_when_idle",
        "1",
        sys.executable,
        str(script),
        str(seconds),
    ]


@pytest.fixture
def hello(tmp_path) -> Path:
    script = tmp_path / "hello.py"
    script.write_text(HELLO)
    return script


def test_each_node_has_its_own_hostname_and_network(cluster):
    """Each node has its own hostname and network namespace, none of them this machine's."""
    seen = [
        cluster.run(i, ["sh", "-c", "hostname; readlink /proc/self/ns/net"], check=True).stdout.split()
        for i in range(len(cluster.names))
    ]
    assert [s[0] for s in seen] == cluster.names
    assert len({s[1] for s in seen}) == len(cluster.names)
    assert os.readlink("/proc/self/ns/net") not in {s[1] for s in seen}
    assert cluster.tag not in Path("/etc/hosts").read_text()
    print(f"bring-up of the session's cluster: {cluster.timings}")


def test_nodes_resolve_each_other_by_name(cluster):
    """Every node resolves every node by name (its private hosts file) and reaches it over TCP."""
    for i, _ in enumerate(cluster.names):
        for name, addr in zip(cluster.names, cluster.addrs, strict=True):
            out = cluster.run(i, ["getent", "hosts", name], check=True).stdout.split()
            assert out[0] == addr, out
    server = cluster.popen(0, [sys.executable, "-c", SERVER], stdout=-1, text=True)
    try:
        reply = cluster.run(
            1, [sys.executable, "-c", CLIENT, cluster.names[0], "1000"], check=True, timeout=20
        )
    finally:
        out, _ = server.communicate(timeout=20)
    assert reply.stdout.strip() == "sent 1000"
    assert out.split()[0] == "1000"


#: Receives one connection on port 5999 and prints how many bytes came and how long they took.
SERVER = """
import socket, sys, time
s = socket.create_server(("0.0.0.0", 5999))
c, _ = s.accept()
t0, n = time.monotonic(), 0
while data := c.recv(1 << 20):
    n += len(data)
print(n, time.monotonic() - t0, flush=True)
"""
#: Connects to HOST:5999 (retrying while the server starts) and sends N bytes.
CLIENT = """
import socket, sys, time
for _ in range(100):
    try:
        c = socket.create_connection((sys.argv[1], 5999), timeout=5)
        break
    except OSError:
        time.sleep(0.05)
c.sendall(b"x" * int(sys.argv[2]))
c.close()
print("sent", sys.argv[2])
"""


def transfer_seconds(nodes: Nodes, size: int) -> float:
    """Seconds node 1 takes to receive ``size`` bytes from node 2 over TCP."""
    server = nodes.popen(0, [sys.executable, "-c", SERVER], stdout=-1, text=True)
    try:
        nodes.run(1, [sys.executable, "-c", CLIENT, nodes.names[0], str(size)], check=True, timeout=30)
    finally:
        out, _ = server.communicate(timeout=30)
    received, seconds = out.split()
    assert int(received) == size
    return float(seconds)


def test_rate_limit_slows_a_transfer_in_proportion(cluster):
    """A 100 Mbit/s limit on node 2's egress makes a 4 MB transfer take at least 4 MB / 100 Mbit/s."""
    size, bits = 4_000_000, 100e6
    free = transfer_seconds(cluster, size)
    cluster.rate(1, "100mbit")
    try:
        limited = transfer_seconds(cluster, size)
    finally:
        cluster.rate(1, None)
    qdisc = cluster.run(1, ["tc", "qdisc", "show", "dev", "eth0"], check=True).stdout
    ideal = (size - 65536) * 8 / bits  # the burst passes at once
    print(f"4 MB node 2 -> node 1: {free:.3f} s free, {limited:.3f} s at 100mbit (ideal {ideal:.3f} s)")
    assert limited >= 0.9 * ideal
    assert free < limited / 2
    assert "tbf" not in qdisc


def test_mpirun_runs_across_nodes_through_the_agent(cluster, hello):
    """mpirun on node 1 starts a rank on each node through the agent; each rank names its own node."""
    done = cluster.run(0, mpirun_argv(cluster, hello), env={**os.environ, **cluster.mpi_env()}, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    names = dict(line.split() for line in done.stdout.splitlines() if line[:1].isdigit())
    assert names == {"0": cluster.names[0], "1": cluster.names[1]}


def test_srun_runs_on_both_nodes(slurm_cluster):
    """``srun -N2 hostname`` (Slurm in the nodes) prints both nodes."""
    c = slurm_cluster
    done = c.run(0, ["srun", "-N2", "-n2", "hostname"], env=c.slurm_env(), timeout=30, check=True)
    assert sorted(done.stdout.split()) == c.names


def test_sacct_standin_only_where_asked(slurm_cluster):
    """``slurm_env(sacct_standin=True)`` puts the stand-in on PATH; it reports a finished batch job."""
    c = slurm_cluster
    assert str(nodes_mod.SACCT_BIN) not in c.slurm_env()["PATH"]
    env = c.slurm_env(sacct_standin=True)
    job = c.run(
        0,
        ["sbatch", "--parsable", "--wait", "-N2", "--output=/dev/null", "--wrap", "hostname"],
        env=env,
        timeout=60,
        check=True,
    )
    job_id = job.stdout.strip().split(";")[0]
    argv = ["sacct", "-o", "JobID,State,NodeList", "--parsable2", "-j", job_id]
    rows = c.run(0, argv, env=env, check=True).stdout.splitlines()
    assert rows[0] == "JobID|State|NodeList"
    assert rows[1].startswith(f"{job_id}|COMPLETED|")


def test_kill_ranks_kill_node_cut_and_restore(make_nodes):
    """kill_ranks ends only the rank processes, kill_node everything on the node; cut unplugs a node."""
    nodes = make_nodes(2)
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    rank = nodes.popen(1, [*sleeper, "runner.rank.worker"])
    other = nodes.popen(1, sleeper)
    while not {rank.pid, other.pid} <= set(nodes.pids(1)):  # both started and in the node's namespace
        assert rank.poll() is None and other.poll() is None
        time.sleep(0.01)
    assert nodes.kill_ranks(1) == [rank.pid]
    assert rank.wait(5) == -9 and other.poll() is None
    nodes.cut(1)
    ping = [
        sys.executable,
        "-c",
        "import socket, sys; socket.create_connection((sys.argv[1], 22), timeout=1)",
    ]
    cut = nodes.run(0, [*ping, nodes.names[1]], timeout=10)
    assert "timed out" in cut.stderr, cut.stderr
    nodes.restore(1)
    for _ in range(5):  # the link is back within a few seconds (a loaded machine: its first SYN may be lost)
        refused = nodes.run(0, [*ping, nodes.names[1]], timeout=10)
        if "Connection refused" in refused.stderr:
            break
    assert "Connection refused" in refused.stderr, refused.stderr
    assert other.pid in nodes.kill_node(1)
    assert other.wait(5) == -9 and nodes.pids(1) == []


def test_wait_for_step_reads_training_records(tmp_path):
    """wait_for_step returns the first training record of a step at least the one asked for."""
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"kind": "val", "step": 5}) + "\n")

    def later() -> None:
        time.sleep(0.3)
        with open(path, "a") as out:
            out.write(json.dumps({"kind": "step", "step": 1, "loss": 2.0}) + "\n")
            out.write(json.dumps({"kind": "step", "step": 2, "loss": 1.5}) + "\n{torn")

    threading.Thread(target=later).start()
    assert wait_for_step(tmp_path, min_step=2, timeout=10)["loss"] == 1.5
    with pytest.raises(TimeoutError, match="step >= 3"):
        wait_for_step(tmp_path, min_step=3, timeout=0.3)
    assert wait_for_step(tmp_path, min_step=3, timeout=0.3, kinds=("step", "val"))["kind"] == "val"


def test_teardown_leaves_nothing_after_a_node_died(hello):
    """Bring up 2 nodes with Slurm, run mpirun across them, kill a node mid-job (Open MPI leaves files),
    tear down: nothing naming the run is left (namespaces, processes, mounts, files)."""
    require_slurm()
    nodes = Nodes.up(2, slurm=True)
    inodes = netns_inodes(nodes)
    try:
        print(f"bring-up with Slurm: {nodes.timings}")
        argv = mpirun_argv(nodes, hello, ranks_per_node=2, seconds=60)
        job = nodes.popen(0, argv, stdout=-1, stderr=-2, text=True, env={**os.environ, **nodes.mpi_env()})
        deadline = time.monotonic() + 30
        while not all(list(Path("/dev/shm").glob(f"sm_segment.{name}.*")) for name in nodes.names):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate(timeout=5)[0]
            time.sleep(0.1)
        nodes.kill_node(1)
        assert any(f"sm_segment.{nodes.names[1]}" in thing for thing in leftovers(nodes.tag, inodes))
    finally:
        nodes.down()
    print(f"teardown: {nodes.timings['down']:.2f} s")
    assert leftovers(nodes.tag, inodes) == []
    assert processes_in(inodes) == []
    assert nodes.tag not in Path("/proc/net/dev").read_text()  # the root namespace's interfaces


def _skip_netns_del(*argv, **kw):
    if argv[1:3] == ("netns", "del"):
        return nodes_mod.subprocess.CompletedProcess(argv, 0, "", "")
    return REAL_SH(*argv, **kw)


def _skip_umount(*argv, **kw):
    if argv[0].endswith("umount"):
        return nodes_mod.subprocess.CompletedProcess(argv, 0, "", "")
    return REAL_SH(*argv, **kw)


REAL_SH = nodes_mod._sh
SKIPPED_STEPS = {
    "kill": ("_kill_in", lambda inodes, wait=5.0: []),
    "netns del": ("_sh", _skip_netns_del),
    "umount": ("_sh", _skip_umount),
    "Open MPI's leftovers": ("ompi_leftovers", lambda tag: []),
    "files": ("_remove", lambda path: None),
}


@pytest.mark.parametrize("step", SKIPPED_STEPS)
def test_the_leftover_check_sees_a_skipped_teardown_step(step, cluster, monkeypatch):
    """With one step of the teardown skipped, the check of the teardown test finds what it left.

    (The session's ``cluster`` keeps /etc/netns and /run/netns, which this crippled teardown cannot judge.)"""
    nodes = Nodes.up(1)
    inodes = netns_inodes(nodes)
    Path(f"/dev/shm/sm_segment.{nodes.names[0]}.0.test").write_bytes(b"")
    # a process the run did not start itself (as the agent starts prted)
    sleeper = nodes_mod.subprocess.Popen(
        ["ip", "netns", "exec", nodes.names[0], sys.executable, "-c", "import time; time.sleep(60)"]
    )
    while not processes_in(inodes):
        assert sleeper.poll() is None, "the sleeper did not start"
        time.sleep(0.01)
    try:
        with monkeypatch.context() as patch:
            patch.setattr(nodes_mod, *SKIPPED_STEPS[step])
            try:
                nodes.down()
            except RuntimeError:
                pass
        assert leftovers(nodes.tag, inodes), f"a teardown without {step!r} left nothing that the check sees"
    finally:
        nodes_mod._kill(processes_in(inodes))
        sleeper.wait(5)
        nodes_mod.purge(nodes.tag)
    assert leftovers(nodes.tag, inodes) == []


#: Brings up 2 nodes, prints their tag and the inodes of their namespaces, then waits to be interrupted.
OWNER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from tests.cluster.conftest import netns_inodes
from tests.cluster.nodes import Nodes
with Nodes.up(2) as nodes:
    nodes.popen(1, [sys.executable, "-c", "import time; time.sleep(60)"], stdout=-3, stderr=-3)
    while not nodes.pids(1):
        time.sleep(0.01)
    print(nodes.tag, *netns_inodes(nodes), flush=True)
    time.sleep(60)
"""


@pytest.mark.parametrize("signal_name", ["SIGINT", "SIGKILL"])
def test_an_interrupted_or_killed_owner_leaves_nothing(signal_name, cluster):
    """Ctrl-C in the owner tears its nodes down; the nodes of a SIGKILLed owner go at the next bring-up."""
    argv = [sys.executable, "-c", OWNER, str(ROOT)]
    # Ctrl-C reaches it as at a terminal, even when this test runs in the background (where SIGINT is ignored,
    # and the child would inherit that)
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    owner = nodes_mod.subprocess.Popen(argv, stdout=-1, stderr=-1, text=True, preexec_fn=default_sigint)
    try:
        tag, *inodes = owner.stdout.readline().split()
        inodes = {int(i) for i in inodes}
        assert processes_in(inodes)
        owner.send_signal(getattr(signal, signal_name))
        err = owner.communicate(timeout=60)[1]  # teardown: seconds (more on a loaded machine)
        assert signal_name == "SIGKILL" or "KeyboardInterrupt" in err, err
    finally:
        owner.kill()
        owner.wait()
    if signal_name == "SIGKILL":
        assert leftovers(tag, inodes), "a SIGKILLed owner cannot have torn its nodes down"
        assert tag in nodes_mod.sweep_stale()
    assert leftovers(tag, inodes) == []
