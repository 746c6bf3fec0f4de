"""Scaling model: BSP's step time and efficiency at 8 GPUs per node on 1-64 nodes, staged MPI against NCCL.

    python benchmarks/scaling_model.py                        # every table (docs/scaling.md pastes them)
    python benchmarks/scaling_model.py --nodes 1 --tables steps
    python benchmarks/scaling_model.py --inputs lent_h100.json --models resnet50
    python benchmarks/scaling_model.py --smoke                # AlexNet's 8-GPU rows only

No measurement runs here: the script computes, from measured and published inputs (:data:`INPUTS`, each
with its value, unit and source; ``--inputs FILE.json`` replaces any of them), one BSP step of a GPU that
keeps its per-GPU batch (weak scaling) on ``P = G·n`` GPUs, ``G`` per node, ``n`` nodes::

    T_step = T_c + max(0, T_comm - o·b·T_c)      efficiency = T_c / T_step
    ring(S, N, B, α) = 2(N-1)/N · S/B + 2(N-1)·α

``T_c`` compute per step, ``b`` the backward's share of it, ``o`` 1 with overlap, 0 without. ``S`` the
gradient's bytes (16-bit exchange: half), ``B`` a bus bandwidth, ``α`` a hop's latency. The exchanges:

* NCCL: ``ring(S, G, B_nvlink, α_nvlink) + ring(S/G, n, B_ib, α_ib)``: reduce-scatter and all-gather over
  NVLink, and between them an all-reduce of each GPU's ``S/G`` over its own InfiniBand port.
* staged MPI: ``2·S/B_pcie + ring(S, P, B_host, α)``: device to host and back over PCIe, and the host
  all-reduce at ``B_host`` (one node; over several, ``min(B_host, B_ib)`` and ``α_ib``).

The asynchronous rules' point-to-point messages (a push of the whole model, ``S``: GoSGD, or ASGD with
one server), per message (``p2p``)::

    staged MPI: 2·S/B_pcie + S/B + α_host        B = B_host on one node, min(B_host, B_ib) across nodes
    NCCL:       α_host + S/B' + α                 an MPI message saying who sends, then a matched send/recv
                                                  over NVLink (B' = B_nvlink, α_nvlink) or IB (B_ib, α_ib)

``B_host`` comes from the measured job: ``R`` ranks (``R_gpu`` of them sharing one GPU and its PCIe link)
take ``k = 5120/(R·batch)`` steps each for 5,120 images, so its communication per step is ``t = comm_s/k``;
less the copies ``2·R_gpu·S/B_pcie`` and the hops ``2(R-1)·α_host``, the rest is the host all-reduce, and
``B_host = 2(R-1)/R · S / rest`` (at R = 2 the factor is 1: the model's MB per second of host time). The
measured time is the exposed part only (the runner overlaps on a GPU), so ``B_host`` is an upper bound and
the staged rows are, if anything, optimistic.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

IMAGES = 5120
MODELS = ("alexnet", "resnet50")
NODES = (1, 2, 4, 8, 16, 32, 64)
TABLES = ("inputs", "steps", "scaling", "p2p", "published")
#: exchange name: (path, bytes per value sent)
EXCHANGES = {"staged MPI fp32": ("staged", 4), "NCCL fp32": ("nccl", 4), "NCCL bf16": ("nccl", 2)}
#: --smoke: the arguments it stands for.
SMOKE = {"models": ["alexnet"], "nodes": [1], "tables": ["steps"]}

H100 = "lent H100, 2 ranks on it (FIELD-NOTES)"
H100_R50 = "lent H100, same job (issue 22; not in FIELD-NOTES)"


@dataclass(frozen=True)
class Input:
    """One input of the model: its value, unit and where it was measured or published."""

    value: float
    unit: str
    source: str


INPUTS: dict[str, Input] = {
    "alexnet_compute_s": Input(0.23, "s / 5,120 img", H100),
    "alexnet_comm_s": Input(3.14, "s / 5,120 img", H100 + ", exposed"),
    "resnet50_compute_s": Input(1.33, "s / 5,120 img", H100_R50),
    "resnet50_comm_s": Input(1.05, "s / 5,120 img", H100_R50 + ", exposed"),
    "measured_ranks": Input(2, "ranks", "the measured job's ranks"),
    "measured_ranks_per_gpu": Input(2, "ranks", "of them on one GPU and its PCIe link"),
    "alexnet_batch": Input(128, "images", "per rank, images_per_5120.py's BATCH"),
    "resnet50_batch": Input(64, "images", "per rank, images_per_5120.py's BATCH"),
    "alexnet_params_m": Input(61.1, "M fp32", "runner's AlexNet, 1000 classes"),
    "resnet50_params_m": Input(25.6, "M fp32", "runner's ResNet-50, 1000 classes"),
    "gpus_per_node": Input(8, "GPUs", "DGX H100 node"),
    "nvlink_bus_gbps": Input(370, "GB/s", "NCCL ring busBw, 8 H100 SXM (nccl-tests issue 212)"),
    "pcie_gbps": Input(53, "GB/s", "PCIe 5 x16, each way, effective (64 peak); on paper"),
    "ib_gbps": Input(50, "GB/s", "IB NDR 400 Gb/s line rate, a port per GPU (DGX H100)"),
    "alpha_nvlink_us": Input(1, "µs / hop", "assumed"),
    "alpha_ib_us": Input(5, "µs / hop", "assumed"),
    "alpha_host_us": Input(2, "µs / hop", "small MPI message (FIELD-NOTES)"),
    "backward_fraction": Input(2 / 3, "of compute", "assumed: backward = 2 × forward"),
}


def load_inputs(overrides: dict | None = None, where: str = "--inputs") -> dict[str, Input]:
    """:data:`INPUTS` with ``overrides`` (key: number, or {"value": number, "source": text}) applied."""
    inputs = dict(INPUTS)
    for key, given in (overrides or {}).items():
        if key not in INPUTS:
            raise ValueError(f"unknown input {key!r} in {where}; valid keys: {', '.join(sorted(INPUTS))}")
        value, source = (
            (given.get("value"), given.get("source", where)) if isinstance(given, dict) else (given, where)
        )
        least = 0 if key.startswith("alpha_") else sys.float_info.min  # latencies may be 0, nothing else
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < least:
            bound = ">= 0" if least == 0 else "> 0"
            raise ValueError(f"input {key!r} in {where} must be a number {bound}, not {value!r}")
        inputs[key] = Input(float(value), INPUTS[key].unit, str(source))
    return inputs


def read_inputs(path: Path) -> dict[str, Input]:
    """:func:`load_inputs` from a JSON file holding one object."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object of input: value")
    return load_inputs(data, where=str(path))


