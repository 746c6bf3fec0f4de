"""The language model's training step: ``python -m runner recipe=shakespeare_char devices=1`` against a plain
torch loop of the same GPT, batch, optimizer, schedule and clipping, in the same run.

    python benchmarks/lm_step.py                        # 3 rounds of 300 timed steps each
    python benchmarks/lm_step.py --rounds 5 --steps 500
    python benchmarks/lm_step.py --smoke                # seconds: a tiny GPT, 1 round of a few steps

``plain`` is nanoGPT's loop (``train.py`` without compile, DDP or evaluation): a batch of 12 random windows
of 65 characters (``torch.randint`` offsets, stacked), forward, cross-entropy, backward, gradient clipping
at 1, AdamW step (decay on matrices only, the same param groups as ``optim.decay=matrices``), learning rate
set per step, ``zero_grad(set_to_none=True)``, ``loss.item()`` every ``log_every`` steps. It runs in this
process on one core with one torch thread, as the runner's rank does (bound to one core,
``hardware.threads_per_rank`` 1). ``runner`` is the real job, one rank under mpirun; its step time is the
median of the ``step_ms`` records of ``metrics.jsonl`` after the first ``--warmup`` steps (data wait,
compute and the rule's communication; validation and start-up excluded). A round runs both, in an order
rotated every round; the table gives the medians over the rounds and the ratio runner ÷ plain.

The corpus: ``--root`` (default ``../shared/data/tinyshakespeare``, else the data set's cache, downloaded
once).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "tinyshakespeare"
RECIPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block": 64, "batch": 12}
SMOKE = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block": 16, "batch": 4}


def corpus(root: Path) -> list[int]:
    """The training split's character ids (nanoGPT's: the first 90%; ids of the sorted characters)."""
    text = (root / "input.txt").read_text(encoding="utf-8")
    train = text[: int(len(text) * 0.9)]
    index = {c: i for i, c in enumerate(sorted(set(train)))}
    return [index[c] for c in train]


def plain(ids: list[int], sizes: dict[str, int], steps: int, warmup: int) -> float:
    """Median ms per step of nanoGPT's loop over ``steps`` steps after ``warmup`` (one thread, one core)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from runner.models.gpt import GPTConfig
    from runner.optim import decay_groups

    cores = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cores)})  # (given back at the end: the runner's job needs them all)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    block, batch = sizes["block"], sizes["batch"]
    cfg = GPTConfig(
        input_shape=[block],
        vocab_size=65,
        n_layer=sizes["n_layer"],
        n_head=sizes["n_head"],
        n_embd=sizes["n_embd"],
    )
    model = cfg.build()
    opt = torch.optim.AdamW(decay_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.99))
    data = torch.tensor(ids, dtype=torch.long)
    total, times = steps + warmup, []
    for it in range(total):
        start = time.perf_counter()
        lr = 1e-3 * (it / 100 if it < 100 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (it - 100) / 1900)))
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(len(data) - block - 1, (batch,))
        x = torch.stack([data[i : i + block] for i in offsets])
        y = torch.stack([data[i + 1 : i + 1 + block] for i in offsets])
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if it % 10 == 0:
            loss.item()
        if it >= warmup:
            times.append(time.perf_counter() - start)
    os.sched_setaffinity(0, cores)
    return 1e3 * statistics.median(times)


def runner(root: Path, sizes: dict[str, int], steps: int, warmup: int, scratch: Path) -> float:
    """Median ``step_ms`` of the runner's job (the records after ``warmup`` steps)."""
    log_every = 10
    argv = [
        sys.executable,
        "-m",
        "runner",
        "recipe=shakespeare_char",
        "devices=1",
        f"data.root={root}",
        f"data.block_size={sizes['block']}",
        f"train.batch_size={sizes['batch']}",
        f"model.n_layer={sizes['n_layer']}",
        f"model.n_head={sizes['n_head']}",
        f"model.n_embd={sizes['n_embd']}",
        f"train.max_steps={steps + warmup}",
        f"train.log_every={log_every}",
        "train.val_every=1000",  # one validation, at the end: not within the timed steps
        "train.val_samples=64",
        "train.progress=false",
        "hardware.threads_per_rank=1",
        "logger=[]",
        f"hydra.run.dir={scratch / 'run'}",
    ]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(
            f"the runner's job failed ({done.returncode}):\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    lines = (scratch / "run" / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    ms = [r["step_ms"] for r in records if r.get("kind") == "step" and r["step"] > warmup]
    if not ms:
        raise SystemExit(f"no step records after step {warmup} in {scratch / 'run' / 'metrics.jsonl'}")
    return statistics.median(ms)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=300, help="timed steps per method and round")
    p.add_argument("--warmup", type=int, default=20, help="untimed steps first")
    p.add_argument("--root", type=Path, default=SHARED if (SHARED / "input.txt").is_file() else None)
    p.add_argument("--smoke", action="store_true", help="check that it runs: a tiny GPT, 1 round of 20 steps")
    args = p.parse_args()
    sizes = RECIPE
    if args.smoke:
        args.rounds, args.steps, args.warmup, sizes = 1, 20, 10, SMOKE
    if args.root is None:
        sys.path.insert(0, str(ROOT))
        from runner.data.shakespeare_char import ShakespeareCharConfig

        args.root = Path(ShakespeareCharConfig().root_folder())
    ids = corpus(args.root)
    results: dict[str, list[float]] = {"plain": [], "runner": []}
    with tempfile.TemporaryDirectory() as scratch:
        for r in range(args.rounds):
            order = ["plain", "runner"] if r % 2 == 0 else ["runner", "plain"]
            for name in order:
                if name == "plain":
                    ms = plain(ids, sizes, args.steps, args.warmup)
                else:
                    ms = runner(args.root, sizes, args.steps, args.warmup, Path(scratch) / str(r))
                results[name].append(ms)
                print(f"round {r + 1} {name}: {ms:.2f} ms/step", file=sys.stderr)
    base = statistics.median(results["plain"])
    tokens = sizes["batch"] * sizes["block"]
    shape = f"{sizes['n_layer']}×{sizes['n_head']}×{sizes['n_embd']}, batch {sizes['batch']}×{sizes['block']}"
    print(f"GPT {shape}; {args.rounds} rounds of {args.steps} steps, medians")
    print("| loop | ms/step | tokens/s | ÷ plain |\n| --- | --- | --- | --- |")
    for name, times in results.items():
        ms = statistics.median(times)
        print(f"| {name} | {ms:.2f} | {tokens / ms * 1e3:,.0f} | {ms / base:.2f} |")


if __name__ == "__main__":
    main()
