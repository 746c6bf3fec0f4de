"""Randomized kills of real jobs: for a rule and a fault tolerance, a seed draws who dies and when.

A draw (:func:`draw`) kills one worker of 4 (rank 0 and the ASGD server's neighbour among them) at a
moment drawn from the whole run: ``delay`` seconds after a training step drawn from all of them (the last
too), so the death lands wherever that step or what follows it is then (its all-reduce, a validation, a
checkpoint, a Streaming DiLoCo fragment in flight); or that long after a validation began; or two workers
at once; or (``heal``) a second worker while the first one's replacement joins. The same seed draws the
same kill (``random.Random`` over a string), so a failure replays:
``python benchmarks/kill_battery.py --rules RULE --modes MODE --seeds SEED``.

:func:`run_draw` runs the job (``tests/helpers/dies.py`` kills with SIGKILL) and :func:`problems` says what
went wrong: a job that did not end ok, a loss not recorded, the wrong number of workers at the end. The
stall watchdog is set to 60 s, so a hang ends the job (exit 4) instead of the caller's timeout.
"""

from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tests.helpers.rules import needs, rules

ROOT = Path(__file__).resolve().parents[2]
WORKERS = 4
EPOCHS = 2
#: Training steps of a worker in a run (digits, 4 workers, 2 epochs), and the last step a kill is drawn
#: at: every step for the rules whose workers step together; for those that do not, a worker's own count
#: varies with its speed (a step it never reaches kills nobody), so theirs end a little earlier and their
#: last moments are drawn after the last validation instead.
STEPS = 24
ASYNCHRONOUS_LAST = 20
MODES = ("continue", "heal")
#: The longest delay drawn after the last step or validation: the job's end (its checkpoint, the closing
#: barrier) takes about this long, so a kill drawn later would come after the job ended.
END_S = 0.06
#: How the job's end names a loss during its growth that it could not come through (Recovery.shrink).
GROWTH_END = "was lost while the job grew"
BASE = (
    "hydra.searchpath=[file://tests/conf]",
    "model=dies",
    "model.die_at=0",
    f"devices={WORKERS}",
    "hardware.oversubscribe=true",
    f"train.epochs={EPOCHS}",
    "train.progress=false",
    "train.log_every=1",  # a record per step: the heal time is read from them
    "train.stall_timeout=60",  # a hang ends the job (exit 4), named, not the caller's timeout
)


def seeds(count: int, fixed: bool = False) -> list[int]:
    """``count`` seeds drawn anew each run (``fixed``: 0, 1, 2...; the same every run), those
    ``MPITRAIN_KILL_SEEDS=3,17`` gives (a replay), or new ones with ``MPITRAIN_KILL_SEEDS=random``."""
    given = os.environ.get("MPITRAIN_KILL_SEEDS", "")
    if given and given != "random":
        return [int(s) for s in given.split(",")]
    if fixed and given != "random":
        return list(range(count))
    return [random.randrange(10**6) for _ in range(count)]


def cases() -> dict[str, list[str]]:
    """The rules as the battery runs them: each rule with its defaults, EASGD in both variants."""
    out = {}
    for rule in rules():
        out[rule] = [f"rule={rule}", *needs(rule)]
        if rule == "easgd":
            out["easgd-async"] = ["rule=easgd", "rule.variant=async"]
    return out


@functools.cache
def asynchronous(case: str) -> bool:
    """Whether the case's rule steps its workers apart (the rule config says so, as for the data's
    assignment)."""
    from omegaconf import OmegaConf

    from tests.conftest import compose_config

    return OmegaConf.to_object(compose_config(cases()[case]).rule).asynchronous()


@dataclass
class Draw:
    """One kill: ``victims`` (launch ranks) die at ``kind``'s moment, set by ``overrides``."""

    case: str
    mode: str
    seed: int
    kind: str
    victims: list[int]
    overrides: list[str]

    def describe(self) -> str:
        moment = " ".join(o for o in self.overrides if o.startswith("model."))
        return f"{self.case} {self.mode} seed {self.seed}: {self.kind}, rank(s) {self.victims} ({moment})"