def ring_allreduce_s(size_mb: float, ranks: int, bus_gbps: float, alpha_us: float) -> float:
    """Seconds of a ring all-reduce of ``size_mb`` MB over ``ranks``: 2(N-1)/N · S/B + 2(N-1)·α."""
    if ranks <= 1:
        return 0.0
    return 2 * (ranks - 1) / ranks * size_mb / (1e3 * bus_gbps) + 2 * (ranks - 1) * alpha_us * 1e-6


def derived(inputs: dict[str, Input], model: str) -> dict[str, float]:
    """Per-step compute and communication of the measured job, the gradient's MB and ``B_host``."""
    v = {key: i.value for key, i in inputs.items()}
    ranks, per_gpu = int(v["measured_ranks"]), v["measured_ranks_per_gpu"]
    if ranks < 2:
        raise ValueError("measured_ranks must be 2 or more: one rank exchanges nothing")
    steps = IMAGES / (ranks * v[f"{model}_batch"])
    size_mb = 4 * v[f"{model}_params_m"]
    comm = v[f"{model}_comm_s"] / steps
    copies = 2 * per_gpu * size_mb / (1e3 * v["pcie_gbps"])
    rest = comm - copies - 2 * (ranks - 1) * v["alpha_host_us"] * 1e-6
    if rest <= 0:
        raise ValueError(
            f"{model}: the measured communication ({1e3 * comm:.2f} ms/step) is no more than its PCIe copies"
        )
    host_gbps = 2 * (ranks - 1) / ranks * size_mb / (1e3 * rest)
    return {
        "steps": steps,
        "compute_s": v[f"{model}_compute_s"] / steps,
        "comm_s": comm,
        "size_mb": size_mb,
        "copies_s": copies,
        "host_gbps": host_gbps,
    }


