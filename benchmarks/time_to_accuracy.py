"""Time to accuracy of every rule on the same job, against BSP measured in the same run.

    python benchmarks/time_to_accuracy.py                       # CNN on digits, 4 workers, target 95%
    python benchmarks/time_to_accuracy.py --devices 2 --target 0.97 -- model=mlp train.epochs=20

Each rule runs as a real job through ``python -m runner`` (validation every epoch); the table gives the
wall time from the start of training to the first validation at or above the target, the final accuracy,
samples/s and the fraction of step time in communication, and each rule's time to target divided by BSP's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RULES = ["bsp", "easgd", "gosgd", "asgd"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--target", type=float, default=0.95)
    p.add_argument("--rules", nargs="+", default=RULES)
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every job (after --)")
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for rule in args.rules:
            run_dir = Path(tmp) / rule
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
                *args.overrides,
            ]
            proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
            if proc.returncode != 0:
                print(f"{rule}: failed\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            summary = json.loads((run_dir / "summary.json").read_text())
            records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
            hit = next(
                (r["time"] for r in records if r["kind"] == "val" and r["val_acc"] >= args.target), None
            )
            rows.append((rule, hit, summary))
    base = next((hit for rule, hit, _ in rows if rule == "bsp"), None)
    print(
        f"\ntime to {args.target:.0%} validation accuracy, {args.devices} workers "
        f"({' '.join(args.overrides) or 'default job'})"
    )
    print(
        f"{'rule':<6} {'to target s':>11} {'vs bsp':>7} {'final acc':>9} {'best acc':>8} {'samples/s':>9} "
        f"{'comm frac':>9} {'wall s':>7}"
    )
    for rule, hit, s in rows:
        ratio = f"{hit / base:7.2f}" if hit is not None and base else "      -"
        shown = f"{hit:11.1f}" if hit is not None else "    not hit"
        print(
            f"{rule:<6} {shown} {ratio} {s['final_val_acc']:9.4f} {s['best_val_acc']:8.4f} "
            f"{s['samples_per_s']:9.0f} {s['comm_fraction']:9.3f} {s['wall_time_s']:7.1f}"
        )


if __name__ == "__main__":
    main()
