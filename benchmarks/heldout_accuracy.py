"""Accuracy of rules against one process on tasks they were not tuned on: the mean of the last validations.

    python benchmarks/heldout_accuracy.py          # asgd and async_diloco, 4 tasks, seeds 0-2
    python benchmarks/heldout_accuracy.py --rules asgd --tasks signals --seeds 0 1 2 3 4
    python benchmarks/heldout_accuracy.py --rules asgd -- rule.momentum_correction=none    # extra overrides
    python benchmarks/heldout_accuracy.py --smoke                           # one short job per side

Each task runs one process (``devices=1 rule=bsp``) and each rule with ``--devices`` workers, on the same
recipe: SGD at a constant rate ``--lr`` with momentum ``--momentum``, ``--epochs`` epochs, one validation an
epoch. A constant rate makes the last validation swing by points from run to run, so a run is judged by the
mean of its last ``--last`` validations; the table gives, per task and rule, the median over ``--seeds`` of
that mean and its gap to one process's median (points). Tasks: ``digits`` (the runner's), ``blobs``
(examples/my_project), ``signals`` and ``markov`` (examples/heldout: 1-D waveforms with a 1-D convolutional
network, Markov-chain token sequences with a bigram network), the last two kept aside for checking, never
for tuning. A job that fails is reported and the script exits 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Per task: the folder the job runs in (its hydra.searchpath) and its options.
TASKS = {
    "digits": (ROOT, ["model=cnn", "data=digits"]),
    "blobs": (ROOT / "examples" / "my_project", ["model=blob_mlp", "data=blobs"]),
    "signals": (ROOT / "examples" / "heldout", ["model=conv1d", "data=signals"]),
    "markov": (ROOT / "examples" / "heldout", ["model=bigram", "data=markov"]),
}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rules", nargs="+", default=["asgd", "async_diloco"])
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--devices", type=int, default=4)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--last", type=int, default=5, help="validations averaged at the end of each run")
    p.add_argument("--smoke", action="store_true", help="2 epochs, one seed, digits, asgd: does it run?")
    p.add_argument("overrides", nargs="*", help="after --: overrides for the rules' jobs")
    args = p.parse_args()
    if args.smoke:
        args.rules, args.tasks, args.seeds, args.epochs, args.last = ["asgd"], ["digits"], [0], 2, 2
    return args


def run(args: argparse.Namespace, task: str, side: list[str], seed: int, run_dir: Path) -> float | None:
    """One job; the mean val_acc of its last ``args.last`` validations (None: it failed)."""
    folder, options = TASKS[task]
    argv = [
        sys.executable,
        "-m",
        "runner",
        "hydra.searchpath=[file://conf]",
        *options,
        *side,
        f"train.epochs={args.epochs}",
        f"train.seed={seed}",
        f"optim.lr={args.lr}",
        f"optim.momentum={args.momentum}",
        "schedule=constant",
        "train.val_every=1",
        "train.progress=false",
        "train.save_model=none",
        "checkpoint.every_minutes=null",
        "hardware.oversubscribe=true",
        f"hydra.run.dir={run_dir}",
    ]
    proc = subprocess.run(argv, cwd=folder, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{task} {' '.join(side)} seed {seed}: failed\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
        return None
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    accs = [r["val_acc"] for r in records if r["kind"] == "val" and "val_acc" in r]
    return statistics.fmean(accs[-args.last :])


def main() -> None:
    args = parse()
    sides = {"one process": ["devices=1", "rule=bsp"]}
    for rule in args.rules:
        sides[rule] = [f"devices={args.devices}", f"rule={rule}", *args.overrides]
    results: dict[tuple[str, str], list[float]] = {}
    failed = False
    with tempfile.TemporaryDirectory(prefix="heldout-") as tmp:
        for task in args.tasks:
            for name, side in sides.items():
                for seed in args.seeds:
                    run_dir = Path(tmp) / f"{task}-{name.replace(' ', '_')}-{seed}"
                    acc = run(args, task, side, seed, run_dir)
                    failed |= acc is None
                    if acc is not None:
                        results.setdefault((task, name), []).append(acc)
                        print(f"{task:8} {name:14} seed {seed}: {acc:.4f}", flush=True)
    print(f"\nmean val_acc of the last {args.last} validations, median over seeds {args.seeds}")
    print(f"{'task':8} {'side':14} {'median':>7} {'vs one':>7}  runs")
    for task in args.tasks:
        base = results.get((task, "one process"))
        for name in sides:
            runs = results.get((task, name))
            if not runs:
                continue
            med = statistics.median(runs)
            gap = f"{100 * (med - statistics.median(base)):+.1f}" if base and name != "one process" else ""
            print(f"{task:8} {name:14} {med:7.4f} {gap:>7}  {' '.join(f'{r:.4f}' for r in runs)}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
