"""Gradient all-reduce: our bucketed BSP path against raw mpi4py ``Allreduce`` and torch.distributed gloo.

    python benchmarks/allreduce.py                 # 2 ranks, 1 MB to 256 MB
    python benchmarks/allreduce.py --ranks 4 --sizes 1 16 --ring
    python benchmarks/allreduce.py --smoke         # a few seconds: 0.25 MB, 1 repetition, a tiny MLP

Starts itself under mpirun. For each buffer size every method reduces the same number of float32 values:
``raw``: one ``MPI.COMM_WORLD.Allreduce(IN_PLACE)`` on a numpy array (the floor for MPI); ``ours``: BSP's
``after_backward`` over a model whose gradients total that size, in 1 MB parameter tensors, as a training
step leaves them (views of the buckets, already divided by N through the loss): all-reduce each bucket and
hand the gradients back; ``gloo``: ``torch.distributed.all_reduce``; ``ours gloo``: ``ours`` on the
``torch.distributed`` transport with gloo (``hardware.transport=gloo``, the NCCL path's code on CPU).
Times are medians over repetitions, ratios are against ``raw``. With several ``--bucket-mb`` values, one
``ours`` column per bucket size; ``bf16``: the same exchange with ``rule.comm_dtype=bf16`` at the first
bucket size, against its float32 time.
A second table times whole BSP training steps with the all-reduce overlapped with backward or not.
``--smoke`` checks that all of it runs, in seconds: one 0.25 MB buffer, one repetition, and the step table
on an MLP of 2 layers of 64 for 2 timed steps.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from mpijob import in_mpirun, leave, relaunch

#: Open MPI's ring all-reduce (coll_tuned algorithm 4).
RING = {"coll_tuned_use_dynamic_rules": "1", "coll_tuned_allreduce_algorithm": "4"}
#: The step table's MLP (layers of width × width, batch per rank, timed steps): the real one, and --smoke's.
MLP = {"layers": 10, "width": 1024, "batch": 64, "reps": 15}
SMOKE_MLP = {"layers": 2, "width": 64, "batch": 8, "reps": 2}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--sizes", type=float, nargs="+", default=[1, 4, 16, 64, 256], help="buffer sizes in MB")
    p.add_argument("--bucket-mb", type=float, nargs="+", default=[4.0], help="BSP bucket sizes in MB")
    p.add_argument(
        "--ring", action="store_true", help="use Open MPI's ring allreduce (coll_tuned algorithm 4)"
    )
    p.add_argument("--no-gloo", action="store_true")
    p.add_argument("--reps", type=int, default=0, help="repetitions per size (0: by size)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="check that the benchmark runs, in seconds: --sizes 0.25 --reps 1, a tiny MLP's steps",
    )
    args = p.parse_args()
    if args.smoke:
        args.sizes, args.reps = [0.25], 1
    args.mlp = SMOKE_MLP if args.smoke else MLP
    return args


def alternated(methods: dict, reps: int, barrier) -> dict:
    """Median seconds of each of ``methods``, timed in rounds that run every method once (starting from a
    different one each round), so that all of them see the same state of the machine."""
    for fn in methods.values():
        fn()
    times: dict = {name: [] for name in methods}
    order = list(methods.items())
    for k in range(reps):
        for name, fn in order[k % len(order) :] + order[: k % len(order)]:
            barrier()
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def bsp_exchange(comm, numel: int, bucket_mb: float, comm_dtype: str = "fp32"):
    """BSP's gradient exchange over a model of ``numel`` parameters in 1 MB tensors, checked to sum."""
    import torch

    from runner.rules.base import RuleContext
    from runner.rules.bsp import BSPConfig

    chunk = min(numel, 2**18)
    model = torch.nn.ParameterList(
        torch.nn.Parameter(torch.zeros(min(chunk, numel - i))) for i in range(0, numel, chunk)
    )
    for p in model:
        p.grad = torch.full_like(p, comm.rank + 1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    rule = BSPConfig(bucket_mb=bucket_mb, overlap="none", comm_dtype=comm_dtype).build(
        RuleContext(comm, comm, model, optimizer, steps_per_epoch=1)
    )
    rule.after_backward(0)
    n = comm.size
    assert all(float(p.grad[0]) == n * (n + 1) / 2 for p in model), "not the sum over the ranks"
    return lambda: rule.after_backward(0)


def median_time(fn, reps: int, barrier) -> float:
    fn()
    times = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from runner.comm import Comm

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    if not args.no_gloo:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}", rank=rank, world_size=n
        )
    comm = Comm()
    transport = None
    if not args.no_gloo:
        transport = comm.split(0)
        transport.use_transport("gloo")
    rows = []
    for mb in args.sizes:
        numel = int(mb * 2**20 / 4)
        reps = args.reps or max(5, min(200, int(400 / mb)))
        raw = np.ones(numel, dtype=np.float32)
        methods = {"raw": lambda raw=raw: world.Allreduce(MPI.IN_PLACE, raw)}
        for bucket_mb in args.bucket_mb:
            methods[bucket_mb] = bsp_exchange(comm, numel, bucket_mb)
        methods["bf16"] = bsp_exchange(comm, numel, args.bucket_mb[0], "bf16")
        if not args.no_gloo:
            buf = torch.ones(numel)
            methods["gloo"] = lambda buf=buf: dist.all_reduce(buf)
            methods["ours gloo"] = bsp_exchange(transport, numel, args.bucket_mb[0])
        times = alternated(methods, reps, world.Barrier)
        t_gloo, t_transport = times.pop("gloo", float("nan")), times.pop("ours gloo", float("nan"))
        t_raw, t_bf16 = times.pop("raw"), times.pop("bf16")
        rows.append((mb, reps, t_raw, list(times.values()), t_gloo, t_transport, t_bf16))
        del raw, methods

    if rank == 0:
        print_table(args, n, rows)
    overlap_table(comm, rank, n, world, **args.mlp)
    if not args.no_gloo:
        dist.barrier()
        dist.destroy_process_group()


