"""What fault tolerance (``hardware.fault_tolerance=continue``) costs: the time from a worker's death to the
survivors' next step, and the step time with and without it.

    python benchmarks/fault_tolerance.py                  # BSP, 4 workers, 5 kills; 3 rounds of step times
    python benchmarks/fault_tolerance.py --rule gosgd --kills 3
    python benchmarks/fault_tolerance.py --smoke          # one job: 3 workers, a kill at step 3, one epoch
    python benchmarks/fault_tolerance.py --heal --rule easgd --kills 3 --rounds 0   # the replacement's time

``--heal`` runs the kill jobs with ``fault_tolerance=heal``: a replacement is spawned into the job at the
survivors' next agreement, and *healed* is from the kill to the end of the first step with all workers
again (the first step after the ``joined`` record; its wall time from summary.json's ``joins``).

Recovery: each job trains the CNN on digits for 3 epochs (``--epochs``) with 4 workers (``--workers``;
oversubscribed on a small machine) and worker 2 kills itself (SIGKILL, ``tests/helpers/dies.py``) at its 20th
step (``--die-at``), writing the time first. From ``metrics.jsonl`` (one record per step) and
``summary.json``: *detect* is from the kill to the survivors' recovery starting (their pending call failing),
*recover* the revoke, shrink, agreement and rule fix-up (``recovery_time_s``), *first step* from the kill to
the end of the survivors' first step after it.

Step time: the same job without a kill, ``fault_tolerance=none`` against ``continue`` (mpirun
``--with-ft ulfm``, errors returned, BatchNorm statistics kept each step), alternated in rounds; medians of
the per-step times of rank 0 (from its step records, the first epoch left out). ``--kills 0`` or
``--rounds 0`` leaves that part out. ``--smoke`` checks that it runs, in seconds: a single job, the recovery
one with ``--heal`` (the step-time jobs are plain training), with 3 workers, the kill at step 3, one epoch.
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
BASE = ["hydra.searchpath=[file://tests/conf]", "model=dies", "train.progress=false", "train.log_every=1"]


def job(run_dir: Path, *overrides: str, env: dict | None = None) -> tuple[dict, list[dict]]:
    argv = [sys.executable, "-m", "runner", f"hydra.run.dir={run_dir}", *BASE, *overrides]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "summary.json").read_text()), records


def recovery(
    scratch: Path,
    rule: str,
    kills: int,
    workers: int = 4,
    die_at: int = 20,
    epochs: int = 3,
    heal: bool = False,
) -> list[dict[str, float]]:
    import os

    results = []
    for i in range(kills):
        run_dir, stamp = scratch / f"kill{i}", scratch / f"kill{i}.stamp"
        env = {**os.environ, "MPITRAIN_KILL_STAMP": str(stamp)}
        summary, records = job(
            run_dir,
            f"rule={rule}",
            f"devices={workers}",
            "hardware.oversubscribe=true",
            f"hardware.fault_tolerance={'heal' if heal else 'continue'}",
            "model.die_rank=2",
            f"model.die_at={die_at}",
            f"train.epochs={epochs}",
            env=env,
        )
        killed = min(map(float, stamp.read_text().split()))
        [failure] = summary["failures"]
        [event] = [r for r in records if r["kind"] == "failure"]
        offset = failure["time"] + failure_recovery(summary) - event["time"]  # wall = relative + offset
        after = min(r["time"] for r in records if r["kind"] == "step" and r["step"] > event["step"])
        results.append(
            {
                "detect": failure["time"] - killed,
                "recover": failure_recovery(summary),
                "first_step": after + offset - killed,
                **(healed(summary, records, killed) if heal else {}),
            }
        )
    return results


def healed(summary: dict, records: list[dict], killed: float) -> dict[str, float]:
    """From the kill to the end of the first step with every worker again (after the ``joined`` record)."""
    [join] = summary["joins"]
    [event] = [r for r in records if r["kind"] == "joined"]
    offset = join["time"] - event["time"]  # wall = relative + offset
    after = min(r["time"] for r in records if r["kind"] == "step" and r["step"] > event["step"])
    return {"healed": after + offset - killed, "spawn": event["seconds"]}


def failure_recovery(summary: dict) -> float:
    return summary["recovery_time_s"]


def step_times(scratch: Path, rule: str, tolerance: str, round_: int, devices: int) -> list[float]:
    _, records = job(
        scratch / f"{tolerance}{round_}",
        f"rule={rule}",
        f"devices={devices}",
        f"hardware.fault_tolerance={tolerance}",
        "model.die_at=0",
        "train.epochs=4",
    )
    steps = [r for r in records if r["kind"] == "step"]
    first_epoch = [r for r in records if r["kind"] == "epoch"][0]["step"]
    return [b["time"] - a["time"] for a, b in zip(steps, steps[1:], strict=False) if a["step"] >= first_epoch]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rule", default="bsp")
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--devices", type=int, default=2, help="workers of the step-time jobs")
    p.add_argument("--workers", type=int, default=4, help="workers of the kill jobs (worker 2 dies)")
    p.add_argument("--die-at", type=int, default=20, help="the step worker 2 dies at")
    p.add_argument("--epochs", type=int, default=3, help="epochs of the kill jobs")
    p.add_argument("--heal", action="store_true", help="the kill jobs replace the lost worker (heal)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="check that it runs, in seconds: one kill job (3 workers, the kill at step 3, 1 epoch), "
        "no step-time rounds",
    )
    args = p.parse_args()
    if args.smoke:
        args.kills, args.rounds, args.workers, args.die_at, args.epochs = 1, 0, 3, 3, 1
        args.heal = True  # the heal job does what the continue one does, and then grows
    if args.workers < 3:
        p.error("--workers must be at least 3 (worker 2 dies)")
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        kills = recovery(scratch, args.rule, args.kills, args.workers, args.die_at, args.epochs, args.heal)
        times: dict[str, list[float]] = {"none": [], "continue": []}
        for r in range(args.rounds):
            for tolerance in times:
                times[tolerance] += step_times(scratch, args.rule, tolerance, r, args.devices)
    if kills:
        print(
            f"rule={args.rule}: a worker of {args.workers} killed at its step {args.die_at}, {args.kills} "
            "jobs (medians, ms)"
        )
        print("| from the kill to | median | min | max |")
        print("| --- | --- | --- | --- |")
        rows = [("detect", "recovery start"), ("recover", "(recovery itself)"), ("first_step", "first step")]
        if args.heal:
            rows += [("spawn", "(the growth itself)"), ("healed", f"first step with {args.workers} workers")]
        for key, label in rows:
            values = [k[key] * 1e3 for k in kills]
            print(f"| {label} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} |")

    if not args.rounds:
        return
    none, cont = (statistics.median(times[t]) * 1e3 for t in ("none", "continue"))
    print(f"\nstep time, {args.devices} workers, {args.rounds} rounds alternated (median ms per step)")
    print("| fault_tolerance=none | continue | ratio |")
    print("| --- | --- | --- |")
    print(f"| {none:.2f} | {cont:.2f} | {cont / none:.3f} |")


if __name__ == "__main__":
    main()