def comm_s(inputs: dict[str, Input], model: str, exchange: str, nodes: int) -> float:
    """Seconds of one step's gradient exchange on ``nodes`` nodes by ``exchange`` (:data:`EXCHANGES`)."""
    v = {key: i.value for key, i in inputs.items()}
    path, width = EXCHANGES[exchange]
    d = derived(inputs, model)
    size = d["size_mb"] * width / 4
    gpus = int(v["gpus_per_node"])
    if path == "nccl":
        intra = ring_allreduce_s(size, gpus, v["nvlink_bus_gbps"], v["alpha_nvlink_us"])
        return intra + ring_allreduce_s(size / gpus, nodes, v["ib_gbps"], v["alpha_ib_us"])
    bus, alpha = d["host_gbps"], v["alpha_host_us"]
    if nodes > 1:  # the flat ring's slowest hops cross InfiniBand
        bus, alpha = min(bus, v["ib_gbps"]), v["alpha_ib_us"]
    return 2 * size / (1e3 * v["pcie_gbps"]) + ring_allreduce_s(size, gpus * nodes, bus, alpha)


def step_s(compute: float, comm: float, backward_fraction: float, overlap: bool) -> float:
    """T_c + max(0, T_comm - o·b·T_c): the communication left exposed after backward's share."""
    return compute + max(0.0, comm - (backward_fraction * compute if overlap else 0.0))


def rows(inputs: dict[str, Input], models: list[str], nodes: list[int]) -> list[dict]:
    """A row per model, exchange and node count: T_comm, step time and efficiency without and with overlap."""
    b = inputs["backward_fraction"].value
    out = []
    for model in models:
        compute = derived(inputs, model)["compute_s"]
        for exchange in EXCHANGES:
            for n in nodes:
                comm = comm_s(inputs, model, exchange, n)
                off, on = step_s(compute, comm, b, False), step_s(compute, comm, b, True)
                out.append(
                    {
                        "model": model,
                        "exchange": exchange,
                        "nodes": n,
                        "gpus": n * int(inputs["gpus_per_node"].value),
                        "compute_ms": 1e3 * compute,
                        "comm_ms": 1e3 * comm,
                        "step_ms_off": 1e3 * off,
                        "eff_off": compute / off,
                        "step_ms_on": 1e3 * on,
                        "eff_on": compute / on,
                    }
                )
    return out


def p2p_rows(inputs: dict[str, Input], models: list[str]) -> list[dict]:
    """One push of the whole fp32 model between two GPUs, on one node and across two: staged MPI against an
    MPI control message and a matched NCCL send/recv; each also as a multiple of a step's compute."""
    v = {key: i.value for key, i in inputs.items()}
    control = v["alpha_host_us"] * 1e-6  # the MPI message (staged: the payload's own latency)
    out = []
    for model in models:
        d = derived(inputs, model)
        size, host = d["size_mb"], d["host_gbps"]
        for where, link, alpha, host_bus in (
            ("one node", v["nvlink_bus_gbps"], v["alpha_nvlink_us"], host),
            ("two nodes", v["ib_gbps"], v["alpha_ib_us"], min(host, v["ib_gbps"])),
        ):
            staged = 2 * size / (1e3 * v["pcie_gbps"]) + size / (1e3 * host_bus) + control
            nccl = control + size / (1e3 * link) + alpha * 1e-6
            out.append(
                {
                    "model": model,
                    "where": where,
                    "size_mb": size,
                    "staged_ms": 1e3 * staged,
                    "nccl_ms": 1e3 * nccl,
                    "compute_ms": 1e3 * d["compute_s"],
                }
            )
    return out


