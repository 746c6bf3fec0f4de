"""What the reliability features cost a step, against the step itself, measured in one process.

    python benchmarks/reliability.py                      # cnn, resnet18, resnet50 at batch 32, 64x64
    python benchmarks/reliability.py --models resnet50 --size 224 --batch 64
    python benchmarks/reliability.py --smoke              # a few seconds: cnn, 16x16, batch 4, once each

For each model: the median time of a plain training step (forward, backward, SGD with momentum), then of
what the runner adds to every step, as a fraction of it: the divergence guard (the gradients' total norm
and two finiteness checks) and the loss poisoning (``runner.rank.guard.poisoned``); then the time to write one
rank's checkpoint part (model, optimizer, random states; ``torch.save`` to a temporary file, fsync and
rename), with its size and rate, which a run pays every ``checkpoint.every`` steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runner.rank.checkpoint import rng_state, save_atomic  # noqa: E402
from runner.rank.guard import poisoned  # noqa: E402
from tests.conftest import checked_config  # noqa: E402


def median_time(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(name: str, size: int, batch: int, repeat: int, saves: int = 3) -> dict[str, float]:
    cfg = checked_config([f"model={name}", "data=synthetic", f"data.shape=[3,{size},{size}]"])
    model = cfg.model.build()
    optimizer = cfg.optim.build(model.parameters())
    x, y = torch.randn(batch, 3, size, size), torch.randint(0, cfg.data.num_classes, (batch,))
    params = [p for p in model.parameters() if p.requires_grad]
    buffers = [b for b in model.buffers() if b.is_floating_point()]

    def step(guard: bool) -> None:
        optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        (poisoned(loss, buffers) if guard else loss).backward()
        if guard:
            norm = torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)
            assert bool(torch.isfinite(norm)) and bool(torch.isfinite(loss))
        optimizer.step()

    step(False)
    plain = median_time(lambda: step(False), repeat)
    guarded = median_time(lambda: step(True), repeat)
    guard_only = median_time(
        lambda: bool(torch.isfinite(torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True))),
        repeat,
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rank0.pt"
        part = lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "rng": rng_state()}  # noqa: E731
        save = median_time(lambda: save_atomic(part(), path), saves)
        mb = path.stat().st_size / 2**20
    return {"step": plain, "guarded": guarded, "guard": guard_only, "save": save, "mb": mb}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["cnn", "resnet18", "resnet50"])
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument(
        "--smoke",
        action="store_true",
        help="check that it runs, in seconds: cnn, 16x16 images, batch 4, every measurement once",
    )
    args = p.parse_args()
    if args.smoke:
        args.models, args.size, args.batch, args.repeat = ["cnn"], 16, 4, 1
    torch.manual_seed(0)
    print(f"{args.size}x{args.size} images, batch {args.batch}, {torch.get_num_threads()} threads; medians")
    print("| model | step s | guarded / step | guard alone / step | checkpoint part MB | save s | MB/s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        r = measure(name, args.size, args.batch, args.repeat, saves=1 if args.smoke else 3)
        print(
            f"| {name} | {r['step']:.4f} | {r['guarded'] / r['step']:.3f} | {r['guard'] / r['step']:.4f} "
            f"| {r['mb']:.1f} | {r['save']:.3f} | {r['mb'] / r['save']:.0f} |"
        )


if __name__ == "__main__":
    main()
