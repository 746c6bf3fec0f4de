"""Nodes with their own network and hostname on one Linux machine: the project's multi-node test bed.

Node I (1..N) of a run tagged T (``mt`` + 4 hex digits) is the network namespace ``TnI``, whose processes
also enter the UTS namespace bound at ``/run/mpitrain-T/uts/TnI`` (hostname ``TnI``). It has the address
10.77.0.I/24 on its ``eth0`` and a private hosts file naming every node (``/etc/netns/TnI/hosts``, which
``ip netns exec`` binds over ``/etc/hosts`` for that node's processes only). Each ``eth0`` is a veth whose
other end, ``TnIp``, is a port of the bridge ``br0`` in the switch namespace ``Tsw``. Nothing changes in
the root network namespace or in ``/etc/hosts``; 10.77.0.0/24 lives only inside the run's namespaces.

With ``slurm=True``, slurmctld runs on node 1 and one slurmd on each node (``NodeName`` = hostname), with
their configuration, state and logs under the run's scratch folder. Teardown (``down()``, also at the end
of a ``with`` block, at exit, and for a dead owner's run at the next bring-up) removes every process,
namespace, mount and file the run made, and Open MPI's leftovers of its nodes. Everything needs root.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tests.cluster import delay

HERE = Path(__file__).resolve().parent
#: PRRTE's launch agent (the nodes' "ssh"), for ``PRTE_MCA_plm_ssh_agent``.
AGENT = HERE / "agent"
#: The folder holding the ``sacct`` stand-in (see :meth:`Nodes.slurm_env`).
SACCT_BIN = HERE / "bin"
SUBNET = "10.77.0"
RUN_PREFIX = "/run/mpitrain-"
TAG = re.compile(r"mt[0-9a-f]{4}")
NETNS_DIR = Path("/run/netns")
ETC_NETNS = Path("/etc/netns")
SHM = Path("/dev/shm")
TOOLS = ("ip", "unshare", "nsenter", "tc", "mount", "umount")
SLURM_TOOLS = ("slurmctld", "slurmd", "sinfo", "srun", "sbatch", "squeue", "scontrol")
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def which(name: str) -> str | None:
    """The full path of program ``name`` on PATH or in the system folders (``/usr/sbin`` included)."""
    return shutil.which(name, path=f"{os.environ.get('PATH', '')}:{SYSTEM_PATH}")


def _tool(name: str) -> str:
    path = which(name)
    if path is None:
        raise RuntimeError(f"test nodes: {name!r} is not installed (needed: {', '.join(TOOLS)})")
    return path


def _sh(*argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    """Run a host-side command (``ip``, ``tc``, ...); a failure raises RuntimeError with its stderr."""
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    if check and proc.returncode != 0:
        raise RuntimeError(f"test nodes: {' '.join(argv)} failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


def why_unsupported() -> str | None:
    """Why namespaces cannot be made here (not root, a tool missing, ``ip netns add`` failing), or None."""
    if sys.platform != "linux":
        return f"test nodes need Linux namespaces (this is {sys.platform})"
    if os.geteuid() != 0:
        return "test nodes need root (network and UTS namespaces)"
    missing = [t for t in TOOLS if which(t) is None]
    if missing:
        return f"test nodes need {', '.join(missing)} (iproute2, util-linux)"
    probe = f"mtprobe{os.getpid()}"
    had_dir = NETNS_DIR.exists()
    made = _sh(_tool("ip"), "netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"test nodes: `ip netns add` fails here: {made.stderr.strip()}"
    _sh(_tool("ip"), "netns", "del", probe, check=False)
    if not had_dir:
        _remove_if_empty(NETNS_DIR)
    return None


def slurm_missing() -> list[str]:
    """The Slurm programs (slurmctld, slurmd, srun, ...) that are not installed here."""
    return [t for t in SLURM_TOOLS if which(t) is None]


def _start_time(pid: int) -> int | None:
    """A process's start time (clock ticks since boot), which tells a PID from its reuse; None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def _netns_inode(name: str) -> int | None:
    try:
        return (NETNS_DIR / name).stat().st_ino
    except OSError:
        return None


