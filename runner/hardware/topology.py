"""The machine's topology, read from ``/sys``: packages, NUMA nodes, cores, and NVIDIA GPUs with their CPUs.

Packages are sockets; each GPU comes with the NUMA node and CPUs it is attached to.
``python -m runner.hardware.topology`` prints it.

``plan`` places ranks on it: with GPUs, rank r drives GPU r (in PCI bus order, CUDA's ``PCI_BUS_ID`` order)
and runs on cores of that GPU's NUMA node; without GPUs, ranks fill cores in order. The launcher turns a plan
into Open MPI's ``--map-by ppr:K:numa:pe=T``, and each rank checks its real affinity against it.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

NVIDIA = "0x10de"
DISPLAY_CLASSES = ("0x0300", "0x0302")


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` → ``[0, 1, 2, 3, 8, 10, 11]``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def format_cpulist(cpus: list[int], sep: str = ",") -> str:
    """``[0, 1, 2, 3, 8]`` → ``"0-3,8"`` (the inverse of :func:`parse_cpulist`; ``sep`` joins the runs)."""
    runs: list[list[int]] = []
    for cpu in sorted(cpus):
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return sep.join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


@dataclass
class GPU:
    index: int
    pci: str
    numa: int
    cpus: list[int]


@dataclass
class Topology:
    cpus: list[int]
    package_of: dict[int, int]
    core_of: dict[int, int]
    numa_nodes: dict[int, list[int]]
    gpus: list[GPU] = field(default_factory=list)

    @property
    def packages(self) -> list[int]:
        return sorted(set(self.package_of.values()))

    def numa_of(self, cpu: int) -> int:
        return next((node for node, cpus in self.numa_nodes.items() if cpu in cpus), 0)

    def visible(self, cuda_visible_devices: str | None) -> Topology:
        """The topology as CUDA sees it under ``CUDA_VISIBLE_DEVICES`` (with PCI-bus-ID ordering).

        Only the listed GPUs, numbered in the order listed. UUID or MIG entries cannot be matched to ``/sys``
        and leave the GPUs as they are."""
        if cuda_visible_devices is None:
            return self
        entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
        if not all(e.isdigit() for e in entries):
            return self
        by_index = {g.index: g for g in self.gpus}
        gpus = []
        for e in entries:
            if int(e) not in by_index:
                break  # CUDA ignores the rest of the list after an invalid entry
            gpus.append(replace(by_index[int(e)], index=len(gpus)))
        return replace(self, gpus=gpus)

    def to_dict(self) -> dict:
        return {
            "cpus": self.cpus,
            "packages": self.packages,
            "numa_nodes": self.numa_nodes,
            "gpus": [asdict(g) for g in self.gpus],
        }


def _read(path: Path, default: str = "") -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return default


def read_topology(sys_root: str | Path = "/sys") -> Topology:
    """Read the topology under ``sys_root`` (a fake tree in tests); missing parts fall back to one node."""
    root = Path(sys_root)
    cpu_dir = root / "devices" / "system" / "cpu"
    cpus = parse_cpulist(_read(cpu_dir / "online")) or sorted(
        int(p.name[3:]) for p in cpu_dir.glob("cpu[0-9]*")
    )
    package_of = {c: int(_read(cpu_dir / f"cpu{c}" / "topology" / "physical_package_id", "0")) for c in cpus}
    core_of = {c: int(_read(cpu_dir / f"cpu{c}" / "topology" / "core_id", str(c))) for c in cpus}
    numa_nodes = {
        int(p.name[4:]): [c for c in parse_cpulist(_read(p / "cpulist")) if c in cpus]
        for p in sorted((root / "devices" / "system" / "node").glob("node[0-9]*"))
    }
    numa_nodes = {n: c for n, c in numa_nodes.items() if c} or {0: list(cpus)}
    gpus = []
    for dev in sorted((root / "bus" / "pci" / "devices").glob("*")):
        if _read(dev / "vendor") != NVIDIA or not _read(dev / "class").startswith(DISPLAY_CLASSES):
            continue
        node = int(_read(dev / "numa_node", "-1"))
        node = node if node in numa_nodes else min(numa_nodes)
        local = [c for c in parse_cpulist(_read(dev / "local_cpulist")) if c in cpus] or numa_nodes[node]
        gpus.append(GPU(index=len(gpus), pci=dev.name, numa=node, cpus=local))
    return Topology(cpus, package_of, core_of, numa_nodes, gpus)


@dataclass
class Placement:
    rank: int
    numa: int
    cpus: list[int]
    gpu: int | None = None


def gpu_slots(ranks: int, gpus: int, ranks_per_gpu: int, where: str = "this node") -> list[int]:
    """Which of ``gpus`` GPUs each of ``ranks`` consecutive ranks uses.

    As few ranks per GPU as fit, at most ``ranks_per_gpu``. Raises ValueError, with the setting that would
    fit, when they do not."""
    assert gpus >= 1, "callers refuse a node without GPUs first"
    if ranks > gpus * ranks_per_gpu:
        raise ValueError(
            f"{ranks} ranks on {where} but {gpus} usable GPU(s) at hardware.ranks_per_gpu={ranks_per_gpu}: "
            f"they need {-(-ranks // ranks_per_gpu)}; lower devices, or let ranks share GPUs "
            f"(hardware.ranks_per_gpu={-(-ranks // gpus)})"
        )
    per_gpu = -(-ranks // gpus)
    return [r // per_gpu for r in range(ranks)]


def plan(
    topo: Topology,
    ranks: int,
    threads: int,
    use_gpus: bool = False,
    gpus: int | None = None,
    ranks_per_gpu: int = 1,
) -> list[Placement]:
    """Where each rank should run: its NUMA node, its ``threads`` cores and (with GPUs) its GPU.

    With GPUs (the first ``gpus`` of them, default all), the GPUs are taken in NUMA-node order (then PCI
    order; on the usual machine, whose GPUs are numbered node by node, rank r gets GPU r), as few
    consecutive ranks per GPU as fit (:func:`gpu_slots`), each rank with the next free cores of
    its GPU's NUMA node, so ranks fill the nodes in order, as ``--map-by ppr:K:numa`` places them. Without
    GPUs, ranks take consecutive cores of the NUMA nodes in order. Raises ValueError when the GPUs or cores
    do not suffice.
    """
    free = {node: list(cpus) for node, cpus in topo.numa_nodes.items()}
    by_node = sorted(topo.gpus[:gpus], key=lambda g: (g.numa, g.index))
    if use_gpus and not by_node:
        raise ValueError("hardware.device=cuda but no NVIDIA GPU was found under /sys/bus/pci")
    if use_gpus:
        by_node = [by_node[slot] for slot in gpu_slots(ranks, len(by_node), ranks_per_gpu)]
    placements = []
    for r in range(ranks):
        if use_gpus:
            gpu = by_node[r]
            node, gpu_index = gpu.numa, gpu.index
        else:
            node, gpu_index = next((n for n, c in free.items() if len(c) >= threads), None), None
            if node is None:
                raise ValueError(
                    f"{ranks} ranks × {threads} threads need more cores than the {len(topo.cpus)} here"
                )
        if len(free[node]) < threads:
            raise ValueError(
                f"NUMA node {node} has {len(free[node])} free cores left for rank {r}, which needs "
                f"{threads}; lower hardware.threads_per_rank"
            )
        cpus, free[node] = free[node][:threads], free[node][threads:]
        placements.append(Placement(r, node, cpus, gpu_index))
    return placements


def ranks_per_numa(placements: list[Placement]) -> int:
    """K of ``--map-by ppr:K:numa``: how many ranks share a NUMA node (it must be the same for all)."""
    counts: dict[int, int] = {}
    for p in placements:
        counts[p.numa] = counts.get(p.numa, 0) + 1
    return max(counts.values())


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(
        prog="python -m runner.hardware.topology", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--sys", default="/sys", help="root of the sysfs tree to read")
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    topo = read_topology(args.sys)
    if args.json:
        print(json.dumps(topo.to_dict(), indent=1))
        return
    print(f"{len(topo.cpus)} cpus in {len(topo.packages)} package(s), {len(topo.numa_nodes)} NUMA node(s)")
    for node, cpus in topo.numa_nodes.items():
        print(f"  numa {node}: cpus {cpus}")
    for g in topo.gpus:
        print(f"  gpu {g.index} ({g.pci}): numa {g.numa}, cpus {g.cpus}")
    if not topo.gpus:
        print("  no NVIDIA GPU")


if __name__ == "__main__":
    main()
