"""Seconds per 5,120 images with BSP, split into compute and communication, in the form of Theano-MPI's table.

    python benchmarks/images_per_5120.py            # 64×64 images, 3 timed steps: fits a 2-core machine
    python benchmarks/images_per_5120.py --full     # 224×224 images, 10 timed steps
    python benchmarks/images_per_5120.py --models resnet50 --ranks 1 2 4 8 --size 128
    python benchmarks/images_per_5120.py --smoke    # a few seconds: googlenet, 1 rank, 32×32, batch 2, 1 step

For each model at its published per-rank batch (alexnet 128, googlenet 32, vgg16 32, resnet50 64) on
synthetic data with 1000 classes, every rank count runs as a real job (``python -m runner rule=bsp``, a
record per half of the timed steps, after a first record of as many untimed ones; a record every step would
make the host wait for the device each step). Rank 0's timed steps give seconds per 5,120 images as
compute + communication (exposed, i.e. not hidden behind backward) + data wait. ``plain`` is the same model
trained in one process with plain PyTorch and no runner, at the 1-rank batch on one batch already on the
device (timed over all its steps, with one wait for the device at the end): ``1 rank / plain`` is the
runner's overhead. Speed-up is against 1 rank; efficiency is speed-up / ranks. On a machine with fewer cores
than ranks the jobs are oversubscribed and the speed-up says so. ``--smoke`` checks that it all runs, in
seconds, on the CPU: one job (googlenet on 1 rank, 32×32 images, batch 2, 1 timed step) and its ``plain``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH = {"alexnet": 128, "googlenet": 32, "vgg16": 32, "resnet50": 64}
IMAGES = 5120
#: --smoke: the arguments it stands for (one job; googlenet: the fewest parameters to build and checkpoint).
SMOKE = {"models": ["googlenet"], "ranks": [1], "size": 32, "steps": 1, "batch": 2}


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=list(BATCH), choices=list(BATCH))
    p.add_argument("--ranks", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--size", type=int, default=None, help="image side (default 64; --full: 224)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per job (default 3; --full: 10)")
    p.add_argument("--full", action="store_true", help="ImageNet-sized images and more steps")
    p.add_argument("--batch", type=int, default=None, help="per-rank batch (default: the model's published)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="check that it runs, in seconds: googlenet, 1 rank, 32x32, batch 2, 1 timed step",
    )
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every job (after --)")
    args = p.parse_args()
    if args.smoke:
        for key, value in SMOKE.items():
            setattr(args, key, value)
    args.size = args.size or (224 if args.full else 64)
    args.steps = args.steps or (10 if args.full else 3)
    return args


def batch_of(model: str, args: argparse.Namespace) -> int:
    return args.batch or BATCH[model]


def job(model: str, ranks: int, args: argparse.Namespace, tmp: Path) -> dict[str, float]:
    """Seconds per 5,120 images of one BSP job, split into compute, comm and data."""
    run_dir = tmp / f"{model}-{ranks}"
    batch = batch_of(model, args)
    # One record per ``per`` steps (its step_ms their mean): the first is the warm-up; a record every step
    # would wait for the device every step, exposing the host's work between steps that a job hides.
    per = max(1, args.steps // 2)
    total = per * (1 + args.steps // per)
    samples = batch * ranks * total
    argv = [
        sys.executable,
        "-m",
        "runner",
        f"model={model}",
        "data=synthetic",
        f"data.shape=[3,{args.size},{args.size}]",
        "data.num_classes=1000",
        f"data.train_size={samples}",
        f"data.val_size={ranks}",
        f"devices={ranks}",
        "hardware.oversubscribe=true",
        f"train.batch_size={batch}",
        f"train.max_steps={total}",
        f"train.log_every={per}",
        "train.save_model=none",
        "train.progress=false",
        f"hydra.run.dir={run_dir}",
        *args.overrides,
    ]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{model} on {ranks} ranks failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"][1:]
    per_step = sum(r["step_ms"] for r in steps) / len(steps) / 1e3
    scale = IMAGES / (batch * ranks)
    return {
        name: scale * sum(r["step_ms"] * r[f"{name}_frac"] for r in steps) / len(steps) / 1e3
        for name in ("compute", "comm", "data")
    } | {"total": scale * per_step}


def plain(model: str, args: argparse.Namespace) -> float:
    """Seconds per 5,120 images of plain single-process PyTorch (no MPI, no runner), on the device the
    jobs use (``hardware=gpu``: the first GPU)."""
    import torch
    from hydra import compose, initialize_config_dir

    from runner.launcher.register import register
    from runner.schema.config import validate

    register()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = validate(
            compose(
                config_name="config",
                overrides=[
                    f"model={model}",
                    "data=synthetic",
                    f"data.shape=[3,{args.size},{args.size}]",
                    "data.num_classes=1000",
                    *args.overrides,
                ],
            )
        )
    device = torch.device(cfg.hardware.device)
    net = cfg.model.build().to(device)
    opt = cfg.optim.build(net.parameters())
    batch = batch_of(model, args)
    x = torch.randn(batch, 3, args.size, args.size, device=device)
    y = torch.randint(0, 1000, (batch,), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    for step in range(args.steps + 1):
        if step == 1:  # after the warm-up step; one wait for the device at the end, as the job's
            sync()
            t0 = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    sync()
    return IMAGES / batch * (time.perf_counter() - t0) / args.steps


def main() -> None:
    args = parse()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            results = {n: job(model, n, args, Path(tmp)) for n in args.ranks}
            rows.append((model, plain(model, args), results))
            print(f"done: {model}", file=sys.stderr)
    print(
        f"\nseconds per {IMAGES} images, BSP, {args.size}×{args.size} synthetic images, 1000 classes, "
        f"{args.steps} timed steps; each cell: total = compute + comm (+ data wait)"
    )
    header = f"{'model':<14} {'plain':>7} " + " ".join(
        f"{f'{n} rank' + ('s' if n > 1 else ''):>26}" for n in args.ranks
    )
    print(header + f" {'1 rank/plain':>12}")
    for model, base, results in rows:
        cells = []
        for n in args.ranks:
            r = results[n]
            cells.append(f"{r['total']:7.2f} = {r['compute']:6.2f} + {r['comm']:5.2f} ({r['data']:.2f})")
        overhead = results[args.ranks[0]]["total"] / base if args.ranks[0] == 1 else float("nan")
        print(
            f"{model + '-' + str(batch_of(model, args)) + 'b':<14} {base:7.2f} "
            + " ".join(f"{c:>26}" for c in cells)
            + f" {overhead:12.2f}"
        )
    if 1 in args.ranks and len(args.ranks) > 1:
        print("\nspeed-up against 1 rank (efficiency = speed-up / ranks)")
        for model, _, results in rows:
            one = results[1]["total"]
            parts = [
                f"{n} ranks {one / results[n]['total']:5.2f}× ({one / results[n]['total'] / n:4.0%})"
                for n in args.ranks
                if n > 1
            ]
            print(f"{model:<10} " + "   ".join(parts))


if __name__ == "__main__":
    main()
