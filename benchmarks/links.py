"""Emulated links against real ones (issue 35, item 2): one job's mean step time on 2 nodes of 1 rank whose
links are limited by ``tc tbf`` (network namespaces, tests/cluster/nodes.py), beside the same job on one
machine with ``simulate.ranks_per_node=1 simulate.link_gbps`` at the same rate.

    python benchmarks/links.py                  # bsp and diloco, 100 Mbit/s and 1 Gbit/s, the MLP 3x1024
    python benchmarks/links.py --rules bsp --rates 100mbit --steps 30
    python benchmarks/links.py --smoke          # bsp at 100 Mbit/s, the default MLP, a few steps

The mean step time is taken over every step after the first three (DiLoCo exchanges every
``rule.inner_steps=4`` steps, so a median would miss its exchanges). Without root or network namespaces the
real side is left out, said in one line, and the emulated side is still measured.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster.conftest import mpitrain  # noqa: E402
from tests.cluster.nodes import Nodes, rate_bits, why_unsupported  # noqa: E402
from tests.conftest import Run, run_cli  # noqa: E402

#: The nodes share this machine's cores, and each binds its rank to "its" core 0: the same core, where two
#: ranks polling MPI take turns, and a transfer both ways at once took twice one way (plain TCP both ways:
#: 1.05x one way). Unbound, as on nodes with cores of their own: 1.02x.
UNBOUND = ["hardware.bind=none"]
#: Per rule: overrides that make it exchange within a short run.
RULES = {"bsp": [], "diloco": ["rule.inner_steps=4"]}
#: Open MPI's ring all-reduce, which the emulation prices (its default for 2 ranks took twice the ring's time
#: over 100 Mbit/s links: the buffer one way, then back).
RING = ["+hardware.mca.coll_tuned_use_dynamic_rules=1", "+hardware.mca.coll_tuned_allreduce_algorithm=4"]


def step_ms(run: Run) -> float:
    """The run's mean step time in milliseconds, the first three steps (start-up) left out."""
    if run.returncode != 0:
        raise RuntimeError(f"the job failed ({run.dir}):\n{run.output[-3000:]}")
    return statistics.fmean(r["step_ms"] for r in run.records("step")[3:])


def job(rule: str, model: list[str], steps: int) -> list[str]:
    """The compared job's overrides."""
    return [
        f"rule={rule}",
        *RULES[rule],
        *RING,
        *model,
        "devices=2",
        f"train.max_steps={steps}",
        "train.log_every=1",
    ]


def emulated(folder: Path, overrides: list[str], rate: str | None) -> float:
    """Mean step ms on this machine, with links emulated at ``rate`` (None: none)."""
    links = (
        [] if rate is None else ["simulate.ranks_per_node=1", f"simulate.link_gbps={rate_bits(rate) / 1e9:g}"]
    )
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


def measure(args: argparse.Namespace, model: list[str]) -> list[tuple[str, str, float | None, float]]:
    """(rule, rate, real ms or None, emulated ms) for every rule and rate, the free links first."""
    reason = why_unsupported()
    if reason:
        print(f"real links left out: {reason}")
    rows = []
    nodes = None if reason else Nodes.up(2)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for i, (rule, rate) in enumerate((r, s) for r in args.rules for s in [None, *args.rates]):
                overrides = job(rule, model, args.steps)
                fake = emulated(Path(tmp) / f"e{i}", overrides, rate)
                true = None if nodes is None else real(nodes, Path(tmp) / f"r{i}", overrides, rate)
                rows.append((rule, rate or "free", true, fake))
                shown = "-" if true is None else f"{true:.1f}"
                print(f"  {rule} {rate or 'free'}: real {shown} ms, emulated {fake:.1f} ms", flush=True)
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
    parser.add_argument("--smoke", action="store_true", help="bsp at 100 Mbit/s, the default MLP, 8 steps")
    args = parser.parse_args()
    args.rules, args.rates = args.rules.split(","), args.rates.split(",")
    model = ["model=mlp", "model.hidden=[1024,1024,1024]"]
    if args.smoke:
        args.rules, args.rates, args.steps, model = ["bsp"], ["100mbit"], 8, ["model=mlp"]
    print(table(measure(args, model)))


if __name__ == "__main__":
    main()
