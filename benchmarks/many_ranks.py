"""The job as it grows: one job on 4 to 64 ranks over up to 16 namespaced nodes, and what each part costs.

    python benchmarks/many_ranks.py                          # BSP and ASGD at 4, 8, 16, 32, 64 ranks
    python benchmarks/many_ranks.py --rules all --sizes 32   # every rule at 32 ranks
    python benchmarks/many_ranks.py --smoke                  # BSP at 4 ranks on 2 nodes, resume and heal
    python benchmarks/many_ranks.py --rules asgd --serve-first   # and with the serving ranks first

Needs root: the nodes are network and UTS namespaces (``tests/cluster/nodes.py``), brought up once for the
largest size (16 nodes in about a second); a size of N ranks uses N/2 nodes of 2 ranks, at most 16 nodes
(64 ranks: 4 a node). Each rank trains an MLP on synthetic data with one torch thread, the same 20 steps an
epoch at every size (the data grows with the workers: weak scaling), 2 epochs, a checkpoint every 10 steps.
Per size and rule a row of a table:

- ``first step``: from the launcher's start to the first training step on record (``metrics.jsonl``);
  ``CPU floor``: the ranks' CPU seconds until then (imports, MPI's start, the model) over this machine's
  cores, the soonest it could come here, whatever mpitrain does (every rank shares the cores);
- ``step``: the median step; the control plane's parts in ms per step, as each worker measured them
  (``summary.json``'s ``control_ms_per_step``): the agreement (or ASGD's board), the dealer's counter
  (dynamic assignment), the heartbeat's writes (CPU, on its own thread);
- ``checkpoint``: the last checkpoint, the slowest worker's (every rank writes its part, rank 0 the index),
  and ``part MB`` one rank's part;
- ``launcher CPU``: the launcher's own CPU seconds per second of the job (it reads every rank's heartbeat);
- ``ranks' RSS``: the ranks' memory at its peak, in all;
- (BSP) ``resume``: ``python -m runner resume=...`` to its first step; ``heal``: the last rank on the last
  node SIGKILLed at step 8 under ``hardware.fault_tolerance=heal``: ``recovery`` (the survivors' ULFM
  agreement and shrink) and ``healed``, from the kill to the first step with every worker again (a free
  slot waits on the last node). A heal that Open MPI's merge failed (``MPI_Intercomm_merge``, rare: the job
  ends naming it) is run once more, both rows shown.

``--serve-first`` runs each job once more with the ranks that serve the others' calls (worker 0, which
holds the dealer's counter and the board; the servers) at a higher priority than the rest, as cores of
their own would give them: here every rank shares 2 cores, so a served call waits for its host's turn.

After the table (not in ``--smoke``): the launcher's reading of 64, 1,024 and 8,192 heartbeats and a rank's
write of its own; MPI's start alone at each size; the calls per second the counter's host serves; a call's
time while every rank computes, beside a 1 ms sleep's lateness (``counter_across.py --latency``).

A size whose ranks would not fit in the memory left (the last size's RSS per rank times the ranks, plus a
margin) is skipped and said so. ``--out FILE`` keeps every row (JSON lines).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.cluster.many import (  # noqa: E402
    cpu_seconds,
    job,
    kill_rank,
    layout,
    prioritize,
    ranks_usage,
    serving_ranks,
)
from tests.cluster.nodes import Nodes, metrics_records, why_unsupported  # noqa: E402
from tests.helpers.kill_battery import healed  # noqa: E402
from tests.helpers.rules import rules  # noqa: E402

EPOCHS = 2
KILL_AT = 8
#: The cores every rank shares here: the ranks' CPU to their first step, over these, is its floor.
CORES = len(os.sched_getaffinity(0))
#: Memory kept free beside the ranks (the launcher, mpirun's daemons, the page cache).
MARGIN_MB = 1500


@dataclass
class Row:
    rule: str
    ranks: int
    nodes: int
    what: str = "job"  # job, resume, heal
    status: str = ""
    first_step_s: float | None = None
    wall_s: float | None = None
    step_ms: float | None = None
    control_ms: dict[str, float] = field(default_factory=dict)
    checkpoint_s: float | None = None
    launcher_cpu: float | None = None
    rank_cpu_s: float | None = None
    rss_mb: float | None = None
    healed_s: float | None = None
    spawn_s: float | None = None  # the growth itself (spawn, merge, welcome)
    recovery_s: float | None = None  # the survivors' recovery (ULFM's agreement, the shrink)
    part_mb: float | None = None  # one rank's part of a checkpoint
    workers_at_end: int | None = None
    note: str = ""


@dataclass
class Watch:
    """What is sampled while a job runs."""

    start: float
    first_step: float | None = None
    cpu: float | None = None
    rss: float = 0.0
    rank_cpu: float | None = None  # the ranks' mean CPU seconds when the first step was on record
    killed_at: float | None = None


def run_job(
    nodes: Nodes,
    run_dir: Path,
    argv_overrides: list[str],
    count: int,
    kill: bool,
    timeout: float,
    serving: dict[int, set[int]] | None = None,
    victim: int | None = None,
):
    """Run the launcher on node 1; sample its first step, its CPU and the ranks' memory; maybe kill a rank.

    ``serving``: ranks given priority over the others (``--serve-first``), checked every half second;
    ``victim``: the launch rank killed (None: the last node's highest).

    Returns the exit status, the output's tail and the :class:`Watch`."""
    argv = [sys.executable, "-m", "runner", f"hydra.run.dir={run_dir}", *argv_overrides]
    log = run_dir.parent / f"{run_dir.name}.out"
    env = {**os.environ, **nodes.mpi_env(), "PYTHONUNBUFFERED": "1"}
    with log.open("w") as out:
        before = len(_steps_on_record(run_dir))  # (a resumed run's metrics.jsonl goes on)
        watch = Watch(time.time())
        proc = nodes.popen(
            0, argv, env=env, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        last_rss = last_nice = 0.0
        while proc.poll() is None:
            now = time.time()
            if now - watch.start > timeout:
                os.killpg(proc.pid, 9)
                proc.wait()
                break
            watch.cpu = cpu_seconds(proc.pid) or watch.cpu
            steps = _steps_on_record(run_dir)
            if watch.first_step is None and len(steps) > before:
                watch.first_step = now - watch.start
                _, cpu, found = ranks_usage(nodes, count)
                watch.rank_cpu = cpu / max(found, 1)
            if now - last_rss > 1.0:
                watch.rss, last_rss = max(watch.rss, ranks_usage(nodes, count)[0]), now
            if serving and now - last_nice > 0.5:
                prioritize(nodes, serving)
                last_nice = now
            if kill and watch.killed_at is None and steps and steps[-1] >= KILL_AT:
                watch.killed_at = kill_rank(nodes, count - 1, victim)
            time.sleep(0.02)
    return proc.returncode, log.read_text()[-3000:], watch


def _steps_on_record(run_dir: Path) -> list[int]:
    """The steps of the training records in ``run_dir``'s metrics.jsonl so far, in order."""
    return [r["step"] for r in metrics_records(run_dir) if r.get("kind") == "step"]


def measure(
    nodes: Nodes,
    scratch: Path,
    rule: str,
    ranks: int,
    what: str = "job",
    serve_first: bool = False,
    stall_timeout: int = 300,
) -> Row:
    """One row: the job (``what`` = job), its resume, or the job with a rank killed under heal (``heal
    (spare)``: replaced by a warm spare, ``hardware.spares=1``, in the last node's free slot)."""
    count, _ = layout(ranks)
    row = Row(rule, ranks, count, what + (" (serve first)" if serve_first else ""))
    spare, victim = what == "heal (spare)", None
    what = "heal" if spare else what
    run_dir = scratch / f"{rule}-{ranks}"
    argv = job(rule, ranks, nodes.names, EPOCHS, 1 if what == "heal" else 0, stall_timeout)
    if what == "resume":
        argv = [f"resume={run_dir}", f"train.epochs={EPOCHS + 1}"]
    elif what == "heal":
        run_dir = scratch / f"{rule}-{ranks}-heal{'-spare' if spare else ''}"
        argv += ["hardware.fault_tolerance=heal"]
        if spare:  # (the spare is the last launch rank: the last worker dies beside it)
            argv, victim = [*argv, "hardware.spares=1"], ranks - 1
    serving = None
    if serve_first:
        run_dir, serving = scratch / f"{rule}-{ranks}-served", serving_ranks(rule, ranks)
    if what != "resume":  # (a run measured again starts afresh)
        shutil.rmtree(run_dir, ignore_errors=True)
    code, tail, watch = run_job(
        nodes, run_dir, argv, count, kill=what == "heal", timeout=600, serving=serving, victim=victim
    )
    wall = time.time() - watch.start
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        summary = {}
    row.status = summary.get("status", f"exit {code}")
    if row.status != "ok":
        row.note = tail.strip().splitlines()[-1][:200] if tail.strip() else ""
    records = metrics_records(run_dir)
    steps = [r["step_ms"] for r in records if r.get("kind") == "step" and "step_ms" in r]
    row.first_step_s, row.wall_s = watch.first_step, wall
    row.step_ms = statistics.median(steps) if steps else None
    row.control_ms = summary.get("control_ms_per_step", {})
    row.checkpoint_s = summary.get("checkpoint_s")
    row.launcher_cpu = (watch.cpu / wall) if watch.cpu is not None else None
    row.rss_mb, row.workers_at_end = watch.rss or None, summary.get("workers_at_end")
    row.rank_cpu_s = watch.rank_cpu
    if what == "heal" and watch.killed_at is not None and summary.get("joins"):
        row.healed_s, row.spawn_s = healed(run_dir, summary, watch.killed_at)
    row.recovery_s = next((r["recovery_s"] for r in records if r.get("kind") == "failure"), None)
    parts = sorted((run_dir / "checkpoints").glob("*/rank*"))  # the last checkpoints' parts
    row.part_mb = parts[-1].stat().st_size / 2**20 if parts else None
    return row


def fits(ranks: int, per_rank_mb: float | None) -> str | None:
    """Why ``ranks`` ranks would not fit in the memory available now (None: they fit, or unknown)."""
    if per_rank_mb is None:
        return None
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    available = int(next(x.split()[1] for x in meminfo if x.startswith("MemAvailable"))) / 1024
    need = ranks * per_rank_mb + MARGIN_MB
    if need <= available:
        return None
    return f"skipped: {ranks} ranks x {per_rank_mb:.0f} MB + {MARGIN_MB} MB > {available:.0f} MB available"


def _cell(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


#: The table's columns.
HEADER = (
    "| rule | ranks | nodes | run | status | first step s | CPU floor s | step ms | agreement ms | deal ms "
    "| heartbeat ms | checkpoint s | part MB | launcher CPU s/s | ranks' RSS MB | recovery s | healed s |"
)


def show(row: Row) -> str:
    """One row of the table (ms per step for the control plane's parts; ``-``: not measured, or none)."""
    c = row.control_ms
    cells = [
        row.rule,
        str(row.ranks),
        str(row.nodes),
        row.what,
        row.status,
        _cell(row.first_step_s, 1),
        _cell(None if row.rank_cpu_s is None else row.rank_cpu_s * row.ranks / CORES, 1),
        _cell(row.step_ms, 1),
        *(_cell(c.get(part)) for part in ("agreement", "deal", "heartbeat")),
        _cell(row.checkpoint_s, 3),
        _cell(row.part_mb, 2),
        _cell(row.launcher_cpu, 3),
        _cell(row.rss_mb, 0),
        _cell(row.recovery_s, 2),
        _cell(row.healed_s, 1),
    ]
    line = "| " + " | ".join(cells) + " |"
    return line + (f"\n  ({row.note})" if row.note else "")


def beat_reading(ranks: int, rounds: int = 5) -> tuple[float, float]:
    """The launcher's reading of ``ranks`` heartbeats (one watch, local disk), and one rank's write of its
    own: the medians, in ms."""
    from runner.launcher.watchdog import read_beats
    from runner.run_folder import rank_file, write_atomic

    with tempfile.TemporaryDirectory(prefix="beats-") as folder:
        run_dir = Path(folder)
        (run_dir / "logs").mkdir()
        writes = []
        for r in range(ranks):
            beat = {"rank": r, "pid": 1, "host": "n", "role": "worker", "step": 5}
            start = time.perf_counter()
            write_atomic(
                rank_file(run_dir, r, "beat"),
                json.dumps({**beat, "progress_time": time.time(), "alive_time": time.time()}),
            )
            writes.append(time.perf_counter() - start)
        reads = []
        for _ in range(rounds):
            start = time.perf_counter()
            beats = read_beats(run_dir / "logs", ranks, 0.0, {})
            reads.append(time.perf_counter() - start)
        assert len(beats) == ranks
    return 1000 * statistics.median(reads), 1000 * statistics.median(writes)


def _mpirun(nodes: Nodes, ranks: int, *python_args: str) -> list[str]:
    """mpirun of ``python PYTHON_ARGS`` on ``ranks`` ranks laid out as the job's, unbound and yielding."""
    count, per_node = layout(ranks)
    hosts = ",".join(f"{n}:{per_node}" for n in nodes.names[:count])
    mpirun = str(Path(sys.executable).parent / "mpirun")
    argv = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--host", hosts]
    return argv + ["-n", str(ranks), "--mca", "mpi_yield_when_idle", "1", sys.executable, *python_args]


def counter_rate(nodes: Nodes, ranks: int, seconds: float = 3.0, mode: str = "--rate") -> str:
    """The calls per second the dealer's counter serves, its host on node 1 computing, from the other
    ranks of ``ranks`` laid out as the job's (``tests/helpers/counter_across.py --rate``); ``--latency``:
    a call's time and a 1 ms sleep's lateness while every rank computes."""
    script = ROOT / "tests" / "helpers" / "counter_across.py"
    argv = _mpirun(nodes, ranks, str(script), str(seconds), mode)
    env = {**os.environ, **nodes.mpi_env(), "PYTHONPATH": str(ROOT)}
    done = nodes.run(0, argv, env=env, timeout=300)
    lines = [x for x in done.stdout.splitlines() if "calls/s" in x or "medians" in x]
    return lines[0] if done.returncode == 0 and lines else f"failed ({done.returncode}): {done.stderr[-300:]}"


#: A rank that only starts MPI and meets the others: the launch's own part of the first step.
HELLO = "from mpi4py import MPI; MPI.COMM_WORLD.Barrier()"


def mpi_start(nodes: Nodes, ranks: int) -> float:
    """Seconds for mpirun to start ``ranks`` ranks of :data:`HELLO` on the job's nodes and end them."""
    argv = _mpirun(nodes, ranks, "-c", HELLO)
    start = time.perf_counter()
    done = nodes.run(0, argv, env={**os.environ, **nodes.mpi_env()}, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"mpirun of {ranks} ranks failed: {done.stderr[-500:]}")
    return time.perf_counter() - start


def at_size(nodes: Nodes, sizes: list[int]) -> None:
    """The control plane's shared parts, measured beside the jobs: heartbeats and the counter."""
    print("\n| heartbeats | the launcher's reading (one watch) | one rank's write |\n| --- | --- | --- |")
    for ranks in (64, 1024, 8192):
        read, write = beat_reading(ranks)
        print(f"| {ranks:,} | {read:.1f} ms | {write:.3f} ms |", flush=True)
    print("\nMPI's start alone (mpirun, MPI_Init, a barrier, the end):")
    for ranks in sorted(sizes):
        count, per_node = layout(ranks)
        print(f"  {ranks} ranks on {count} nodes: {mpi_start(nodes, ranks):.2f} s", flush=True)
    print("\ncounter (dealer, board), host on node 1:")
    for ranks in sorted(sizes):
        count, per_node = layout(ranks)
        print(f"  {count} nodes x {per_node}: {counter_rate(nodes, ranks)}", flush=True)
    print("\na call on the counter while every rank computes (the machine's share: a 1 ms sleep's lateness):")
    for ranks in sorted(sizes):
        count, per_node = layout(ranks)
        print(f"  {count} nodes x {per_node}: {counter_rate(nodes, ranks, 8.0, '--latency')}", flush=True)


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The command line's options."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    parser.add_argument("--rules", nargs="+", default=["bsp", "asgd"], help="rule names, or 'all'")
    parser.add_argument("--no-resume", action="store_true", help="skip the resume of each BSP job")
    parser.add_argument("--no-heal", action="store_true", help="skip BSP's job with a rank killed (heal)")
    parser.add_argument(
        "--spares", action="store_true", help="BSP's heal by a warm spare too (hardware.spares)"
    )
    parser.add_argument("--out", type=Path, help="append every row to this file (JSON lines)")
    parser.add_argument("--scratch", type=Path, help="keep the run folders here (default: a temporary one)")
    parser.add_argument(
        "--serve-first",
        action="store_true",
        help="also run each job with the ranks that serve others' calls (worker 0, servers) given priority "
        "over the rest, as cores of their own would",
    )
    parser.add_argument(
        "--stall-timeout",
        type=int,
        default=300,
        help="train.stall_timeout of each job (a rank's start counts: 64 ranks on 2 cores can take longer)",
    )
    parser.add_argument("--jobs-only", action="store_true", help="leave out the shared parts' measurements")
    parser.add_argument("--smoke", action="store_true", help="BSP at 4 ranks on 2 nodes, resume and heal")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.rules = [4], ["bsp"]
    args.chosen = rules() if args.rules == ["all"] else args.rules
    unknown = sorted(set(args.chosen) - set(rules()))
    if unknown:
        parser.error(f"--rules: no rule {', '.join(unknown)} (rules: {', '.join(rules())}, or all)")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the sizes and rules asked; print a line per job; 1 if a job did not end ok."""
    args = parse(argv)
    reason = why_unsupported()
    if reason:
        print(f"many_ranks: {reason}")
        return 2
    failed, per_rank = 0, None
    largest, _ = layout(max(args.sizes))
    with Nodes.up(largest) as nodes, tempfile.TemporaryDirectory(prefix="many-ranks-") as temporary:
        scratch = args.scratch or temporary
        Path(scratch).mkdir(parents=True, exist_ok=True)
        print(f"{largest} nodes up in {nodes.timings['up']:.2f} s\n\n{HEADER}", flush=True)
        print("|" + " --- |" * HEADER.count(" |"), flush=True)
        for ranks in sorted(args.sizes):
            if why := fits(ranks, per_rank):
                print(f"| all | {ranks} | {layout(ranks)[0]} | - | {why} |", flush=True)
                continue
            for rule in args.chosen:
                whats = ["job"]
                if rule == "bsp":
                    whats += [w for w, off in (("resume", args.no_resume), ("heal", args.no_heal)) if not off]
                    whats += ["heal (spare)"] * (args.spares and not args.no_heal)
                runs = [(what, False) for what in whats] + [("job", True)] * args.serve_first
                for what, first in runs:
                    row = measure(nodes, Path(scratch), rule, ranks, what, first, args.stall_timeout)
                    if what == "heal" and "MPI_Intercomm_merge" in row.note:  # Open MPI's, rare: once more
                        print(show(row), flush=True)
                        row = measure(nodes, Path(scratch), rule, ranks, what, first, args.stall_timeout)
                    print(show(row), flush=True)
                    failed += row.status != "ok"
                    if row.rss_mb and row.what == "job":
                        per_rank = max(per_rank or 0, row.rss_mb / ranks)
                    if args.out:
                        with args.out.open("a") as f:
                            f.write(json.dumps(asdict(row)) + "\n")
        if not (args.smoke or args.jobs_only):
            at_size(nodes, args.sizes)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