def p2p_table(table: list[dict]) -> str:
    """Per message: staged against NCCL, in ms and in steps of compute."""
    body = [
        [
            r["model"],
            r["where"],
            f"{r['size_mb']:.1f}",
            f"{r['staged_ms']:.2f}",
            f"{r['staged_ms'] / r['compute_ms']:.2f}",
            f"{r['nccl_ms']:.3f}",
            f"{r['nccl_ms'] / r['compute_ms']:.3f}",
            f"{r['staged_ms'] / r['nccl_ms']:.0f}×",
        ]
        for r in table
    ]
    header = ["model", "between", "MB", "staged ms", "× T_c", "NCCL ms", "× T_c", "staged / NCCL"]
    return markdown(header, body)


def markdown(header: list[str], body: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in body])


def inputs_table(inputs: dict[str, Input], models: list[str]) -> str:
    """Every input with its value, unit and source, then the values derived from them per model."""
    body = [[f"`{key}`", f"{i.value:g}", i.unit, i.source] for key, i in inputs.items()]
    for model in models:
        d = derived(inputs, model)
        body += [
            [f"{model}: steps", f"{d['steps']:g}", "per rank", "5120 / (measured_ranks · batch)"],
            [f"{model}: T_c", f"{1e3 * d['compute_s']:.2f}", "ms / step", "compute_s / steps"],
            [f"{model}: S", f"{d['size_mb']:.1f}", "MB", "4 bytes · params (fp32)"],
            [f"{model}: staged comm", f"{1e3 * d['comm_s']:.2f}", "ms / step", "comm_s / steps (exposed)"],
            [f"{model}: B_host", f"{d['host_gbps']:.2f}", "GB/s", "staged comm less copies and hops"],
        ]
    return markdown(["input", "value", "unit", "measured or published where"], body)


def steps_table(table: list[dict]) -> str:
    """Step time and efficiency per row, without and with overlap of backward."""
    body = [
        [
            r["model"],
            r["exchange"],
            str(r["nodes"]),
            str(r["gpus"]),
            f"{r['compute_ms']:.2f}",
            f"{r['comm_ms']:.2f}",
            f"{r['step_ms_off']:.2f}",
            f"{100 * r['eff_off']:.1f}",
            f"{r['step_ms_on']:.2f}",
            f"{100 * r['eff_on']:.1f}",
        ]
        for r in table
    ]
    header = [
        "model",
        "exchange",
        "nodes",
        "GPUs",
        "T_c ms",
        "T_comm ms",
        "step ms, no overlap",
        "eff. %",
        "step ms, overlap",
        "eff. %",
    ]
    return markdown(header, body)


def pct(fraction: float) -> str:
    """A percentage: one decimal below 10%, none above."""
    return f"{100 * fraction:.1f}" if fraction < 0.1 else f"{100 * fraction:.0f}"


def scaling_table(table: list[dict]) -> str:
    """Efficiency per model and exchange (rows) and node count (columns): without–with overlap, in %."""
    cells: dict[tuple[str, str], list[str]] = {}
    columns: dict[int, int] = {}
    for r in table:
        cells.setdefault((r["model"], r["exchange"]), []).append(f"{pct(r['eff_off'])}–{pct(r['eff_on'])}")
        columns[r["nodes"]] = r["gpus"]
    body = [[model, exchange, *effs] for (model, exchange), effs in cells.items()]
    return markdown(["model", "exchange", *(f"{n} ({g} GPUs)" for n, g in columns.items())], body)