def draw(case: str, mode: str, seed: int, join: bool = True) -> Draw:
    """The kill that ``seed`` draws for ``case`` under ``mode`` (the same every time); ``join``: a second
    worker may be lost while the first one's replacement joins (``heal``)."""
    rng = random.Random(f"{case}/{mode}/{seed}")
    kinds = {"step": 5, "validation": 2, "two": 2, "join": 2 if mode == "heal" and join else 0}
    kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
    victim = rng.randrange(WORKERS)
    last = ASYNCHRONOUS_LAST if asynchronous(case) else STEPS
    at = rng.randint(1, last)
    delay = round(rng.uniform(0.0, 0.3 if at < last - 1 else END_S), 3)  # (near the end: before it ends)
    moment = [f"model.die_at={at}", f"model.die_delay_s={delay}"]
    victims = [victim]
    if kind == "validation":
        n = rng.randint(1, EPOCHS)
        after = rng.uniform(0, 0.5 if n < EPOCHS else END_S)
        moment = [f"model.die_at_val={n}", f"model.die_delay_s={after:.3f}"]
    elif kind == "two":
        other = rng.choice([r for r in range(WORKERS) if r != victim])
        victims.append(other)
        moment.append(f"model.also_rank={other}")
    elif kind == "join":  # the first loss early enough that its replacement joins before the run ends
        other = rng.choice([r for r in range(WORKERS) if r != victim])
        victims.append(other)
        at = rng.randint(1, last // 2)
        moment = [
            f"model.die_at={at}",
            f"model.join_rank={other}",
            f"model.join_delay_s={rng.uniform(0, 2.5):.3f}",
        ]
    overrides = [*cases()[case], f"hardware.fault_tolerance={mode}", f"model.die_rank={victim}", *moment]
    return Draw(case, mode, seed, kind, victims, overrides)


@dataclass
class Outcome:
    """What a draw's job did: its exit status, the summary's failures and joins, and the heal time."""

    draw: Draw
    returncode: int
    summary: dict[str, Any] = field(default_factory=dict)
    killed_at: float | None = None  # the wall time of the first kill, when one came
    healed_s: float | None = None  # from the first kill to the end of the first step with every worker
    spawn_s: float | None = None  # of which the growth itself (MPI_Comm_spawn, a new process's start-up)
    tail: str = ""
    problems: list[str] = field(default_factory=list)
    void: bool = False  # no kill came: the drawn moment was past the victim's run (a draw of nothing)
    named_end: bool = False  # a loss during the growth ended the job, the cause named, within seconds

    def row(self) -> dict[str, Any]:
        s = self.summary
        return {
            **asdict(self.draw),
            "returncode": self.returncode,
            "status": s.get("status"),
            "workers_at_end": s.get("workers_at_end"),
            "failures": [(f["rank"], f["step"]) for f in s.get("failures", [])],
            "joins": [(j["rank"], j["step"]) for j in s.get("joins", [])],
            "recovery_s": s.get("recovery_time_s"),
            "healed_s": self.healed_s,
            "spawn_s": self.spawn_s,
            "problems": self.problems,
            "void": self.void,
            "named_end": self.named_end,
        }


def run_draw(d: Draw, run_dir: Path, timeout: float = 240) -> Outcome:
    """Run ``d``'s job in ``run_dir`` and judge it (:attr:`Outcome.problems` empty: survived)."""
    stamps = run_dir.parent / f"{run_dir.name}.kills"
    stamps.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "runner", f"hydra.run.dir={run_dir}", *BASE, *d.overrides]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "MPITRAIN_KILL_STAMP": str(stamps / "kill")}
    try:
        proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=env)
        rc, tail = proc.returncode, (proc.stdout + proc.stderr)[-4000:]
    except subprocess.TimeoutExpired as err:
        rc, tail = -9, f"timed out after {timeout} s\n{(err.stdout or b'')[-3000:]!r}"
    out = Outcome(d, rc, tail=tail)
    try:
        out.summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError) as err:
        out.problems.append(f"no summary.json ({err})")
    stamp = stamps / "kill"
    out.killed_at = min(map(float, stamp.read_text().split())) if stamp.is_file() else None
    out.problems += problems(d, out)
    if out.summary.get("status") == "stalled":  # where each rank still running waited (the launcher asked)
        stacks = sorted((run_dir / "logs").glob("rank*.stacks"))
        out.tail += "".join(f"\n--- {p.name}\n{p.read_text()[-1500:]}" for p in stacks)
    if not out.problems and d.mode == "heal" and out.summary.get("joins"):
        out.healed_s, out.spawn_s = healed(run_dir, out.summary, out.killed_at)
    return out


def problems(d: Draw, out: Outcome) -> list[str]:
    """What is wrong with ``out`` for draw ``d``: empty when every loss was survived as it should be."""
    found = []
    s = out.summary
    if d.kind == "join" and out.returncode == 1 and GROWTH_END in out.tail:
        out.named_end = True  # not survived: ended within seconds, the cause named (never a stall)
    if out.returncode != 0 or s.get("status") != "ok":
        found.append(f"exit {out.returncode}, status {s.get('status')}: {s.get('error', '')}")
    if out.killed_at is None:
        out.void = True  # (the drawn moment was past the victim's run): not a draw of a loss
        return found
    lost = sorted(f["rank"] for f in s.get("failures", []))
    if not lost and not found and s.get("workers_at_end") == WORKERS:
        out.void = True  # killed after its last collective (the job's results were whole): nothing to survive
        return found
    # (a replacement caught in its settling in by the loss of another leaves before it trained: recorded,
    # and replaced in turn; ids from WORKERS on are replacements, spawned or promoted spares)
    if not {r for r in lost if r < WORKERS} <= set(d.victims) or not lost:
        found.append(f"lost ranks recorded {lost}, killed {d.victims}")
    joins = {j["rank"] for j in s.get("joins", [])}
    joined = len(joins)
    expected = WORKERS - len([r for r in lost if r < WORKERS or r in joins]) + joined
    if s.get("workers_at_end") != expected:
        found.append(f"{s.get('workers_at_end')} workers at the end, {expected} expected")
    if d.mode == "continue" and joined:
        found.append(f"{joined} worker(s) joined under continue")
    return found


def healed(run_dir: Path, summary: dict[str, Any], killed: float) -> tuple[float | None, float | None]:
    """From the kill (``killed``, wall time) to the end of the first step with every worker again (after
    the last join; None if the run ended first), and the last growth's own time."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    joined = [r for r in records if r["kind"] == "joined"]
    if not joined:
        return None, None
    offset = summary["joins"][-1]["time"] - joined[-1]["time"]  # wall time = relative time + offset
    after = [r["time"] for r in records if r["kind"] == "step" and r["step"] > joined[-1]["step"]]
    return (min(after) + offset - killed) if after else None, joined[-1]["seconds"]
