"""The hierarchical exchange (issue 35, item 3): on 2 nodes of 2 ranks whose links are limited by ``tc tbf``
(network namespaces, tests/cluster/nodes.py), the bytes each node sends across its link per all-reduce
(its veth's ``tx_bytes``) and the time, for Open MPI's own collectives (coll/han, its default across
nodes; coll/tuned with han off: its own choice, and its ring) and for ``hardware.hierarchical=on``
(runner/comm/routes/hierarchical.py): a raw all-reduce, and a BSP step.

    python benchmarks/hierarchical.py                    # 8.8 MB all-reduce and BSP, 100 Mbit/s, 5 repeats
    python benchmarks/hierarchical.py --rate 1gbit --repeats 9
    python benchmarks/hierarchical.py --smoke            # the route only: small all-reduce, few steps

Every variant runs with the MCA options a job has by default (``hardware.mca``), ``mpi_yield_when_idle``
(4 ranks share this machine's 2 cores: ranks waiting in MPI yield them) and unbound. Medians of the
repeats (raw) and of the steps after the third (BSP); the bytes are the median over the repeats of what
each node's link carried, the larger node's. Without root or network namespaces it says so and prints
nothing else.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

#: Variants: (name, MCA options, hardware.hierarchical).
VARIANTS = [
    ("coll/han (Open MPI's default)", {}, "off"),
    ("coll/tuned, han off", {"coll": "^han"}, "off"),
    (
        "tuned ring, han off",
        {"coll": "^han", "coll_tuned_use_dynamic_rules": 1, "coll_tuned_allreduce_algorithm": 4},
        "off",
    ),
    ("hierarchical=on", {}, "on"),
]
#: Every variant: ranks waiting in MPI yield the 2 cores the 4 ranks share.
YIELD = {"mpi_yield_when_idle": 1}
TX = "/sys/class/net/eth0/statistics/tx_bytes"


def tx_bytes() -> int:
    """What this node's link has sent (read inside the node's network namespace)."""
    return int(Path(TX).read_text())


def job(numel: int, repeats: int, mode: str) -> None:
    """Inside the mpirun job: ``repeats`` timed all-reduces of ``numel`` float32 values through ``Comm``;
    rank 0 prints a JSON line: seconds (slowest rank) and bytes sent by each node's link, per repeat."""
    import torch

    from runner.comm.mpi import init
    from runner.comm.routes.hierarchical import settle

    comm = init()
    settle(comm, mode)
    local = comm.local_rank()
    t = torch.full((numel,), float(comm.rank + 1))
    comm.allreduce(t)  # warm up: connections, buffers
    seconds, sent = [], []
    for _ in range(repeats):
        t.fill_(comm.rank + 1)
        comm.barrier()
        before, t0 = tx_bytes(), time.perf_counter()
        comm.allreduce(t)
        took = time.perf_counter() - t0
        comm.barrier()
        after = tx_bytes()
        seconds.append(max(comm.allgather_object(took)))
        sent.append(
            [b for b in comm.allgather_object(after - before if local == 0 else None) if b is not None]
        )
    assert torch.all(t == comm.size * (comm.size + 1) / 2), "wrong sum"
    if comm.rank == 0:
        print("RESULT " + json.dumps({"seconds": seconds, "sent": sent}), flush=True)


def mca_args(mca: dict) -> list[str]:
    return [w for k, v in {**YIELD, **mca}.items() for w in ("--mca", k, str(v))]