#: Published scaling: system, hardware, model, one GPU, N GPUs, speed-up, efficiency, source.
PUBLISHED = [
    ["Theano-MPI", "8 K80", "AlexNet-128b", "20.50 s", "2.63 + 0.61 s", "6.3×", "79%", "FIELD-NOTES"],
    ["Theano-MPI", "8 K80", "GoogLeNet-32b", "63.89 s", "7.69 + 0.80 s", "7.5×", "94%", "FIELD-NOTES"],
    ["Theano-MPI", "8 K80", "VGG16-32b", "343.37 s", "43.29 + 5.41 s", "7.1×", "88%", "FIELD-NOTES"],
    ["Theano-MPI", "8 K80", "ResNet50-64b", "163.15 s", "20.12 + 0.57 s", "7.9×", "99%", "FIELD-NOTES"],
    ["Platoon EASGD", "4", "LSTM", "", "", "3.42×", "86%", "FIELD-NOTES"],
    ["Horovod", "128 Pascal, 25 GbE TCP", "Inception V3, ResNet-101", "", "", "", "88%", "arXiv 1802.05799"],
    ["Horovod", "512 Pascal, 25 Gb/s RoCE", "Inception V3, ResNet-101", "", "", "", "90%", "Horovod README"],
    ["Horovod", "512 Pascal, 25 Gb/s RoCE", "VGG-16", "", "", "", "68%", "Horovod README"],
]


def published_table() -> str:
    """The seeds' (Theano-MPI: seconds per 5,120 images, compute + comm) and Horovod's published scaling."""
    header = ["system", "GPUs", "model", "1 GPU", "N GPUs", "speed-up", "efficiency", "source"]
    return markdown(header, PUBLISHED)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``--smoke`` stands for :data:`SMOKE`."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument(
        "--nodes",
        nargs="+",
        type=int,
        default=list(NODES),
        help="node counts (gpus_per_node GPUs each, 8 unless --inputs says)",
    )
    p.add_argument("--tables", nargs="+", default=list(TABLES), choices=TABLES, help="which tables to print")
    p.add_argument(
        "--inputs", type=Path, help="JSON object {input: value} replacing inputs (its keys are listed below)"
    )
    fmt = p.add_mutually_exclusive_group()
    fmt.add_argument("--markdown", action="store_true", help="Markdown tables (the default)")
    fmt.add_argument("--json", action="store_true", help="the inputs and rows as JSON")
    p.add_argument("--smoke", action="store_true", help="AlexNet on one node of 8 GPUs, the steps table only")
    p.epilog = "input keys: " + ", ".join(INPUTS)
    args = p.parse_args(argv)
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    if any(n < 1 for n in args.nodes):
        p.error("--nodes: counts of 1 or more")
    return args


def main(argv: list[str] | None = None) -> int:
    """Print the tables (or JSON) for the chosen models and node counts."""
    args = parse(argv)
    try:
        inputs = read_inputs(args.inputs) if args.inputs else load_inputs()
        table = rows(inputs, args.models, args.nodes)
    except (OSError, ValueError) as e:
        print(f"scaling_model.py: {e}", file=sys.stderr)
        return 2
    if args.json:
        everything = {"inputs": {k: vars(i) for k, i in inputs.items()}, "rows": table}
        print(json.dumps({**everything, "p2p": p2p_rows(inputs, args.models)}, indent=1))
        return 0
    sections = {
        "inputs": lambda: inputs_table(inputs, args.models),
        "steps": lambda: steps_table(table),
        "scaling": lambda: scaling_table(table),
        "p2p": lambda: p2p_table(p2p_rows(inputs, args.models)),
        "published": published_table,
    }
    print("\n\n".join(sections[name]() for name in args.tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
