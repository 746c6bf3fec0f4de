"""Training-step time and memory by ``train.precision``: fp32 against bf16 and fp16 autocast, one process.

    python benchmarks/precision.py                                  # the device torch sees first
    python benchmarks/precision.py --device cpu --models cnn --batch 32
    python benchmarks/precision.py --models resnet18 resnet50 --size 64 --batch 128
    python benchmarks/precision.py --smoke                          # a few seconds, also without a GPU

Each step is what ``runner.rank.loop.Trainer`` does per micro-batch with one rank: forward and loss under
``runner.rank.validation.autocast``, backward (fp16: through ``torch.amp.GradScaler``, unscaled before the
optimizer step as the loop does), SGD step. Inputs are fixed random batches on the device (no data loading).
Per model, ``--rounds`` rounds run every precision for ``--warmup`` then ``--steps`` timed steps, in an order
rotated every round; the table gives medians of ms per step, the ratio to fp32 of the same round (median
over rounds; < 1 is faster), and on CUDA the peak memory of the timed steps. fp16 needs CUDA: on a CPU it
is left out. ``--smoke`` checks that it all runs, in seconds, on whatever device (a CPU will do): the CNN on
16×16 images, batch 4, one round of 1 warm-up and 1 timed step.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runner.models.cnn import CNNConfig  # noqa: E402
from runner.models.resnet import ResNetConfig  # noqa: E402
from runner.rank.validation import autocast  # noqa: E402
from runner.schema.sections import PRECISIONS  # noqa: E402

MODELS = {
    "cnn": lambda shape, classes: CNNConfig(shape, classes),
    "resnet18": lambda shape, classes: ResNetConfig(shape, classes, depth=18),
    "resnet50": lambda shape, classes: ResNetConfig(shape, classes, depth=50),
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(model, batch, device, precision, warmup: int, steps: int) -> tuple[float, float]:
    """ms per step and peak MiB (0 off CUDA) of ``steps`` steps after ``warmup``."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    x, y = batch

    def step() -> None:
        optimizer.zero_grad(set_to_none=False)
        with autocast(device, precision):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()

    for _ in range(warmup):
        step()
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    ms = 1e3 * (time.perf_counter() - start) / steps
    peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else 0.0
    return ms, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--precisions", nargs="+", default=list(PRECISIONS), choices=list(PRECISIONS))
    parser.add_argument("--size", type=int, default=32, help="image height and width")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="check that it runs, in seconds: cnn, 16x16, batch 4, 1 round of 1 warm-up and 1 timed step",
    )
    args = parser.parse_args()
    if args.smoke:
        args.models, args.size, args.batch, args.rounds, args.warmup, args.steps = ["cnn"], 16, 4, 1, 1, 1
    device = torch.device(args.device)
    precisions = [p for p in args.precisions if not (p == "fp16" and device.type != "cuda")]
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"CPU, {torch.get_num_threads()} threads"
    )
    shape = f"3x{args.size}x{args.size}"
    print(f"{name}, torch {torch.__version__}, batch {args.batch} of {shape}, {args.rounds} rounds\n")
    print("| model | precision | ms/step | ratio to fp32 | peak MiB |\n| --- | --- | --- | --- | --- |")
    for model_name in args.models:
        torch.manual_seed(0)
        cfg = MODELS[model_name]([3, args.size, args.size], 10)
        start = cfg.build().to(device).state_dict()
        batch = (
            torch.randn(args.batch, 3, args.size, args.size, device=device),
            torch.randint(0, 10, (args.batch,), device=device),
        )
        times: dict[str, list[float]] = {p: [] for p in precisions}
        peaks: dict[str, float] = {}
        for r in range(args.rounds):
            order = precisions[r % len(precisions) :] + precisions[: r % len(precisions)]
            for precision in order:
                model = cfg.build().to(device)
                model.load_state_dict(start)
                ms, peaks[precision] = timed(model, batch, device, precision, args.warmup, args.steps)
                times[precision].append(ms)
        for precision in precisions:
            base = times.get("fp32", [float("nan")] * len(times[precision]))  # (--precisions without fp32)
            ratio = statistics.median(t / f for t, f in zip(times[precision], base, strict=True))
            print(
                f"| {model_name} | {precision} | {statistics.median(times[precision]):.2f} | {ratio:.2f} | "
                f"{peaks[precision]:.0f} |"
            )


if __name__ == "__main__":
    main()