def raw(nodes, numel: int, repeats: int, mca: dict, mode: str) -> tuple[float, float]:  # noqa: ANN001
    """Median ms and bytes per node of a raw all-reduce of ``numel`` float32 values on the nodes."""
    from runner.hardware.mca import DEFAULT_MCA
    from runner.hardware.mpirun import find_mpirun

    n1, n2 = nodes.names
    argv = [find_mpirun(None), "--host", f"{n1}:2,{n2}:2", "-np", "4", "--bind-to", "none"]
    argv += ["--allow-run-as-root"] if os.geteuid() == 0 else []
    argv += [*mca_args({**DEFAULT_MCA, **mca}), "-x", f"PYTHONPATH={ROOT}"]  # as a job's mpirun
    argv += [sys.executable, __file__, "--job", str(numel), str(repeats), mode]
    proc = nodes.run(0, argv, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the all-reduce job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    result = json.loads(lines[0][7:])
    return 1e3 * statistics.median(result["seconds"]), statistics.median(max(s) for s in result["sent"])


def bsp(nodes, folder: Path, model: list[str], steps: int, mca: dict, mode: str) -> tuple[float, float]:  # noqa: ANN001
    """Median step ms (after the third step) and bytes per step of the busier node, of a BSP job on the
    nodes: each node's link read as the job passes its steps."""
    from tests.cluster.conftest import default_hosts
    from tests.cluster.nodes import metrics_records
    from tests.conftest import Run, cli_argv

    overrides = [
        *default_hosts(nodes),
        "devices=4",
        "hardware.bind=none",
        f"hardware.hierarchical={mode}",
        *(f"+hardware.mca.{k}='{v}'" for k, v in {**YIELD, **mca}.items()),
        "rule=bsp",
        *model,
        f"train.max_steps={steps}",
        "train.log_every=1",
    ]
    env = {**os.environ, **nodes.mpi_env(), "PYTHONUNBUFFERED": "1"}
    proc = nodes.popen(
        0,
        cli_argv(folder, *overrides),
        env=env,
        cwd=ROOT,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
    )
    samples: list[tuple[int, int]] = []  # (last step done, bytes the busier node sent so far)

    def watch() -> None:
        while proc.poll() is None:
            done = max((r["step"] for r in metrics_records(folder) if r.get("kind") == "step"), default=0)
            sent = [int(nodes.run(i, ["cat", TX], timeout=10).stdout) for i in (0, 1)]
            samples.append((done, max(sent)))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    out, _ = proc.communicate(timeout=900)
    watcher.join()
    run = Run(subprocess.CompletedProcess(proc.args, proc.returncode, out, ""), folder)
    if proc.returncode != 0:
        raise RuntimeError(f"the BSP job failed ({folder}):\n{out[-3000:]}")
    assert run.summary["versions"]["hierarchical"] == mode, run.summary["versions"]
    first, last = 3, steps - 1  # bytes from when step 3 was done to when step steps-1 was
    at = {step: sent for step, sent in reversed(samples)}  # the earliest sample of each step
    start, end = min(s for s in at if s >= first), min(s for s in at if s >= last)
    per_step = (at[end] - at[start]) / max(1, end - start)
    return statistics.median(r["step_ms"] for r in run.records("step")[3:]), per_step


def table(title: str, rows: list[tuple[str, float, float]]) -> str:
    """A Markdown table: each variant's ms and MB, and both as ratios to the first row's."""
    base_ms, base_b = rows[0][1], rows[0][2]
    lines = [
        f"| {title} | ms | MB across a node's link | ms vs han | MB vs han |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, ms, sent in rows:
        ratio = f"{sent / base_b:.2f}" if base_b else "-"  # (steps faster than the link is read: none seen)
        lines.append(f"| {name} | {ms:.0f} | {sent / 1e6:.2f} | {ms / base_ms:.2f} | {ratio} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", default="100mbit", help="tc rate of each node's link")
    parser.add_argument("--numel", type=int, default=2_200_000, help="float32 values all-reduced (8.8 MB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", default="", help="the variants whose names hold this text")
    parser.add_argument(
        "--smoke", action="store_true", help="the route only: 64k values, 2 repeats, 6 BSP steps"
    )
    parser.add_argument("--job", nargs=3, help=argparse.SUPPRESS)  # inside mpirun: NUMEL REPEATS MODE
    args = parser.parse_args()
    if args.job:
        job(int(args.job[0]), int(args.job[1]), args.job[2])
        return
    from tests.cluster.nodes import Nodes, why_unsupported

    reason = why_unsupported()
    if reason:
        print(f"left out: {reason}")
        return
    model = ["model=mlp", "model.hidden=[1024,1024,1024]"]  # 2.2M parameters: 8.8 MB of gradients
    variants = [v for v in VARIANTS if args.only in v[0]]
    if args.smoke:
        args.numel, args.repeats, args.steps, model = 65_536, 2, 6, ["model=mlp", "model.hidden=[32]"]
        variants = [VARIANTS[-1]]  # the route: the code this benchmark guards
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    raws, steps = [], []
    with Nodes.up(2) as nodes, tempfile.TemporaryDirectory() as tmp:
        for node in (0, 1):
            nodes.rate(node, args.rate)
        for i, (name, mca, mode) in enumerate(variants):
            raws.append((name, *raw(nodes, args.numel, args.repeats, mca, mode)))
            steps.append((name, *bsp(nodes, Path(tmp) / f"bsp{i}", model, args.steps, mca, mode)))
            print(f"  {name}: all-reduce {raws[-1][1]:.0f} ms, BSP step {steps[-1][1]:.0f} ms", flush=True)
    print(f"load after: {os.getloadavg()[0]:.2f}")
    print(f"2 nodes x 2 ranks, {args.rate}, all-reduce of {args.numel * 4 / 1e6:.2f} MB:")
    print(table("all-reduce", raws))
    print(f"BSP step ({' '.join(model)}):")
    print(table("BSP step", steps))


if __name__ == "__main__":
    main()
