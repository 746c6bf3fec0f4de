"""Start-up cost of the launcher and of a small job, for one or more source trees, alternated in one run.

    python benchmarks/startup.py                         # this tree, 5 rounds
    python benchmarks/startup.py --trees /tmp/old . --rounds 5
    python benchmarks/startup.py -- train.epochs=1        # extra Hydra overrides for every job
    python benchmarks/startup.py --smoke                 # one round, a job of 2 steps

For each tree (a checkout of mpitrain; the command runs with it as the working directory, so its
``runner``, ``models`` and ``data`` packages are the ones imported) it times, with the same Python:

- ``cfg``: ``python -m runner --cfg job`` (compose and print, no job);
- ``first_step``: from the command to the first training step of the default job (the moment the first
  ``kind: step`` record appears in ``metrics.jsonl``, with ``train.log_every=1``, polled every 5 ms);
- ``job``: the whole default job (``python -m runner``), wall time.

Rounds alternate between the trees so that drift of the machine falls on all of them; medians are printed,
and ratios against the first tree. ``--smoke`` checks that it runs, in seconds: one round, and a job of one
epoch cut at 2 steps (``SMOKE``).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: --smoke's overrides of the job: one epoch cut at 2 steps.
SMOKE = ["train.epochs=1", "train.max_steps=2"]


def timed(argv: list[str], cwd: Path, metrics: Path | None = None) -> tuple[float, float | None]:
    """Wall time of ``argv``, and when ``metrics`` first held a step record (None: never)."""
    start = time.perf_counter()
    proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    first = None
    while proc.poll() is None:
        if first is None and metrics is not None and metrics.exists() and '"step"' in metrics.read_text():
            first = time.perf_counter() - start
        time.sleep(0.005)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed in {cwd}:\n{proc.stderr.read().decode()[-2000:]}")
    return wall, first


def measure(tree: Path, scratch: Path, overrides: list[str]) -> dict[str, float]:
    run_dir = Path(tempfile.mkdtemp(dir=scratch))
    py = [sys.executable, "-m", "runner"]
    cfg, _ = timed([*py, "--cfg", "job"], tree)
    job, first = timed(
        [*py, f"hydra.run.dir={run_dir}", "train.progress=false", "train.log_every=1", *overrides],
        tree,
        run_dir / "metrics.jsonl",
    )
    return {"cfg": cfg, "first_step": first if first is not None else float("nan"), "job": job}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trees", nargs="+", type=Path, default=[ROOT], help="source trees to compare")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--smoke", action="store_true", help="check that it runs, in seconds: 1 round, 2 steps")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every job (after --)")
    args = p.parse_args()
    if args.smoke:
        args.rounds, args.overrides = 1, SMOKE + args.overrides
    trees = [t.resolve() for t in args.trees]
    results: dict[Path, list[dict[str, float]]] = {t: [] for t in trees}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            for tree in trees:
                results[tree].append(measure(tree, Path(scratch), args.overrides))
                print(f"round {r + 1} {tree}: {results[tree][-1]}", file=sys.stderr)
    keys = ("cfg", "first_step", "job")
    base = {k: statistics.median(m[k] for m in results[trees[0]]) for k in keys}
    print(f"{'tree':40s} " + " ".join(f"{k + ' s':>12s}" for k in keys) + "   (medians; ratio to first tree)")
    for tree in trees:
        med = {k: statistics.median(m[k] for m in results[tree]) for k in keys}
        cells = " ".join(f"{med[k]:6.2f} ({med[k] / base[k]:.2f})" for k in keys)
        print(f"{str(tree)[-40:]:40s} {cells}")


if __name__ == "__main__":
    main()
