"""Emulated links against real ones (issue 35, item 2): one job's mean step time on 2 nodes of 1 rank whose
links are limited by ``tc tbf`` (network namespaces, tests/cluster/nodes.py), beside the same job on one
machine with ``simulate.ranks_per_node=1 simulate.link_gbps`` at the same rate.

    python benchmarks/links.py                  # bsp and diloco, 100 Mbit/s and 1 Gbit/s, MLP 3x1024, 3 runs
    python benchmarks/links.py --rules bsp --rates 100mbit --steps 30
    python benchmarks/links.py --tcp-put        # Open MPI's default TCP BTL flags, with its put (see TCP)
    python benchmarks/links.py --smoke          # bsp at 100 Mbit/s, the default MLP, a few steps
    python benchmarks/links.py --latency-ms 25 --rates 1gbit   # and 25 ms one way (50 ms round trip)
    python benchmarks/links.py --latency-ms 25 --rates 1gbit --set rule.bucket_mb=64   # overrides, both sides

``--latency-ms``: the real nodes are joined by the delaying forwarder (tests/cluster/delay.py, MTU 9000)
instead of a bridge, and the emulated side gets ``simulate.link_latency_ms`` at the same value.

The mean step time is taken over every step after the first three (DiLoCo exchanges every
``rule.inner_steps=4`` steps, so a median would miss its exchanges). Without root or network namespaces the
real side is left out, said in one line, and the emulated side is still measured.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner.hardware.mca import DEFAULT_MCA  # noqa: E402
from tests.cluster.conftest import mpitrain  # noqa: E402
from tests.cluster.nodes import Nodes, rate_bits, why_unsupported  # noqa: E402
from tests.conftest import Run, run_cli  # noqa: E402

#: The nodes share this machine's cores, and each binds its rank to "its" core 0: the same core, where two
#: ranks polling MPI take turns, and a transfer both ways at once took twice one way (plain TCP both ways:
#: 1.05x one way). Unbound, as on nodes with cores of their own: 1.02x.
UNBOUND = ["hardware.bind=none"]
#: Per rule: overrides that make it exchange within a short run.
RULES = {"bsp": [], "diloco": ["rule.inner_steps=4"], "gosgd": ["rule.p=0.5"]}
#: Open MPI's ring all-reduce, which the emulation prices (its default for 2 ranks took twice the ring's time
#: over 100 Mbit/s links: the buffer one way, then back).
RING = ["+hardware.mca.coll_tuned_use_dynamic_rules=1", "+hardware.mca.coll_tuned_allreduce_algorithm=4"]
#: Open MPI's TCP BTL without its emulated RDMA put, the runner's default (runner/hardware/mca.py,
#: DEFAULT_MCA: with put, the two directions of a ring step took turns; benchmarks/README.md); PUT: Open
#: MPI's own flags (adds put and hetero-rdma), for the comparison. ``++``: the key exists already.
TCP = [f"++hardware.mca.btl_tcp_flags={DEFAULT_MCA['btl_tcp_flags']}"]
PUT = ["++hardware.mca.btl_tcp_flags=315"]
#: The compared model: bandwidth-bound, 8.7 MB of float32 gradients (or parameters) an exchange.
MLP = ["model=mlp", "model.hidden=[1024,1024,1024]"]


def step_ms(run: Run) -> float:
    """The run's mean step time in milliseconds, the first three steps (start-up) left out."""
    if run.returncode != 0:
        raise RuntimeError(f"the job failed ({run.dir}):\n{run.output[-3000:]}")
    return statistics.fmean(r["step_ms"] for r in run.records("step")[3:])


def job(rule: str, model: list[str], steps: int, tcp: list[str] = TCP) -> list[str]:
    """The compared job's overrides (``tcp``: Open MPI's TCP options)."""
    return [
        f"rule={rule}",
        *RULES[rule],
        *RING,
        *tcp,
        *model,
        "devices=2",
        f"train.max_steps={steps}",
        "train.log_every=1",
    ]


def emulated(folder: Path, overrides: list[str], rate: str | None, latency_ms: float = 0.0) -> float:
    """Mean step ms on this machine, with links emulated at ``rate`` (None: none) and ``latency_ms``."""
    links = ["simulate.ranks_per_node=1"] if rate is not None or latency_ms else []
    if rate is not None:
        links.append(f"simulate.link_gbps={rate_bits(rate) / 1e9:g}")
    if latency_ms:
        links.append(f"simulate.link_latency_ms={latency_ms:g}")
    return step_ms(run_cli(folder, *overrides, *links, timeout=600))


