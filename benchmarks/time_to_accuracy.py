"""Time to accuracy and bytes sent of every rule on the same job, without and with a straggler, against BSP
measured in the same run.

    python benchmarks/time_to_accuracy.py                       # CNN on digits, 4 workers, target 95%
    python benchmarks/time_to_accuracy.py --straggler-ms 100 --straggler-rank 3
    python benchmarks/time_to_accuracy.py --devices 2 --target 0.97 -- model=mlp train.epochs=20
    python benchmarks/time_to_accuracy.py --quick --rules bsp easgd   # quick look: 20 steps, target 50%
    python benchmarks/time_to_accuracy.py --smoke                     # one job of 4 steps: does it run?

Each rule (bsp, easgd, gosgd, asgd, and diloco where ``conf/rule/diloco.yaml`` exists) runs twice as a real
job through ``python -m runner`` (validation every epoch): as it is, and with worker ``--straggler-rank``
sleeping ``--straggler-ms`` at the start of every step (``simulate.straggler_ranks``/``straggler_ms``;
``--straggler-ms 0`` runs the first condition only). One table gives, per rule and condition, the wall time
from the start of training to the first validation at or above the target, the final accuracy, the bytes
each worker sent (summary.json's ``bytes_sent`` over ``devices``; a server rank's replies are not counted),
samples/s and the fraction of step time in communication; the time to target and the bytes divided by
BSP's under the same condition, and, for the straggler rows, the time to target divided by the rule's own
without the straggler: what the slow worker costs that rule. A job that fails is reported on stderr and left
out of the table, and the script then exits with status 1. ``--smoke`` checks that it all runs, in seconds:
one job, BSP on 2 workers with the straggler (which covers the options of the plain job and more), one
epoch cut at 4 steps, target 50%.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RULES = ["bsp", "easgd", "gosgd", "asgd"] + (["diloco"] if (ROOT / "conf/rule/diloco.yaml").exists() else [])
QUICK = ["train.epochs=1", "train.max_steps=20"]
SMOKE = ["train.epochs=1", "train.max_steps=4"]


@dataclass
class Result:
    rule: str
    straggler: bool
    hit: float | None  # seconds to the target, None if never reached
    summary: dict[str, Any]

    @property
    def bytes_per_worker(self) -> float:
        return self.summary["bytes_sent"] / self.summary["devices"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=None, help="workers (default 4; --quick: 2)")
    p.add_argument(
        "--target", type=float, default=None, help="validation accuracy (default 0.95; --quick: 0.5)"
    )
    p.add_argument("--rules", nargs="+", default=RULES)
    p.add_argument("--straggler-ms", type=float, default=30.0, help="delay per step (0: no straggler runs)")
    p.add_argument("--straggler-rank", type=int, default=1, help="the worker slowed down")
    p.add_argument("--quick", action="store_true", help="quick look: 2 workers, 20 steps, target 50%%")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="check that it runs, in seconds: one job (bsp, 2 workers, the straggler at 5 ms), 4 steps",
    )
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every job (after --)")
    args = p.parse_args()
    if args.smoke:
        args.quick, args.rules, args.straggler_ms, args.straggler_rank = True, ["bsp"], 5.0, 1
    args.devices = args.devices or (2 if args.quick else 4)
    args.target = args.target or (0.5 if args.quick else 0.95)
    if args.quick:
        args.overrides = (SMOKE if args.smoke else QUICK) + args.overrides
    if args.straggler_ms < 0 or not 0 <= args.straggler_rank < args.devices:
        p.error(f"--straggler-ms must be >= 0 and --straggler-rank a worker, 0..{args.devices - 1}")
    # each rule runs as it is and with the straggler (--smoke: with it only, a single job)
    args.conditions = [True] if args.smoke else [False, True] if args.straggler_ms > 0 else [False]
    return args


def run_job(args: argparse.Namespace, rule: str, straggler: bool, run_dir: Path) -> Result | None:
    slow = [f"simulate.straggler_ranks=[{args.straggler_rank}]", f"simulate.straggler_ms={args.straggler_ms}"]
    argv = [
        sys.executable,
        "-m",
        "runner",
        f"rule={rule}",
        f"devices={args.devices}",
        "hardware.oversubscribe=true",
        f"hydra.run.dir={run_dir}",
        "train.progress=false",
        "train.val_every=1",
        *(slow if straggler else []),
        *args.overrides,
    ]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{run_dir.name}: failed\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}", file=sys.stderr)
        return None
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    hit = next((r["time"] for r in records if r["kind"] == "val" and r["val_acc"] >= args.target), None)
    print(f"{run_dir.name}: {'not hit' if hit is None else f'{hit:.1f} s'}", file=sys.stderr)
    return Result(rule, straggler, hit, summary)


def ratio(value: float | None, base: float | None, width: int) -> str:
    return f"{value / base:{width}.2f}" if value is not None and base else f"{'-':>{width}}"


def main() -> None:
    args = parse()
    slow = f"r{args.straggler_rank} +{args.straggler_ms:g}ms"
    results: list[Result] = []
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        for rule in args.rules:
            for straggler in args.conditions:
                run_dir = Path(tmp) / f"{rule}-{'straggler' if straggler else 'none'}"
                result = run_job(args, rule, straggler, run_dir)
                if result is not None:
                    results.append(result)
                failed += result is None
    bsp = {r.straggler: r for r in results if r.rule == "bsp"}
    own = {r.rule: r.hit for r in results if not r.straggler}
    job = " ".join(args.overrides) or "default job"
    print(
        f"\ntime to {args.target:.0%} validation accuracy, {args.devices} workers ({job}); straggler "
        f"{slow}: worker {args.straggler_rank} sleeps {args.straggler_ms:g} ms per step"
    )
    print(
        f"{'rule':<7} {'straggler':<12} {'to target s':>11} {'vs bsp':>7} {'vs own':>7} {'final acc':>9} "
        f"{'MB/worker':>9} {'vs bsp':>7} {'samples/s':>9} {'comm frac':>9}"
    )
    for r in results:
        base = bsp.get(r.straggler)
        hit = f"{r.hit:11.1f}" if r.hit is not None else "    not hit"
        vs_own = ratio(r.hit, own.get(r.rule), 7) if r.straggler else f"{'-':>7}"
        s = r.summary
        print(
            f"{r.rule:<7} {slow if r.straggler else 'none':<12} {hit} {ratio(r.hit, base and base.hit, 7)} "
            f"{vs_own} {s['final_val_acc']:9.4f} {r.bytes_per_worker / 1e6:9.2f} "
            f"{ratio(r.bytes_per_worker, base and base.bytes_per_worker, 7)} {s['samples_per_s']:9.0f} "
            f"{s['comm_fraction']:9.3f}"
        )
    if failed:
        sys.exit(f"{failed} of {len(args.rules) * len(args.conditions)} jobs failed (their output above)")


if __name__ == "__main__":
    main()
