"""Training-step throughput: our BSP step (``runner.rank.loop.Trainer.step``) against PyTorch's
``DistributedDataParallel`` over gloo, on the same model, data and per-rank batch.

    python benchmarks/step_vs_ddp.py                            # 2 ranks, MLP, CNN and ResNet-18
    python benchmarks/step_vs_ddp.py --models mlp --rounds 3 --steps 10
    python benchmarks/step_vs_ddp.py --overlap none thread      # one "ours" row per overlap mode
    python benchmarks/step_vs_ddp.py --smoke                    # a few seconds: tiny MLP, 1 round of 2 steps

Starts itself under mpirun (one core per rank, one torch thread). Each rank trains on a few fixed in-memory
batches of its own (``torch.randn`` inputs, random labels, made once), so no data loading is timed on either
side. ``ours`` is the runner's real step: a ``Trainer`` with the BSP rule (``BSPConfig`` defaults unless
``--bucket-mb`` / ``--overlap`` say otherwise) over ``runner.comm.Comm``; ``ddp`` is the textbook loop
zero_grad, forward, cross_entropy, backward, optimizer step, ``loss.item()`` around
``DistributedDataParallel(model)`` with its defaults. Both use SGD (lr 0.01, momentum 0.9, no weight decay)
and start from the same parameters (same seed).

Per model, ``--rounds`` rounds each run every method for ``--warmup`` steps and then ``--steps`` timed steps
(after a barrier), in an order rotated every round. A method's time in a round is the slowest rank's; the
table gives medians over the rounds of ms per step, global samples/s (ranks × batch / step time), the median
of the per-round ratios ours ÷ DDP of samples/s, and our exposed communication per step (the seconds
``Comm`` spent in MPI calls or waiting for the communication thread). After the first round, which every
method ran on the same batches from the same start, the parameters must agree with DDP's (``max |Δ|``):
otherwise the two would not be doing the same computation and the run fails.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

from mpijob import in_mpirun, leave, relaunch

MODELS = ("mlp", "cnn", "resnet18")
#: (warm-up, timed) steps per round: 1.5 to 4 s of timed steps per method and round on one core per rank.
STEPS = {"mlp": (5, 40), "cnn": (3, 20), "resnet18": (2, 10)}
BATCHES = 8
#: --smoke: the MLP's hidden layers, and the arguments it stands for.
SMOKE_HIDDEN = [64]
SMOKE = {"models": ["mlp"], "batch": 4, "rounds": 1, "steps": 2, "warmup": 1}
SEED = 0
TOLERANCE = 1e-4


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--batch", type=int, default=32, help="samples per rank and step")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=0, help="timed steps per round (0: by model)")
    p.add_argument("--warmup", type=int, default=-1, help="untimed steps before each timing (-1: by model)")
    p.add_argument("--bucket-mb", type=float, default=None, help="BSP bucket size (default: BSP's)")
    p.add_argument(
        "--overlap",
        nargs="+",
        choices=("auto", "none", "thread", "nonblocking"),
        default=["auto"],
        help="BSP overlap modes, one 'ours' per mode",
    )
    p.add_argument(
        "--smoke",
        action="store_true",
        help="check that the benchmark runs, in seconds: an MLP with one hidden layer of 64, batch 4, "
        "one round of 1 warm-up and 2 timed steps (the parameters still checked against DDP's)",
    )
    args = p.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    return args


def model_config(name: str, smoke: bool = False):
    """The model's config (the project's dataclasses), for 32×32 RGB images and 10 classes (``smoke``: the
    MLP's hidden layers tiny)."""
    from runner.models.cnn import CNNConfig
    from runner.models.mlp import MLPConfig
    from runner.models.resnet import ResNetConfig

    shape = [3, 32, 32]
    if name == "mlp":
        return MLPConfig(input_shape=shape, num_classes=10, hidden=SMOKE_HIDDEN if smoke else [1024, 1024])
    if name == "cnn":
        return CNNConfig(input_shape=shape, num_classes=10)
    return ResNetConfig(input_shape=shape, num_classes=10, depth=18)


def sgd(params):
    from runner.optim.sgd import SGDConfig

    return SGDConfig(lr=0.01, momentum=0.9, weight_decay=0.0).build(params)


def make_trainer(model, optimizer, rule, comm, batch: int, total_steps: int):
    """A ``runner.rank.loop.Trainer`` for ``Trainer.step`` alone, built as ``runner.rank.worker.build`` builds
    it (the task and schedule from their configs: classification, a constant rate), on the CPU. The whole
    construction is here, so that a change of the constructor is made in this one place. What ``step`` does
    not use is inert: no loaders, a metrics log that writes nothing, a meter with no output (the guard
    echoes through it), no heartbeat, control or recovery."""
    import torch

    from runner.rank.loop import Parts, Place, Records, Trainer
    from runner.rank.records.meter import Meter
    from runner.rank.records.metrics import MetricsLog
    from runner.schedule.constant import ConstantConfig
    from runner.schema.sections import TrainConfig
    from runner.tasks.classification import ClassificationConfig

    task = ClassificationConfig().build(10)
    schedule = ConstantConfig().build(optimizer, total_steps, rule.lr_factor)
    log = MetricsLog(Path(os.devnull), enabled=False)
    meter = Meter(comm.stats, comm.size, total_steps, log, log_every=1, progress=False)
    records = Records(log, meter, None, None)
    place = Place(comm, torch.device("cpu"))
    parts = Parts(model, optimizer, rule, task, schedule)
    return Trainer(TrainConfig(batch_size=batch), parts, (None, None), place, records)


class Ours:
    """The runner's training step: ``Trainer.step`` with the BSP rule, advancing a ``Position`` as ``fit``
    does (one micro-batch per step)."""

    def __init__(self, cfg, comm, batches, batch: int, overlap: str, bucket_mb: float | None, steps: int):
        import torch

        from runner.rank.state import Position, broadcast_state
        from runner.rules.base import RuleContext
        from runner.rules.bsp import BSPConfig

        torch.manual_seed(SEED)
        self.model = cfg.build()
        broadcast_state(self.model, comm)
        optimizer = sgd(self.model.parameters())
        options = {"overlap": overlap} | ({} if bucket_mb is None else {"bucket_mb": bucket_mb})
        rule_cfg = BSPConfig(**options)
        self.rule = rule_cfg.build(RuleContext(comm, comm, self.model, optimizer, len(batches)))
        self.name = f"ours {overlap}" + (f"→{self.rule.overlap}" if overlap == "auto" else "")
        count = len(self.rule.buckets)
        self.settings = f"{count} bucket{'s' * (count != 1)} of ≤{rule_cfg.bucket_mb:g} MB"
        self.trainer = make_trainer(self.model, optimizer, self.rule, comm, batch, steps)
        self.batches, self.pos = batches, Position()

    def step(self) -> None:
        x, y = self.batches[self.pos.step % len(self.batches)]
        assert self.trainer.step([(x, y)], self.pos)
        self.pos.step, self.pos.batch = self.pos.step + 1, self.pos.batch + 1


class DDP:
    """``DistributedDataParallel`` with its defaults and the usual loop, the loss read once per step."""

    name = "ddp"

    def __init__(self, cfg, batches):
        import torch
        from torch.nn.parallel import DistributedDataParallel

        torch.manual_seed(SEED)
        self.model = cfg.build()
        self.ddp = DistributedDataParallel(self.model)
        self.optimizer = sgd(self.ddp.parameters())
        self.batches, self.count = batches, 0
        self.cross_entropy = torch.nn.functional.cross_entropy

    def step(self) -> None:
        x, y = self.batches[self.count % len(self.batches)]
        self.optimizer.zero_grad()
        loss = self.cross_entropy(self.ddp(x), y)
        loss.backward()
        self.optimizer.step()
        loss.item()
        self.count += 1


def max_difference(a, b) -> float:
    import torch

    with torch.no_grad():
        return max(float((p - q).abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def bench_model(name: str, args: argparse.Namespace, comm, world) -> list[dict]:
    import torch
    from mpi4py import MPI

    warmup, steps = STEPS[name]
    warmup = warmup if args.warmup < 0 else args.warmup
    steps = args.steps or steps
    cfg = model_config(name, args.smoke)
    g = torch.Generator().manual_seed(SEED + 1000 * comm.rank + 1)
    shape = (args.batch, *cfg.input_shape)
    batches = [
        (torch.randn(shape, generator=g), torch.randint(0, cfg.num_classes, (args.batch,), generator=g))
        for _ in range(BATCHES)
    ]
    modes = dict.fromkeys(args.overlap)
    total = args.rounds * (warmup + steps)
    ours = [Ours(cfg, comm, batches, args.batch, mode, args.bucket_mb, total) for mode in modes]
    ddp = DDP(cfg, batches)
    methods = [*ours, ddp]
    times: dict = {m.name: [] for m in methods}
    exposed: dict = {m.name: [] for m in ours}
    differences: dict = {}
    for r in range(args.rounds):
        shift = r % len(methods)
        for method in methods[shift:] + methods[:shift]:
            for _ in range(warmup):
                method.step()
            world.Barrier()
            c0, t0 = comm.stats.seconds, time.perf_counter()
            for _ in range(steps):
                method.step()
            elapsed = time.perf_counter() - t0
            times[method.name].append(world.allreduce(elapsed / steps, op=MPI.MAX))
            if method in ours:
                exposed[method.name].append(world.allreduce((comm.stats.seconds - c0) / steps, op=MPI.MAX))
        if r == 0:
            for method in ours:
                diff = world.allreduce(max_difference(method.model, ddp.model), op=MPI.MAX)
                differences[method.name] = diff
                if diff > TOLERANCE:
                    raise SystemExit(
                        f"{name}: {method.name}'s parameters differ from DDP's by {diff:.2e} after one round "
                        f"(tolerance {TOLERANCE:g}): the two do not compute the same steps"
                        if comm.rank == 0
                        else 1
                    )
    params = sum(p.numel() for p in ddp.model.parameters())
    global_batch = comm.size * args.batch
    t_ddp = statistics.median(times["ddp"])
    rows = []
    for method in ours:
        t = times[method.name]
        rows.append(
            {
                "model": name,
                "params": params,
                "input": "×".join(map(str, cfg.input_shape)),
                "method": method.name,
                "settings": method.settings,
                "steps": f"{args.rounds}×({warmup}+{steps})",
                "ours_ms": statistics.median(t) * 1e3,
                "ddp_ms": t_ddp * 1e3,
                "ours_sps": global_batch / statistics.median(t),
                "ddp_sps": global_batch / t_ddp,
                "ratio": statistics.median(d / o for o, d in zip(t, times["ddp"], strict=True)),
                "ratios": [d / o for o, d in zip(t, times["ddp"], strict=True)],
                "comm_ms": statistics.median(exposed[method.name]) * 1e3,
                "diff": differences[method.name],
            }
        )
    return rows


def report(rows: list[dict], args: argparse.Namespace, n: int) -> None:
    print(
        f"\n{n} ranks, batch {args.batch} per rank ({n * args.batch} global), 1 torch thread per rank, "
        f"rounds × (warm-up + timed steps) per method; medians over the rounds; ratio = median of the "
        "per-round ours ÷ DDP samples/s"
    )
    head = (
        "| model | params | input | ours | steps | ours ms/step | DDP ms/step | ours samples/s | "
        "DDP samples/s | ratio | ours exposed comm ms/step | max abs Δparam |"
    )
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for w in rows:
        print(
            f"| {w['model']} | {w['params']:,} | {w['input']} | {w['method']} ({w['settings']}) | "
            f"{w['steps']} | {w['ours_ms']:.1f} | {w['ddp_ms']:.1f} | {w['ours_sps']:.0f} | "
            f"{w['ddp_sps']:.0f} | {w['ratio']:.3f} | {w['comm_ms']:.1f} | {w['diff']:.1e} |"
        )
    print("\nper-round ratios:")
    for w in rows:
        print(f"  {w['model']:<9} {w['method']:<16} " + " ".join(f"{x:.3f}" for x in w["ratios"]))


def bench(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from runner.comm import Comm

    torch.set_num_threads(1)
    world = MPI.COMM_WORLD
    rank, n = world.Get_rank(), world.Get_size()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{os.environ['BENCH_PORT']}", rank=rank, world_size=n
    )
    comm = Comm()
    rows = []
    for name in args.models:
        rows += bench_model(name, args, comm, world)
        if rank == 0:
            print(f"{name} done", flush=True)
    if rank == 0:
        report(rows, args, n)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    arguments = parse()
    if in_mpirun():
        bench(arguments)
        leave()
    else:
        sys.exit(relaunch(__file__, arguments.ranks))