def print_table(args: argparse.Namespace, n: int, rows: list) -> None:
    """Rank 0: the all-reduce table, a row per buffer size."""
    algo = "ring" if args.ring else "Open MPI default"
    buckets = ", ".join(f"{b:g}" for b in args.bucket_mb)
    print(
        f"\nallreduce of float32 buffers, {n} ranks, {algo} algorithm, buckets of {buckets} MB, "
        f"median seconds (bus bandwidth = 2(N-1)/N · size / time)"
    )
    ours_heads = "".join(f"{'ours ' + format(b, 'g'):>10} {'/raw':>6}" for b in args.bucket_mb)
    first = format(args.bucket_mb[0], "g")
    print(
        f"{'MB':>6} {'reps':>4} {'raw mpi4py':>11}{ours_heads} {'gloo':>10} {'gloo/raw':>9} "
        f"{'ours gloo':>10} {'/gloo':>6} {'bf16 ' + first:>10} {'/fp32':>6} {'raw GB/s':>9}"
    )
    for mb, reps, t_raw, t_ours, t_gloo, t_transport, t_bf16 in rows:
        bus = 2 * (n - 1) / n * mb * 2**20 / 1e9
        ours = "".join(f"{t:10.5f} {t / t_raw:6.2f}" for t in t_ours)
        print(
            f"{mb:6g} {reps:4d} {t_raw:11.5f}{ours} {t_gloo:10.5f} {t_gloo / t_raw:9.2f} "
            f"{t_transport:10.5f} {t_transport / t_gloo:6.2f} "
            f"{t_bf16:10.5f} {t_bf16 / t_ours[0]:6.2f} {bus / t_raw:9.2f}"
        )


def overlap_table(comm, rank: int, n: int, world, layers: int, width: int, batch: int, reps: int) -> None:
    """Seconds per BSP training step of an MLP of ``layers`` layers of ``width``² (the real run's: 10 of
    1024², about 40 MB of gradients), for each overlap mode: medians of ``reps`` steps after one."""
    import torch

    from runner.rules.base import RuleContext
    from runner.rules.bsp import BSPConfig

    results = {}
    for overlap in ("none", "nonblocking", "thread"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            *[torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(layers)],
            torch.nn.Linear(width, 10),
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        rule = BSPConfig(bucket_mb=4.0, overlap=overlap).build(RuleContext(comm, comm, model, opt, 1))
        x, y = torch.randn(batch, width), torch.randint(0, 10, (batch,))

        def step(model=model, opt=opt, rule=rule, x=x, y=y):
            opt.zero_grad(set_to_none=False)
            (torch.nn.functional.cross_entropy(model(x), y) * rule.loss_scale).backward()
            rule.after_backward(0)
            opt.step()

        comm.stats.seconds = 0.0
        results[overlap] = (median_time(step, reps, world.Barrier), comm.stats.seconds / (reps + 1))
    if rank == 0:
        base = results["none"][0]
        print(
            f"\nBSP step, MLP {layers}×{width}², batch {batch}/rank, {n} ranks, 4 MB buckets "
            "(median ms; exposed comm ms):"
        )
        for mode, (t, c) in results.items():
            print(f"  overlap={mode:<12} {t * 1e3:7.1f} ms  comm {c * 1e3:6.1f} ms  vs none {t / base:5.2f}")


if __name__ == "__main__":
    arguments = parse()
    if in_mpirun():
        bench(arguments)
        leave()
    else:
        sys.exit(relaunch(__file__, arguments.ranks, RING if arguments.ring else None))
