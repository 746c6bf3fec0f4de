"""Topology from fake /sys trees, the rank placement plan, and its mpirun arguments."""

from __future__ import annotations

from pathlib import Path

import pytest

from runner.hardware.cluster import ClusterConfig
from runner.hardware.cpu import CPUConfig
from runner.hardware.gpu import GPUConfig
from runner.hardware.mpirun import build_argv
from runner.hardware.topology import format_cpulist, gpu_slots, main, parse_cpulist, plan, read_topology


def fake_sys(root: Path, numa: dict[int, str], packages: dict[int, int], gpus=()) -> Path:
    """A sysfs tree: NUMA nodes {node: cpulist}, packages {cpu: package}, PCI devices (name, vendor, class,
    numa node, local cpulist)."""
    cpus = sorted(c for text in numa.values() for c in parse_cpulist(text))
    cpu_dir = root / "devices" / "system" / "cpu"
    for c in cpus:
        (cpu_dir / f"cpu{c}" / "topology").mkdir(parents=True)
        (cpu_dir / f"cpu{c}" / "topology" / "physical_package_id").write_text(f"{packages[c]}\n")
        (cpu_dir / f"cpu{c}" / "topology" / "core_id").write_text(f"{c}\n")
    (cpu_dir / "online").write_text(f"{cpus[0]}-{cpus[-1]}\n")
    for node, text in numa.items():
        (root / "devices" / "system" / "node" / f"node{node}").mkdir(parents=True)
        (root / "devices" / "system" / "node" / f"node{node}" / "cpulist").write_text(text + "\n")
    for name, vendor, cls, node, local in gpus:
        dev = root / "bus" / "pci" / "devices" / name
        dev.mkdir(parents=True)
        (dev / "vendor").write_text(vendor + "\n")
        (dev / "class").write_text(cls + "\n")
        (dev / "numa_node").write_text(f"{node}\n")
        (dev / "local_cpulist").write_text(local + "\n")
    return root


@pytest.fixture
def one_socket(tmp_path):
    return read_topology(fake_sys(tmp_path, {0: "0-3"}, {c: 0 for c in range(4)}))


@pytest.fixture
def two_sockets_four_gpus(tmp_path):
    """Two packages, one NUMA node each (cpus 0-7 and 8-15), two GPUs per node, plus devices to ignore."""
    gpus = [
        ("0000:1a:00.0", "0x10de", "0x030200", 0, "0-7"),
        ("0000:1b:00.0", "0x10de", "0x030000", 0, "0-7"),
        ("0000:1c:00.1", "0x10de", "0x040300", 0, "0-7"),  # the GPU's audio function
        ("0000:3a:00.0", "0x10de", "0x030200", 1, "8-15"),
        ("0000:3b:00.0", "0x10de", "0x030200", 1, "8-15"),
        ("0000:05:00.0", "0x1a03", "0x030000", 0, "0-7"),  # the board's VGA chip
    ]
    packages = {c: c // 8 for c in range(16)}
    return read_topology(fake_sys(tmp_path, {0: "0-7", 1: "8-15"}, packages, gpus))


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11] and parse_cpulist("") == []


def test_one_socket(one_socket):
    t = one_socket
    assert t.cpus == [0, 1, 2, 3] and t.packages == [0] and t.numa_nodes == {0: [0, 1, 2, 3]} and t.gpus == []
    placements = plan(t, ranks=2, threads=2)
    assert [p.cpus for p in placements] == [[0, 1], [2, 3]] and all(p.gpu is None for p in placements)
    with pytest.raises(ValueError, match="more cores"):
        plan(t, ranks=3, threads=2)
    with pytest.raises(ValueError, match="no NVIDIA GPU"):
        plan(t, ranks=1, threads=1, use_gpus=True)


def test_two_numa_nodes_four_gpus(two_sockets_four_gpus):
    t = two_sockets_four_gpus
    assert t.packages == [0, 1] and t.numa_nodes == {0: list(range(8)), 1: list(range(8, 16))}
    assert [(g.index, g.pci, g.numa) for g in t.gpus] == [
        (0, "0000:1a:00.0", 0),
        (1, "0000:1b:00.0", 0),
        (2, "0000:3a:00.0", 1),
        (3, "0000:3b:00.0", 1),
    ]
    placements = plan(t, ranks=4, threads=3, use_gpus=True)
    for r, p in enumerate(placements):
        assert p.gpu == r and p.numa == t.gpus[r].numa, "rank r runs on the NUMA node of GPU r"
        assert set(p.cpus) <= set(t.gpus[r].cpus) and len(p.cpus) == 3
    assert (
        placements[0].cpus == [0, 1, 2]
        and placements[1].cpus == [3, 4, 5]
        and placements[2].cpus == [8, 9, 10]
    )


