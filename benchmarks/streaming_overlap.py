"""Streaming DiLoCo's exchange hidden behind training (issue 36): each rule's mean step time with emulated
links (``simulate.ranks_per_node=1 simulate.link_gbps``) over its time with free links, in the same run.

    python benchmarks/streaming_overlap.py                   # 4 workers, digits CNN, 0.1 Gbit/s, 3 repeats
    python benchmarks/streaming_overlap.py --gbps 0.01 --repeats 5
    python benchmarks/streaming_overlap.py --smoke           # Streaming DiLoCo, 2 workers, a few steps, once

Streaming DiLoCo starts each fragment's all-reduce on its background thread and applies it ``rule.delay``
steps later, so a link that is slow but not too slow costs it nothing; DiLoCo's all-reduce, at its round
ends, waits for the link. The free and linked jobs of a rule alternate, repeat by repeat, so that the load
of the machine falls on both alike; each repeat's mean step time is over every step after the first three.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.conftest import Run, run_cli  # noqa: E402

#: The compared rules, with what makes them exchange within a short run.
RULES = {
    "streaming_diloco": ["rule=streaming_diloco", "rule.inner_steps=8", "rule.quantize=int8"],
    "diloco": ["rule=diloco", "rule.inner_steps=8"],
}


def step_ms(run: Run) -> float:
    """The run's mean step time in milliseconds, the first three steps (start-up) left out."""
    if run.returncode != 0:
        raise RuntimeError(f"the job failed ({run.dir}):\n{run.output[-3000:]}")
    return statistics.fmean(r["step_ms"] for r in run.records("step")[3:])


def measure(args: argparse.Namespace) -> list[tuple[str, float, float]]:
    """(rule, median free ms, median linked ms) per rule."""
    rows = []
    links = ["simulate.ranks_per_node=1", f"simulate.link_gbps={args.gbps:g}"]
    base = [
        f"devices={args.devices}",
        "hardware.oversubscribe=true",
        f"train.max_steps={args.steps}",
        "train.log_every=1",
        "train.val_every=1000",
        "logger=[]",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for rule in args.rules:
            free, linked = [], []
            for i in range(args.repeats):
                free.append(step_ms(run_cli(Path(tmp) / f"{rule}f{i}", *base, *RULES[rule], timeout=600)))
                run = run_cli(Path(tmp) / f"{rule}l{i}", *base, *RULES[rule], *links, timeout=600)
                linked.append(step_ms(run))
                print(
                    f"  {rule} #{i}: free {free[-1]:.2f} ms, {args.gbps:g} Gbit/s {linked[-1]:.2f} ms",
                    flush=True,
                )
            rows.append((rule, statistics.median(free), statistics.median(linked)))
    return rows


def table(rows: list[tuple[str, float, float]], gbps: float) -> str:
    """The Markdown table: each rule's step ms with free and emulated links, and their ratio."""
    lines = [
        f"| rule | free ms/step | {gbps:g} Gbit/s ms/step | linked / free |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {rule} | {free:.2f} | {linked:.2f} | {linked / free:.2f} |" for rule, free, linked in rows]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rules", default="streaming_diloco,diloco")
    parser.add_argument("--gbps", type=float, default=0.1)
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="Streaming DiLoCo, 2 workers, 12 steps")
    args = parser.parse_args()
    args.rules = args.rules.split(",")
    if args.smoke:
        args.rules, args.devices, args.steps, args.repeats = ["streaming_diloco"], 2, 12, 1
    print(table(measure(args), args.gbps))


if __name__ == "__main__":
    main()
