"""Randomized kills: every rule under ``continue`` and ``heal``, a worker killed at a moment drawn from the
whole run; how many survived, and how long heal took to be back to every worker.

    python benchmarks/kill_battery.py                       # 20 draws per rule and mode (about 90 min)
    python benchmarks/kill_battery.py --draws 3 --rules asgd diloco --modes heal
    python benchmarks/kill_battery.py --rules asgd --modes heal --seeds 17     # replay one draw
    python benchmarks/kill_battery.py --smoke               # one draw (BSP, heal)
    python benchmarks/kill_battery.py --modes heal --spares 2   # heal by warm spares, not spawned workers

Each draw (``tests/helpers/kill_battery.py``) is one job of 4 workers training the CNN on digits for 2
epochs, in which ``tests/helpers/dies.py`` SIGKILLs one worker (rank 0 included) a drawn delay after a
drawn training step (the last too), or after a validation began, or two workers at once, or (``heal``) a
second worker while the first one's replacement joins. Survived: the job ended ok, every kill recorded as a
loss, and as many workers at the end as the losses and joins leave. *healed*: from the kill to the end of
the first step with 4 workers again. Failures print their seed and the command that replays them; ``--out``
keeps every draw's row (JSON lines), ``--keep DIR`` a failed draw's run folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.helpers.kill_battery import MODES, Outcome, cases, draw, run_draw  # noqa: E402


def early_seed(case: str, mode: str, last: int = 4) -> int:
    """The first seed whose draw kills one worker by step ``last``, so that its replacement joins while the
    run has steps left and the heal time is measured (seed 0's validation kill joined at the run's very
    end on some runs: no heal time, and the smoke failed)."""
    for seed in range(1000):
        d = draw(case, mode, seed)
        at = [int(o.split("=")[1]) for o in d.overrides if o.startswith("model.die_at=")]
        if d.kind == "step" and at and at[0] <= last:
            return seed
    raise AssertionError(f"no seed of {case} {mode} draws a kill by step {last}")


def battery(
    cases_: list[str],
    modes: list[str],
    seeds: list[int],
    scratch: Path,
    out: Path | None,
    spares: int = 0,
    keep: Path | None = None,
) -> list[Outcome]:
    """Run every draw (``heal`` with ``spares`` warm spares); print one line per draw as it ends.

    ``keep``: a failed draw's run folder is copied there (its logs and the ranks' stacks: a rare failure
    may not come back in a replay)."""
    done = []
    for case in cases_:
        for mode in modes:
            for seed in seeds:
                d = draw(case, mode, seed)
                if spares and mode == "heal":
                    d.overrides.append(f"hardware.spares={spares}")
                t0 = time.time()
                o = run_draw(d, scratch / f"{case}-{mode}-{seed}")
                done.append(o)
                if keep is not None and o.problems:
                    name = f"{case}-{mode}-{seed}"
                    shutil.copytree(scratch / name, keep / name, dirs_exist_ok=True)
                    (keep / name / "tail.txt").write_text(o.tail)
                verdict = "ok" if not o.problems else "FAILED: " + "; ".join(o.problems)
                verdict = "void (no kill came: the moment was past the run)" if o.void else verdict
                heal = f", healed in {o.healed_s:.2f} s" if o.healed_s is not None else ""
                print(f"{d.describe()} -> {verdict}{heal} [{time.time() - t0:.0f} s]", flush=True)
                if out is not None:
                    with out.open("a") as f:
                        f.write(json.dumps(o.row()) + "\n")
    return done


def table(outcomes: list[Outcome]) -> None:
    """Survived/draws and heal times per rule and mode (markdown)."""
    print(
        "\n| rule | mode | survived | ended, cause named | void | healed median (s) | healed max (s) "
        "| of which the growth, median (s) | recovery median (ms) |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    keys = sorted({(o.draw.case, o.draw.mode) for o in outcomes})
    for case, mode in keys:
        drawn = [o for o in outcomes if (o.draw.case, o.draw.mode) == (case, mode)]
        mine = [o for o in drawn if not o.void]
        ok = [o for o in mine if not o.problems]
        named = sum(o.named_end for o in mine)
        heals = [o.healed_s for o in ok if o.healed_s is not None]
        spawns = [o.spawn_s for o in ok if o.spawn_s is not None]
        rec = [o.summary["recovery_time_s"] * 1e3 for o in ok if o.summary.get("recovery_time_s")]
        med = f"{statistics.median(heals):.2f}" if heals else "-"
        top = f"{max(heals):.2f}" if heals else "-"
        r = f"{statistics.median(rec):.1f}" if rec else "-"
        void = len(drawn) - len(mine)
        spawn = f"{statistics.median(spawns):.2f}" if spawns else "-"
        row = f"{len(ok)}/{len(mine)} | {named} | {void} | {med} | {top} | {spawn} | {r}"
        print(f"| {case} | {mode} | {row} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--draws", type=int, default=20, help="draws per rule and mode (seeds 0..N-1)")
    p.add_argument("--seeds", type=int, nargs="*", help="these seeds instead of 0..draws-1")
    p.add_argument("--rules", nargs="*", default=None, help=f"of {sorted(cases())}")
    p.add_argument("--modes", nargs="*", default=list(MODES), choices=MODES)
    p.add_argument("--out", type=Path, help="append every draw's row here (JSON lines)")
    p.add_argument("--keep", type=Path, help="copy a failed draw's run folder into this folder")
    p.add_argument("--smoke", action="store_true", help="one draw: BSP under heal, a worker lost early")
    p.add_argument("--spares", type=int, default=0, help="heal with this many warm spares (hardware.spares)")
    args = p.parse_args()
    known = cases()
    chosen = args.rules or sorted(known)
    unknown = [c for c in chosen if c not in known]
    if unknown:
        p.error(f"unknown rule(s) {unknown}: choose from {sorted(known)}")
    seeds = args.seeds if args.seeds is not None else list(range(args.draws))
    if args.smoke:
        chosen, args.modes, seeds = ["bsp"], ["heal"], [early_seed("bsp", "heal")]
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = battery(chosen, args.modes, seeds, Path(tmp), args.out, args.spares, args.keep)
    table(outcomes)
    failed = [o for o in outcomes if o.problems]
    for o in failed:
        print(
            f"\nFAILED {o.draw.describe()}\n  {'; '.join(o.problems)}\n  replay: python benchmarks/"
            f"kill_battery.py --rules {o.draw.case} --modes {o.draw.mode} --seeds {o.draw.seed} "
            f"--spares {args.spares}\n"
            f"  {o.tail[-1500:]}"
        )
    print(f"\n{len(outcomes) - len(failed)}/{len(outcomes)} draws survived")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