def processes_in(inodes: Iterable[int]) -> list[int]:
    """The PIDs (not this process) whose network namespace is one of ``inodes`` (``ip netns pids``)."""
    wanted, found = set(inodes), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if os.stat(f"/proc/{entry}/ns/net").st_ino in wanted:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _kill(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _kill_in(inodes: set[int], wait: float = 5.0) -> list[int]:
    """SIGKILL every process in the namespaces ``inodes`` (again, as forks appear) until none is left."""
    killed: list[int] = []
    deadline = time.monotonic() + wait
    while pids := processes_in(inodes):
        _kill(pids)
        killed += [p for p in pids if p not in killed]
        if time.monotonic() > deadline:
            raise RuntimeError(f"test nodes: processes {pids} outlive SIGKILL")
        time.sleep(0.02)
    return killed


def _remove_if_empty(path: Path) -> None:
    """Remove folder ``path`` (unmounted first, where it is a mount point) if it is empty."""
    try:
        if not path.is_dir() or any(path.iterdir()):
            return
        if _mounts_at(str(path)):
            _sh(_tool("umount"), str(path), check=False)
        path.rmdir()
    except OSError:
        pass


def _mounts_at(prefix: str) -> list[str]:
    """This mount namespace's mount points at ``prefix`` or under it (``/proc/self/mountinfo``)."""
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if point == prefix or point.startswith(prefix.rstrip("/") + "/"):
            points.append(point)
    return points


def _node_name(tag: str) -> re.Pattern:
    return re.compile(rf"{tag}n\d+")


def ompi_leftovers(tag: str) -> list[Path]:
    """What Open MPI left for the nodes of run ``tag`` (their processes killed): session folders in the
    temporary folder that hold ``pmix.<node>.*`` files or are named after a node; ``sm_segment.<node>.*``."""
    node = _node_name(tag)
    found = []
    tmp = Path(tempfile.gettempdir())
    for entry in tmp.iterdir() if tmp.is_dir() else ():
        if not entry.is_dir() or entry.is_symlink():
            continue
        if any(node.fullmatch(part) for part in entry.name.split(".")):
            found.append(entry)
        elif entry.name.startswith(("ompi.", "prted.", "prte.", "prterun.", "pmix.")):
            try:
                names = os.listdir(entry)
            except OSError:
                continue
            if any(n.startswith("pmix.") and node.fullmatch(n.split(".")[1]) for n in names if n.count(".")):
                found.append(entry)
    for entry in SHM.iterdir() if SHM.is_dir() else ():
        parts = entry.name.split(".")
        if len(parts) > 1 and node.fullmatch(parts[1]):
            found.append(entry)
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _owner(tag: str) -> dict[str, Any]:
    try:
        return json.loads(Path(f"{RUN_PREFIX}{tag}/owner").read_text())
    except (OSError, ValueError):
        return {}


def purge(tag: str) -> None:
    """Remove everything of run ``tag``: its processes, namespaces, mounts, files and Open MPI's leftovers."""
    if not TAG.fullmatch(tag):
        raise ValueError(f"not a test-node run tag: {tag!r} (expected mt + 4 hex digits)")
    run_dir, owner, errors = Path(f"{RUN_PREFIX}{tag}"), _owner(tag), []
    ours = re.compile(rf"{tag}(n\d+|sw)")
    spaces = [n for n in (os.listdir(NETNS_DIR) if NETNS_DIR.is_dir() else ()) if ours.fullmatch(n)]
    try:
        _kill_in({i for i in map(_netns_inode, spaces) if i is not None})
    except RuntimeError as err:
        errors.append(str(err))
    for name in spaces:
        done = _sh(_tool("ip"), "netns", "del", name, check=False)
        if done.returncode != 0:
            errors.append(f"ip netns del {name}: {done.stderr.strip()}")
    for point in sorted(_mounts_at(str(run_dir)), reverse=True):
        done = _sh(_tool("umount"), point, check=False)
        if done.returncode != 0:
            errors.append(f"umount {point}: {done.stderr.strip()}")
    node = _node_name(tag)
    for entry in ETC_NETNS.iterdir() if ETC_NETNS.is_dir() else ():
        if node.fullmatch(entry.name):
            _remove(entry)
    for path in ompi_leftovers(tag):
        _remove(path)
    _remove(Path(owner.get("scratch") or Path(tempfile.gettempdir()) / f"mpitrain-{tag}"))
    for folder, existed in ((ETC_NETNS, "etc_netns_existed"), (NETNS_DIR, "run_netns_existed")):
        if owner.get(existed) is False:
            _remove_if_empty(folder)
    _remove(run_dir)
    if errors:
        raise RuntimeError(f"test nodes {tag}: teardown incomplete: " + "; ".join(errors))


def _owner_alive(tag: str) -> bool:
    owner_file = Path(f"{RUN_PREFIX}{tag}/owner")
    if not owner_file.exists():
        # between claiming the folder and writing the owner (a moment), or never written
        run_dir = owner_file.parent
        return run_dir.exists() and time.time() - run_dir.stat().st_mtime < 60
    owner = _owner(tag)
    pid = owner.get("pid")
    return isinstance(pid, int) and _start_time(pid) == owner.get("start")


def run_tags() -> set[str]:
    """The tags of every test-node run with something on this machine (alive or not)."""
    tags = {p.name.removeprefix("mpitrain-") for p in Path("/run").glob("mpitrain-mt*")}
    for folder in (NETNS_DIR, ETC_NETNS):
        for name in os.listdir(folder) if folder.is_dir() else ():
            tags.add(name[:6])
    tags |= {p.name.removeprefix("mpitrain-") for p in Path(tempfile.gettempdir()).glob("mpitrain-mt*")}
    return {t for t in tags if TAG.fullmatch(t)}


def sweep_stale() -> list[str]:
    """Purge the runs whose owner process is dead (a killed test session); returns their tags."""
    stale = sorted(t for t in run_tags() if not _owner_alive(t))
    for tag in stale:
        purge(tag)
    return stale


def metrics_records(run_dir: str | os.PathLike) -> list[dict]:
    """The records of ``run_dir``'s metrics.jsonl so far (a torn last line skipped)."""
    path = Path(run_dir) / "metrics.jsonl"
    records = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def wait_for_step(
    run_dir: str | os.PathLike, min_step: int = 1, timeout: float = 120.0, kinds: Sequence[str] = ("step",)
) -> dict:
    """Wait until ``run_dir/metrics.jsonl`` has a training record of step >= ``min_step``; returns it.

    A training record is ``"kind": "step"`` (written every ``train.log_every`` steps: set it to 1 for short
    runs); ``kinds`` widens that (e.g. ``("step", "epoch")``). TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        records = metrics_records(run_dir)
        for record in records:
            if record.get("kind") in kinds and record.get("step", -1) >= min_step:
                return record
        if time.monotonic() > deadline:
            seen = sorted({str(r.get("kind")) for r in records})
            raise TimeoutError(
                f"no record of kind {'/'.join(kinds)} and step >= {min_step} in {run_dir}/metrics.jsonl "
                f"after {timeout:g} s ({len(records)} records, kinds {seen})"
            )
        time.sleep(0.1)


def rate_bits(rate: str) -> int:
    """Bits per second of a tc rate like ``1gbit``, ``100mbit``, ``512kbit``; ValueError otherwise."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgt]?)bit", rate.strip().lower())
    if not match:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit, gbit or tbit (e.g. '100mbit')")
    bits = float(match[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[match[2]]
    if bits < 8000:
        raise ValueError(f"rate {rate!r} is below 8kbit")
    return int(bits)


class NodeCommandError(subprocess.CalledProcessError):
    """A command run on a node with ``check=True`` failed; its message shows the node and the output."""

    def __init__(self, node: str, proc: subprocess.CompletedProcess):
        super().__init__(proc.returncode, proc.args, proc.stdout, proc.stderr)
        self.node = node

    def __str__(self) -> str:
        out = ((self.stdout or "") + (self.stderr or "")).strip()[-2000:]
        return f"on {self.node}: {' '.join(map(str, self.cmd))} exited {self.returncode}:\n{out}"


class Nodes:
    """N nodes (network + UTS namespaces) on one bridge, optionally with Slurm; see the module's docstring.

    Bring up with :meth:`up` (also a context manager), run things with :meth:`run` / :meth:`popen`,
    fail things with :meth:`kill_ranks`, :meth:`kill_node`, :meth:`cut`, :meth:`rate`; :meth:`down` ends all.
    """

    def __init__(self, tag: str, n: int, cpus: int = 2, latency_ms: float | list[float] | None = None):
        self.tag = tag
        self.latency_ms = latency_ms  # None: a bridge; else the delaying forwarder (tests/cluster/delay.py)
        self.forwarder: subprocess.Popen | None = None
        self.cut_ports: set[int] = set()  # (the forwarder's ports down: nodes cut)
        self.names = [f"{tag}n{i}" for i in range(1, n + 1)]
        self.addrs = [f"{SUBNET}.{i}" for i in range(1, n + 1)]
        self.switch = f"{tag}sw"
        self.cpus = cpus
        self.agent = AGENT
        self.run_dir = Path(f"{RUN_PREFIX}{tag}")
        self.scratch = Path(tempfile.gettempdir()) / f"mpitrain-{tag}"
        self.slurm = False
        self.partition = "nodes"
        self.timings: dict[str, float] = {}
        self._daemons: list[subprocess.Popen] = []
        self._popens: list[subprocess.Popen] = []
        self._closed = False

    # --- bring-up ---------------------------------------------------------------------------------------

    @classmethod
    def up(
        cls, n: int, slurm: bool = False, cpus: int = 2, latency_ms: float | list[float] | None = None
    ) -> Nodes:
        """Bring up ``n`` nodes (``slurm``: with slurmctld on node 1 and a slurmd per node, ``cpus`` each).

        ``latency_ms``: each node's one-way latency (one value, or one per node), held by the delaying
        forwarder in place of the bridge (:mod:`tests.cluster.delay`; MTU 9000); :meth:`latency` sets it."""
        if not isinstance(n, int) or not 1 <= n <= 250:
            raise ValueError(f"n={n!r}: the number of nodes must be an int from 1 to 250")
        if not isinstance(cpus, int) or cpus < 1:
            raise ValueError(f"cpus={cpus!r}: must be a positive int")
        reason = why_unsupported()
        if reason:
            raise RuntimeError(reason)
        if slurm and slurm_missing():
            raise RuntimeError(f"test nodes with Slurm need {', '.join(slurm_missing())}")
        t0 = time.monotonic()
        sweep_stale()
        self = cls(cls._claim_tag(), n, cpus, latency_ms)
        atexit.register(self.down)
        try:
            self._write_owner()
            self._make_network()
            self.timings["network"] = time.monotonic() - t0
            if slurm:
                self._start_slurm()
                self.timings["slurm"] = time.monotonic() - t0 - self.timings["network"]
        except BaseException:
            self.down()
            raise
        self.timings["up"] = time.monotonic() - t0
        return self

    @staticmethod
    def _claim_tag() -> str:
        for _ in range(100):
            tag = "mt" + secrets.token_hex(2)
            if tag in run_tags():
                continue
            try:
                os.mkdir(f"{RUN_PREFIX}{tag}", 0o755)
            except FileExistsError:
                continue
            return tag
        raise RuntimeError("test nodes: no free run tag (100 tries); sweep /run/mpitrain-mt*")

    def _write_owner(self) -> None:
        owner = {
            "pid": os.getpid(),
            "start": _start_time(os.getpid()),
            "names": self.names,
            "scratch": str(self.scratch),
            "etc_netns_existed": ETC_NETNS.exists(),
            "run_netns_existed": NETNS_DIR.exists(),
        }
        (self.run_dir / "owner").write_text(json.dumps(owner))
        (self.run_dir / "uts").mkdir()
        self.scratch.mkdir(mode=0o755)

    def _make_network(self) -> None:
        ip, sw, bridged = _tool("ip"), self.switch, self.latency_ms is None
        _sh(ip, "netns", "add", sw)
        _sh(ip, "-n", sw, "link", "set", "lo", "up")
        if bridged:
            _sh(ip, "-n", sw, "link", "add", "br0", "type", "bridge")
            _sh(ip, "-n", sw, "link", "set", "br0", "up")
        hosts = "127.0.0.1 localhost\n" + "".join(
            f"{a} {n}\n" for a, n in zip(self.addrs, self.names, strict=True)
        )
        ETC_NETNS.mkdir(exist_ok=True)
        for name, addr in zip(self.names, self.addrs, strict=True):
            _sh(ip, "netns", "add", name)
            if bridged:
                peer = ("peer", "name", f"{name}p", "netns", sw)
                _sh(ip, "link", "add", "eth0", "netns", name, "type", "veth", *peer)
            _sh(
                ip,
                "netns",
                "exec",
                name,
                _tool("sysctl"),
                "-qw",
                "net.ipv6.conf.all.disable_ipv6=1",
                "net.ipv6.conf.default.disable_ipv6=1",
            )
            _sh(ip, "-n", name, "link", "set", "lo", "up")
            if bridged:
                _sh(ip, "-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
                _sh(ip, "-n", name, "link", "set", "eth0", "up")
                _sh(ip, "-n", sw, "link", "set", f"{name}p", "master", "br0", "up")
            uts = self._uts(name)
            uts.touch()
            _sh(_tool("unshare"), f"--uts={uts}", _tool("hostname"), name)
            (ETC_NETNS / name).mkdir()
            (ETC_NETNS / name / "hosts").write_text(hosts)
        if not bridged:
            self.forwarder = delay.start(ip, sw, self.names, self.addrs, self.control, self.latency_ms)
            self._daemons.append(self.forwarder)

    def _uts(self, name: str) -> Path:
        return self.run_dir / "uts" / name

    # --- Slurm ------------------------------------------------------------------------------------------

    @property
    def slurm_dir(self) -> Path:
        """The folder of Slurm's configuration, state, spools and logs (``<scratch>/slurm``)."""
        return self.scratch / "slurm"

    def _slurm_conf(self) -> str:
        s, n, first = self.slurm_dir, len(self.names), self.names[0]
        return f"""\
ClusterName={self.tag}
SlurmctldHost={first}({self.addrs[0]})
SlurmUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={s}/state
SlurmdSpoolDir={s}/spool-%n
SlurmctldPidFile={s}/slurmctld.pid
SlurmdPidFile={s}/slurmd-%n.pid
SlurmctldLogFile={s}/log/slurmctld.log
SlurmdLogFile={s}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/affinity
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
NodeName={self.tag}n[1-{n}] NodeAddr={SUBNET}.[1-{n}] CPUs={self.cpus} RealMemory=1000 State=UNKNOWN
PartitionName={self.partition} Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""

    def _start_slurm(self) -> None:
        """slurmctld on node 1, a slurmd on each node; returns when ``sinfo`` shows every node idle."""
        s = self.slurm_dir
        for sub in ("state", "log", "pmixtmp", *(f"spool-{n}" for n in self.names)):
            (s / sub).mkdir(parents=True)
        conf = s / "slurm.conf"
        conf.write_text(self._slurm_conf())
        # srun --mpi=pmix: every node's step makes PMIxCliTmpDirBase/spmix_appdir_*; one shared filesystem
        # would let them collide, so each slurmd sees its own folder there (its own mount namespace)
        (s / "mpi.conf").write_text(f"PMIxCliTmpDirBase={s}/pmixtmp\n")
        logs = s / "log"
        self._daemon(
            self._wrap(self.names[0], [_tool("slurmctld"), "-D", "-i", "-f", str(conf)]),
            logs / "slurmctld.out",
        )
        for name in self.names:
            (s / f"pmix-{name}").mkdir()
            # slurmd keeps the root mount namespace (its cgroup plugin needs /sys/fs/cgroup, which
            # `ip netns exec` hides), in a private copy where the node's PMIx folder and hosts file are bound
            script = (
                f"mount --bind {s}/pmix-{name} {s}/pmixtmp"
                f" && mount --bind {ETC_NETNS}/{name}/hosts /etc/hosts && exec {_tool('slurmd')} -D -f {conf}"
            )
            argv = [
                _tool("nsenter"),
                f"--net={NETNS_DIR / name}",
                f"--uts={self._uts(name)}",
                "--",
                _tool("unshare"),
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
            ]
            self._daemon(argv, logs / f"slurmd-{name}.out")
        self.slurm = True
        self._wait_idle(timeout=30)

    def _daemon(self, argv: list[str], log: Path) -> None:
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self._env(None),
                start_new_session=True,
            )
        self._daemons.append(proc)
        (self.run_dir / "pids").mkdir(exist_ok=True)
        (self.run_dir / "pids" / str(proc.pid)).write_text(" ".join(argv))

    def _wait_idle(self, timeout: float) -> None:
        deadline, idle = time.monotonic() + timeout, set()
        while time.monotonic() < deadline:
            dead = [p for p in self._daemons if p.poll() is not None]
            if dead:
                raise RuntimeError(
                    f"test nodes {self.tag}: a Slurm daemon exited ({dead[0].returncode}): "
                    f"{' '.join(dead[0].args)}\n{self._slurm_log_tail()}"
                )
            done = self.run(
                0, ["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], env=self.slurm_env(), timeout=10
            )
            idle = set(done.stdout.split())
            if idle >= set(self.names):
                return
            time.sleep(0.1)
        raise RuntimeError(
            f"test nodes {self.tag}: Slurm nodes not all idle after {timeout:g} s (idle: {sorted(idle)})\n"
            + self._slurm_log_tail()
        )

    def _slurm_log_tail(self, lines: int = 15) -> str:
        tails = []
        for log in sorted((self.slurm_dir / "log").glob("*")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            tails.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(tails)

    def slurm_env(self, sacct_standin: bool = False) -> dict[str, str]:
        """The environment for ``sbatch/srun/squeue/scontrol`` on a node (``SLURM_CONF``, ``PATH``, the MPI
        agent); ``sacct_standin``: put ``tests/cluster/bin`` (a ``sacct`` answering from scontrol) first."""
        if not (self.slurm_dir / "slurm.conf").exists():
            raise RuntimeError(
                f"test nodes {self.tag}: no Slurm here (bring up with Nodes.up(n, slurm=True))"
            )
        path = [str(SACCT_BIN)] if sacct_standin else []
        path += [
            str(Path(sys.executable).parent),
            *os.environ.get("PATH", "").split(":"),
            *SYSTEM_PATH.split(":"),
        ]
        path = list(dict.fromkeys(p for p in path if p))
        return {
            **os.environ,
            **self.mpi_env(),
            "SLURM_CONF": str(self.slurm_dir / "slurm.conf"),
            "PATH": ":".join(path),
        }

    # --- running things on nodes ------------------------------------------------------------------------

    def node(self, node: int | str) -> str:
        """The name of ``node``: an index (0 = node 1), a name or an address; ValueError otherwise."""
        if isinstance(node, int) and not isinstance(node, bool):
            if not 0 <= node < len(self.names):
                raise ValueError(f"node index {node} out of range: {len(self.names)} nodes (0-based)")
            return self.names[node]
        if node in self.names:
            return node
        if node in self.addrs:
            return self.names[self.addrs.index(node)]
        raise ValueError(f"no node {node!r} in run {self.tag} (nodes: {', '.join(self.names)})")

    def mpi_env(self) -> dict[str, str]:
        """The variables that make ``mpirun`` start its daemons on other nodes through the agent."""
        # PRRTE 3 (Open MPI 5) reads plm_ssh_agent; PRTE_MCA_plm_rsh_agent would be silently ignored
        return {"PRTE_MCA_plm_ssh_agent": str(self.agent)}

    def _env(self, env: dict[str, str] | None) -> dict[str, str]:
        return {**os.environ, **self.mpi_env()} if env is None else dict(env)

    def _wrap(self, name: str, argv: Sequence[str]) -> list[str]:
        if isinstance(argv, (str, bytes)) or not argv:
            raise ValueError(f"argv must be a non-empty list of strings (e.g. ['hostname']), not {argv!r}")
        return [
            _tool("ip"),
            "netns",
            "exec",
            name,
            _tool("nsenter"),
            f"--uts={self._uts(name)}",
            "--",
            *map(str, argv),
        ]

    def popen(
        self, node: int | str, argv: Sequence[str], *, env: dict[str, str] | None = None, **kw: Any
    ) -> subprocess.Popen:
        """Start ``argv`` on ``node`` (``env``: its whole environment; default this one + the MPI agent);
        ``kw`` go to ``subprocess.Popen``. Processes left running end at ``down()``."""
        proc = subprocess.Popen(self._wrap(self.node(node), argv), env=self._env(env), **kw)
        self._popens.append(proc)
        return proc

    def run(
        self,
        node: int | str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        timeout: float = 60,
        check: bool = False,
        input: str | None = None,
    ) -> subprocess.CompletedProcess:
        """Run ``argv`` on ``node`` and return its result (text, output captured); past ``timeout`` its
        process group is killed and TimeoutExpired raised; ``check``: a failure raises NodeCommandError."""
        name = self.node(node)
        proc = self.popen(
            name,
            argv,
            env=env,
            text=True,
            start_new_session=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL if input is None else subprocess.PIPE,
        )
        try:
            out, err = proc.communicate(input, timeout=timeout)
        except BaseException as exc:
            _killpg(proc)
            try:
                out, err = proc.communicate(timeout=5)
            except subprocess.TimeoutExpired:
                out, err = "", ""
            if isinstance(exc, subprocess.TimeoutExpired):
                raise subprocess.TimeoutExpired(list(argv), timeout, out, err) from None
            raise
        done = subprocess.CompletedProcess(list(argv), proc.returncode, out, err)
        if check and done.returncode != 0:
            raise NodeCommandError(name, done)
        return done

    # --- failures ---------------------------------------------------------------------------------------

    def pids(self, node: int | str) -> list[int]:
        """The PIDs of every process in ``node``'s network namespace."""
        inode = _netns_inode(self.node(node))
        return [] if inode is None else processes_in({inode})

    def rank_pids(self, node: int | str, pattern: str = "runner.rank.worker") -> list[int]:
        """The PIDs of ``node``'s processes whose command line holds ``pattern`` (mpitrain's ranks)."""
        found = []
        for pid in self.pids(node):
            try:
                cmdline = (
                    Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                )
            except OSError:
                continue
            if pattern in cmdline:
                found.append(pid)
        return found

    def kill_ranks(self, node: int | str, pattern: str = "runner.rank.worker") -> list[int]:
        """SIGKILL ``node``'s processes whose command line holds ``pattern`` (mpitrain's ranks); the PIDs."""
        killed = self.rank_pids(node, pattern)
        _kill(killed)
        return killed

    def kill_node(self, node: int | str) -> list[int]:
        """SIGKILL every process in ``node``'s namespace (the node dies: ranks, ``prted``, ``slurmd``)."""
        inode = _netns_inode(self.node(node))
        return [] if inode is None else _kill_in({inode})

    def cut(self, node: int | str) -> None:
        """Unplug ``node``: its port on the switch goes down (undo with :meth:`restore`)."""
        self._plug(node, False)

    def restore(self, node: int | str) -> None:
        """Plug ``node`` back in: its port on the switch goes up."""
        self._plug(node, True)

    def _plug(self, node: int | str, up: bool) -> None:
        name = self.node(node)
        if self.forwarder is None:
            _sh(_tool("ip"), "-n", self.switch, "link", "set", f"{name}p", "up" if up else "down")
            return
        port = self.names.index(name)
        self.cut_ports = self.cut_ports - {port} if up else self.cut_ports | {port}
        delay.set_control(self.forwarder, self.control, down=self.cut_ports)

    def latency(self, latency_ms: float | list[float]) -> None:
        """Set the nodes' one-way latencies (one value or one per node) at once (nodes up with a latency)."""
        if self.forwarder is None:
            raise ValueError("latency: these nodes are joined by a bridge; bring them up with latency_ms=")
        delay.set_control(self.forwarder, self.control, latency_ms=latency_ms)

    @property
    def control(self) -> Path:
        """The delaying forwarder's folder: its ``control.json``, ``stats.json`` and log."""
        return self.scratch / "forwarder"

    def rate(self, node: int | str, rate: str | None) -> None:
        """Limit ``node``'s egress to ``rate`` (tc tbf, e.g. ``"1gbit"``, ``"100mbit"``); None removes it."""
        name, tc = self.node(node), _tool("tc")
        bits = None if rate is None else rate_bits(rate)
        _sh(tc, "-n", name, "qdisc", "del", "dev", "eth0", "root", check=False)
        if bits is not None:
            burst = max(65536, bits // 8 // 500)  # about 2 ms at the rate, and at least a GSO packet
            _sh(
                tc,
                "-n",
                name,
                "qdisc",
                "add",
                "dev",
                "eth0",
                "root",
                "tbf",
                "rate",
                str(rate),
                "burst",
                str(burst),
                "latency",
                "50ms",
            )

    wait_for_step = staticmethod(wait_for_step)

    # --- teardown ---------------------------------------------------------------------------------------

    def down(self) -> None:
        """Remove everything of this run: processes (daemons TERM, then KILL), namespaces, mounts, files."""
        if self._closed:
            return
        t0 = time.monotonic()
        blocked = _block_sigint()
        try:
            self._stop_daemons()
            purge(self.tag)
            for proc in self._popens + self._daemons:
                _reap(proc)
            self._closed = True
            atexit.unregister(self.down)
        finally:
            if blocked:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        self.timings["down"] = time.monotonic() - t0

    def _stop_daemons(self, wait: float = 3.0) -> None:
        live = [p for p in self._daemons if p.poll() is None]
        _kill((p.pid for p in live), signal.SIGTERM)
        deadline = time.monotonic() + wait
        while live and time.monotonic() < deadline:
            time.sleep(0.02)
            live = [p for p in live if p.poll() is None]
        _kill((p.pid for p in live), signal.SIGKILL)

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def __repr__(self) -> str:
        state = "down" if self._closed else "up"
        return f"<Nodes {self.tag} {state}: {', '.join(self.names)}{' + Slurm' if self.slurm else ''}>"


def _killpg(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=2)


def _block_sigint() -> bool:
    """Hold off Ctrl-C during teardown (it comes after); only the main thread can."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return False
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    return True