def gpu_argv(placements, flavor: str) -> list[str]:
    """The launcher's command for ``placements`` of 4 ranks with hardware=gpu on the 16-core fake machine."""
    return build_argv(
        GPUConfig(),
        4,
        Path("/run"),
        mpirun="mpirun" if flavor == "openmpi" else "mpiexec",
        flavor=flavor,
        cores=16,
        as_root=False,
        python="python",
        placements=placements,
    )


def test_gpu_argv_maps_ranks_onto_their_gpus_numa_nodes(two_sockets_four_gpus):
    placements = plan(two_sockets_four_gpus, ranks=4, threads=4, use_gpus=True)
    argv = gpu_argv(placements, "openmpi")
    i = argv.index("--map-by")
    assert argv[i + 1] == "ppr:2:numa:pe=4" and argv[argv.index("--bind-to") + 1] == "core"
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in argv


def test_gpu_argv_for_mpich_binds_each_rank_to_its_planned_cores(two_sockets_four_gpus):
    placements = plan(two_sockets_four_gpus, ranks=4, threads=2, use_gpus=True)
    argv = gpu_argv(placements, "mpich")
    spec = argv[argv.index("-bind-to") + 1]
    assert spec.startswith("user:") and "-map-by" not in argv
    per_rank = [parse_cpulist(s.replace("+", ",")) for s in spec[len("user:") :].split(",")]
    assert per_rank == [p.cpus for p in placements]
    nodes = two_sockets_four_gpus.numa_nodes
    for r, cpus in enumerate(per_rank):
        gpu = two_sockets_four_gpus.gpus[placements[r].gpu]
        assert set(cpus) <= set(nodes[gpu.numa]), f"rank {r} is not on the NUMA node of its GPU"
    assert argv[argv.index("CUDA_DEVICE_ORDER") + 1] == "PCI_BUS_ID"


@pytest.mark.parametrize("cpus", [[0], [0, 1, 2, 3], [0, 2, 3, 4, 9], [5, 1, 2]])
def test_cpulists_round_trip(cpus):
    assert parse_cpulist(format_cpulist(cpus)) == sorted(cpus)
    assert format_cpulist([0, 1, 2, 3, 8, 10, 11]) == "0-3,8,10-11"