def real(nodes: Nodes, folder: Path, overrides: list[str], rate: str | None) -> float:
    """Mean step ms on two nodes of one rank each, both nodes' egress limited to ``rate`` (None: free)."""
    for node in (0, 1):
        nodes.rate(node, rate)
    n1, n2 = nodes.names
    try:
        hosts = ["hardware=cluster", f"hardware.hosts=[{n1}:1,{n2}:1]", *UNBOUND]
        run = mpitrain(nodes, folder, *overrides, *hosts, timeout=600)
    finally:
        for node in (0, 1):
            nodes.rate(node, None)
    return step_ms(run)


def cell(
    nodes: Nodes | None, folder: Path, overrides: list[str], rate: str | None, repeats: int
) -> tuple[float | None, float]:
    """(real ms or None, emulated ms) of one job at one rate: medians over ``repeats`` runs of each side,
    the two alternating (``nodes`` None: the emulated side only)."""
    fakes, trues = [], []
    latency_ms = 0.0 if nodes is None or nodes.latency_ms is None else float(nodes.latency_ms)
    for k in range(repeats):
        fakes.append(emulated(folder / f"e{k}", overrides, rate, latency_ms))
        if nodes is not None:
            trues.append(real(nodes, folder / f"r{k}", overrides, rate))
        shown = f"{trues[-1]:.1f}" if trues else "-"
        load = f"load {os.getloadavg()[0]:.1f}"
        print(f"  {rate or 'free'}: real {shown} ms, emulated {fakes[-1]:.1f} ms ({load})", flush=True)
    return (statistics.median(trues) if trues else None), statistics.median(fakes)


def measure(args: argparse.Namespace, model: list[str]) -> list[tuple[str, str, float | None, float]]:
    """(rule, rate, real ms or None, emulated ms) for every rule and rate, the free links first."""
    reason = why_unsupported()
    if reason:
        print(f"real links left out: {reason}")
    rows = []
    nodes = None if reason else Nodes.up(2, latency_ms=args.latency_ms)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            free = [] if args.latency_ms else [None]  # (the emulation has no latency without a rate)
            for i, (rule, rate) in enumerate((r, s) for r in args.rules for s in [*free, *args.rates]):
                print(rule, flush=True)
                overrides = [*job(rule, model, args.steps, PUT if args.tcp_put else TCP), *args.set]
                true, fake = cell(nodes, Path(tmp) / str(i), overrides, rate, args.repeats)
                rows.append((rule, rate or "free", true, fake))
    finally:
        if nodes is not None:
            nodes.down()
    return rows


def table(rows: list[tuple[str, str, float | None, float]]) -> str:
    """The Markdown table: each rule and rate, real and emulated step ms and their ratio."""
    lines = [
        "| rule | link | real ms/step | emulated ms/step | emulated / real |",
        "| --- | --- | --- | --- | --- |",
    ]
    for rule, rate, true, fake in rows:
        ratio = "-" if true is None else f"{fake / true:.2f}"
        shown = "-" if true is None else f"{true:.1f}"
        lines.append(f"| {rule} | {rate} | {shown} | {fake:.1f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", default="bsp,diloco")
    parser.add_argument("--rates", default="100mbit,1gbit", help="tc rates, e.g. 100mbit,1gbit")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side per cell (medians)")
    parser.add_argument("--tcp-put", action="store_true", help="Open MPI's default TCP flags (PUT)")
    parser.add_argument("--smoke", action="store_true", help="bsp at 100 Mbit/s, the default MLP, 8 steps")
    parser.add_argument("--latency-ms", type=float, default=None, help="each node's one-way latency")
    parser.add_argument("--set", nargs="*", default=[], help="more overrides for both sides' jobs")
    args = parser.parse_args()
    args.rules, args.rates = args.rules.split(","), args.rates.split(",")
    model = MLP
    if args.smoke:
        args.rules, args.rates, args.steps, args.repeats, model = ["bsp"], ["100mbit"], 8, 1, ["model=mlp"]
    print(table(measure(args, model)))


if __name__ == "__main__":
    main()
