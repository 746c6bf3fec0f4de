"""Time to accuracy of every rule on the same job, with static shards and dynamic assignment, without and
with a straggler, against BSP measured in the same run.

    python benchmarks/time_to_accuracy.py                        # CNN on digits, 4 workers, target 95%
    python benchmarks/time_to_accuracy.py --straggler-ms 16 --straggler-rank 3 --repeats 3
    python benchmarks/time_to_accuracy.py --sweep 0 8 24 --jitter-ms 24   # heterogeneity sweep
    python benchmarks/time_to_accuracy.py --devices 2 --target 0.97 -- model=mlp train.epochs=20
    python benchmarks/time_to_accuracy.py --rules bsp gosgd --repeats 1   # a quick look
    python benchmarks/time_to_accuracy.py --smoke                  # one job of 4 steps: does it run?

Each rule (every option of ``conf/rule/``, discovered, and easgd-async = ``rule=easgd rule.variant=async``)
runs as a real job through ``python -m runner``, validating four times an epoch (``train.val_every=0.25``),
under each condition: each straggler delay of ``--sweep`` (worker ``--straggler-rank`` sleeps that many ms at
the start of every step, ``simulate.straggler_ms``; 0 is no straggler) and, with ``--jitter-ms``, workers of
random speeds (each sleeps its own delay, drawn once in [0, jitter], ``simulate.jitter_ms``). The asynchronous
rules (as their schemas say: easgd-async, gosgd, asgd...) run with ``data.assignment=static`` and ``dynamic``.
``--repeats`` rounds run every job once each, in the same order, so drift of the machine falls on all of them;
the table gives medians: the wall time from the start of training to the first validation at or above the
target, and that time against BSP's under the same condition (``vs bsp``), against the same rule with static
shards (``vs static``) and against the rule's own without a straggler (``vs own``); the final accuracy, the
bytes each worker sent (summary.json's ``bytes_sent`` over ``devices``) and the samples per second. A job that
fails is reported on stderr and left out, and the script then exits with status 1. ``--smoke`` checks that it
all runs, in seconds: one job, GoSGD on 2 workers with dynamic assignment and the straggler, 4 steps."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RULE_ARGS = {"easgd-async": ["rule=easgd", "rule.variant=async"]}


def discovered() -> tuple[list[str], set[str]]:
    """Every rule a user can select (``conf/rule/*.yaml``), EASGD's asynchronous variant beside EASGD, and
    those whose workers do not step together (run under each assignment too)."""
    from runner.schema import schema_of

    names = sorted(p.stem for p in (ROOT / "conf" / "rule").glob("*.yaml"))
    rules = [v for name in names for v in ([name, "easgd-async"] if name == "easgd" else [name])]
    asynchronous = {name for name in names if schema_of("rule", name)().asynchronous()}
    return rules, asynchronous | ({"easgd-async"} if "easgd" in names else set())


RULES, ASYNCHRONOUS = discovered()
SMOKE = ["train.epochs=1", "train.max_steps=4"]


@dataclass(frozen=True)
class Job:
    rule: str
    assignment: str
    straggler_ms: float
    jitter_ms: float = 0.0

    def condition(self, rank: int) -> str:
        if self.jitter_ms:
            return f"jitter {self.jitter_ms:g} ms"
        return f"r{rank} +{self.straggler_ms:g} ms" if self.straggler_ms else "none"


@dataclass
class Runs:
    """The repeats of one job: the times to target (None: not reached) and the summaries."""

    hits: list[float | None] = field(default_factory=list)
    summaries: list[dict[str, Any]] = field(default_factory=list)

    @property
    def hit(self) -> float | None:
        """The median time to target; None unless most repeats reached it."""
        reached = [h for h in self.hits if h is not None]
        return statistics.median(reached) if len(reached) * 2 > len(self.hits) else None

    def median(self, key: str) -> float:
        return statistics.median(s[key] for s in self.summaries)

    def slowdown(self, rank: int) -> float | None:
        """How many times slower per step worker ``rank`` was than the others (the median of theirs):
        measured under dynamic assignment, where every worker trains until the run's end (median over the
        repeats); None for static shards, whose workers all take the same steps."""
        ratios = []
        for summary in self.summaries:
            steps = summary.get("steps_per_worker") or []
            if summary.get("assignment") != "dynamic" or not 0 <= rank < len(steps) or not steps[rank]:
                return None
            ratios.append(statistics.median(steps[:rank] + steps[rank + 1 :]) / steps[rank])
        return statistics.median(ratios) if ratios else None


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=4, help="workers (default 4)")
    p.add_argument("--target", type=float, default=0.95, help="validation accuracy (default 0.95)")
    p.add_argument("--rules", nargs="+", default=RULES, choices=RULES)
    p.add_argument("--assignments", nargs="+", default=["static", "dynamic"], choices=["static", "dynamic"])
    p.add_argument("--straggler-ms", type=float, default=16.0, help="the straggler's delay per step")
    p.add_argument("--sweep", type=float, nargs="+", help="straggler delays (default: 0 and --straggler-ms)")
    p.add_argument("--straggler-rank", type=int, default=1, help="the worker slowed down")
    p.add_argument(
        "--delay",
        choices=["auto", "sleep", "spin"],
        default="auto",
        help="how the delays are spent (simulate.spin); auto: spin when the workers outnumber the cores",
    )
    p.add_argument("--jitter-ms", type=float, default=0.0, help="also run workers of random speeds")
    p.add_argument("--repeats", type=int, default=3, help="rounds of every job; medians are reported")
    p.add_argument("--smoke", action="store_true", help="check that it runs, in seconds: one job of 4 steps")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every job (after --)")
    args = p.parse_args()
    if args.smoke:
        args.devices, args.target, args.rules, args.assignments = 2, 0.5, ["gosgd"], ["dynamic"]
        args.sweep, args.repeats, args.overrides = [5.0], 1, SMOKE + args.overrides
    args.sweep = args.sweep if args.sweep is not None else [0.0, args.straggler_ms]
    if args.delay == "auto":
        args.delay = "spin" if args.devices > (os.cpu_count() or 1) else "sleep"
    if min(args.sweep) < 0 or not 0 <= args.straggler_rank < args.devices or args.repeats < 1:
        p.error(f"delays must be >= 0, --straggler-rank a worker (0..{args.devices - 1}), --repeats >= 1")
    return args


def jobs(args: argparse.Namespace) -> list[Job]:
    """Every job of a round: each rule under each delay, asynchronous ones under each assignment."""
    out = []
    for rule in args.rules:
        kinds = args.assignments if rule in ASYNCHRONOUS else ["static"]
        out += [Job(rule, kind, ms) for ms in args.sweep for kind in kinds]
        out += [Job(rule, kind, 0.0, args.jitter_ms) for kind in kinds] if args.jitter_ms else []
    return out


def run_job(args: argparse.Namespace, job: Job, run_dir: Path) -> tuple[float | None, dict] | None:
    slow = [f"simulate.straggler_ranks=[{args.straggler_rank}]", f"simulate.straggler_ms={job.straggler_ms}"]
    argv = [
        sys.executable,
        "-m",
        "runner",
        *RULE_ARGS.get(job.rule, [f"rule={job.rule}"]),
        f"data.assignment={job.assignment}",
        f"devices={args.devices}",
        "hardware.oversubscribe=true",
        f"hydra.run.dir={run_dir}",
        "train.progress=false",
        "train.val_every=0.25",
        *(slow if job.straggler_ms else []),
        f"simulate.spin={args.delay == 'spin'}",
        *([f"simulate.jitter_ms={job.jitter_ms}"] if job.jitter_ms else []),
        *args.overrides,
    ]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{run_dir.name}: failed\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    hits = [r["time"] for r in records if r["kind"] == "val" and reported(r) >= args.target]
    hit = min(hits, default=None)
    print(f"{run_dir.name}: {'not hit' if hit is None else f'{hit:.2f} s'}", file=sys.stderr)
    return hit, summary


def reported(record: dict[str, Any]) -> float:
    """The accuracy of the model a validation record reports: ``val_acc``, else the rule's first model's."""
    return record.get("val_acc", next((v for k, v in record.items() if k.endswith("val_acc")), 0.0))


def ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}" if value is not None and base else "-"


def table(args: argparse.Namespace, results: dict[Job, Runs]) -> None:
    job_args = " ".join(args.overrides) or "default job"
    print(
        f"\ntime to {args.target:.0%} validation accuracy, {args.devices} workers ({job_args}); worker "
        f"{args.straggler_rank} {'spins' if args.delay == 'spin' else 'sleeps'} the straggler ms per step; "
        f"medians of {args.repeats}; slower x: the straggler's steps against the others' (dynamic)"
    )
    head = ("rule", "data", "straggler", "to target s", "vs bsp", "vs static", "vs own", "slower x",
            "final acc", "MB/worker", "samples/s")  # fmt: skip
    print("| " + " | ".join(head) + " |\n" + "|---" * len(head) + "|")
    for job, runs in results.items():
        if not runs.summaries:
            continue
        bsp = results.get(Job("bsp", "static", job.straggler_ms, job.jitter_ms))
        static = results.get(Job(job.rule, "static", job.straggler_ms, job.jitter_ms))
        own = results.get(Job(job.rule, job.assignment, 0.0))
        hit = runs.hit
        slower = runs.slowdown(args.straggler_rank) if job.straggler_ms else None
        row = (
            job.rule,
            job.assignment,
            job.condition(args.straggler_rank),
            "not hit" if hit is None else f"{hit:.2f}",
            ratio(hit, bsp and bsp.hit),
            ratio(hit, static and static.hit) if job.assignment == "dynamic" else "-",
            ratio(hit, own and own.hit) if job.straggler_ms or job.jitter_ms else "-",
            "-" if slower is None else f"{slower:.1f}",
            f"{runs.median('final_val_acc'):.4f}",
            f"{runs.median('bytes_sent') / runs.summaries[0]['devices'] / 1e6:.2f}",
            f"{runs.median('samples_per_s'):.0f}",
        )
        print("| " + " | ".join(row) + " |")


def main() -> None:
    args = parse()
    results = {job: Runs() for job in jobs(args)}
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for job in results:
                name = f"{job.rule}-{job.assignment}-{job.straggler_ms:g}-{job.jitter_ms:g}ms-{repeat}"
                got = run_job(args, job, Path(tmp) / name)
                if got is None:
                    failed += 1
                    continue
                results[job].hits.append(got[0])
                results[job].summaries.append(got[1])
    table(args, results)
    if failed:
        sys.exit(f"{failed} of {len(results) * args.repeats} jobs failed (their output above)")


if __name__ == "__main__":
    main()