def test_interleaved_gpus_are_taken_node_by_node(tmp_path):
    """GPUs numbered across nodes alternately: ranks still fill node 0 first, each next to its GPU."""
    gpus = [
        (f"0000:{b}:00.0", "0x10de", "0x030200", node, "0-3" if node == 0 else "4-7")
        for b, node in (("1a", 0), ("2a", 1), ("3a", 0), ("4a", 1))
    ]
    t = read_topology(fake_sys(tmp_path, {0: "0-3", 1: "4-7"}, {c: c // 4 for c in range(8)}, gpus))
    placements = plan(t, ranks=4, threads=1, use_gpus=True)
    assert [p.numa for p in placements] == [0, 0, 1, 1]
    assert [p.gpu for p in placements] == [0, 2, 1, 3]
    assert all(t.gpus[p.gpu].numa == p.numa for p in placements)


def test_ranks_share_gpus_only_when_asked(two_sockets_four_gpus):
    with pytest.raises(ValueError, match="hardware.ranks_per_gpu=2"):
        plan(two_sockets_four_gpus, ranks=8, threads=2, use_gpus=True)
    placements = plan(two_sockets_four_gpus, ranks=8, threads=2, use_gpus=True, ranks_per_gpu=2)
    assert [p.gpu for p in placements] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(two_sockets_four_gpus.gpus[p.gpu].numa == p.numa for p in placements)
    spread = plan(two_sockets_four_gpus, ranks=4, threads=2, use_gpus=True, ranks_per_gpu=2)
    assert [p.gpu for p in spread] == [0, 1, 2, 3], "sharing is a limit, not a packing"


def test_gpus_per_node_limits_the_gpus_used(two_sockets_four_gpus):
    placements = plan(two_sockets_four_gpus, ranks=2, threads=2, use_gpus=True, gpus=2)
    assert [p.gpu for p in placements] == [0, 1]
    with pytest.raises(ValueError, match="but 2 usable GPU"):
        plan(two_sockets_four_gpus, ranks=3, threads=2, use_gpus=True, gpus=2)


def test_cuda_visible_devices_renumber_the_gpus(two_sockets_four_gpus):
    t = two_sockets_four_gpus
    seen = t.visible("3,1")
    assert [(g.index, g.pci) for g in seen.gpus] == [(0, t.gpus[3].pci), (1, t.gpus[1].pci)]
    assert [g.numa for g in seen.gpus] == [t.gpus[3].numa, t.gpus[1].numa]
    assert len(t.visible("0,9,1").gpus) == 1, "CUDA stops at the first invalid entry"
    assert t.visible(None) is t and t.visible("GPU-5f1c").gpus == t.gpus


def test_this_machine_and_the_command(capsys):
    t = read_topology()
    assert t.cpus and sum(len(c) for c in t.numa_nodes.values()) == len(t.cpus)
    main([])
    assert "NUMA node" in capsys.readouterr().out


@pytest.mark.parametrize(
    "local_size, gpus, per_gpu, expected",
    [(4, 4, 1, [0, 1, 2, 3]), (2, 4, 1, [0, 1]), (8, 4, 2, [0, 0, 1, 1, 2, 2, 3, 3]), (3, 2, 2, [0, 0, 1])],
)
def test_gpu_of_each_local_rank_without_a_plan(local_size, gpus, per_gpu, expected):
    assert gpu_slots(local_size, gpus, per_gpu) == expected


def test_too_many_ranks_for_a_nodes_gpus_fail_with_a_hint():
    with pytest.raises(ValueError, match="5 ranks on .* 2 usable GPU.*ranks_per_gpu=2"):
        gpu_slots(5, 2, 2, "node7")


@pytest.fixture
def this_machine(monkeypatch):
    """Call with a Topology and a core count: the launcher then sees that machine instead of this one."""
    import runner.hardware.base

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)

    def become(topo, cores: int) -> None:
        monkeypatch.setattr(runner.hardware.base, "read_topology", lambda: topo)
        monkeypatch.setattr(runner.hardware.base, "usable_cores", lambda: cores)

    return become


def test_hardware_gpu_plans_its_ranks_onto_this_machines_gpus(this_machine, two_sockets_four_gpus):
    this_machine(two_sockets_four_gpus, 16)
    launch = GPUConfig(flavor="openmpi").plan_launch(4, Path("/run"))
    assert [p.gpu for p in launch.placements] == [0, 1, 2, 3] and launch.threads == 4
    assert launch.launcher == "mpirun" and launch.bind == "numa"
    assert launch.argv[launch.argv.index("--map-by") + 1] == "ppr:2:numa:pe=4"
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in launch.argv
    sharing = GPUConfig(flavor="openmpi", gpus_per_node=1, ranks_per_gpu=2, threads_per_rank=4)
    shared = sharing.plan_launch(2, Path("/run"))
    assert [p.gpu for p in shared.placements] == [0, 0]
    with pytest.raises(ValueError, match="hardware.ranks_per_gpu=2"):
        GPUConfig(flavor="openmpi").plan_launch(8, Path("/run"))


def test_hardware_gpu_honours_cuda_visible_devices(this_machine, two_sockets_four_gpus, monkeypatch):
    this_machine(two_sockets_four_gpus, 16)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    launch = GPUConfig(flavor="openmpi", threads_per_rank=4).plan_launch(2, Path("/run"))
    assert [(p.gpu, p.numa) for p in launch.placements] == [(0, 1), (1, 1)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES='' hides every GPU.*hardware=cpu"):
        GPUConfig(flavor="openmpi").plan_launch(2, Path("/run"))


def test_cuda_without_an_nvidia_gpu_is_refused_before_launch(this_machine, one_socket):
    this_machine(one_socket, 4)
    with pytest.raises(ValueError, match="hardware.device='cuda'.*no NVIDIA GPU.*use hardware=cpu"):
        GPUConfig(flavor="openmpi").plan_launch(2, Path("/run"))
    cluster = ClusterConfig(device="cuda", flavor="openmpi", hosts=["node1:2", "node2:2"])
    assert cluster.plan_launch(4, Path("/run")).placements is None, "other hosts: no plan, no refusal"
    # hardware=cpu with hardware.device=cuda, as the launcher plans it (reserving cores): refused alike, not
    # found by rank 0 after the start
    with pytest.raises(ValueError, match="hardware.device='cuda'.*no NVIDIA GPU.*use hardware=cpu"):
        CPUConfig(device="cuda", flavor="openmpi").plan_launch(4, Path("/run"), reserve=True)


def test_prepare_writes_the_gpu_plan(this_machine, two_sockets_four_gpus, tmp_path):
    import json

    from runner.launcher.launch import prepare
    from tests.conftest import compose_config

    this_machine(two_sockets_four_gpus, 16)
    argv = prepare(compose_config(["hardware=gpu", "devices=4", "hardware.flavor=openmpi"]), tmp_path)
    planned = json.loads((tmp_path / "plan.json").read_text())
    assert [(p["rank"], p["gpu"], p["numa"]) for p in planned] == [(0, 0, 0), (1, 1, 0), (2, 2, 1), (3, 3, 1)]
    assert "ppr:2:numa:pe=4" in argv
