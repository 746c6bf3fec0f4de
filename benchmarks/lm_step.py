"""The language model's training step: ``python -m runner recipe=shakespeare_char devices=1`` against a plain
torch loop of the same GPT, batch, optimizer, schedule and clipping, in the same run.

    python benchmarks/lm_step.py                        # 3 rounds of 300 timed steps each
    python benchmarks/lm_step.py --rounds 5 --steps 500
    python benchmarks/lm_step.py --smoke                # seconds: a tiny GPT, 1 round of a few steps
    python benchmarks/lm_step.py --preset gpt2 --device cuda --precision bf16   # GPT-2 small on a GPU (MFU)

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
once); ``--corpus synthetic`` (the default of ``--preset gpt2`` and of ``--smoke``) writes random token ids
as a ``data=tokens`` folder instead (no network needed). On a GPU (``--device cuda``) both run on it, the
runner with ``hardware=gpu``, under autocast with ``--precision bf16``; the table then adds the model FLOPs
utilisation: ``flops_per_token`` (6N + 12·L·d·T) × tokens/s over the GPU's dense bf16 peak (``--peak-tflops``,
989 for an H100 or H200).
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
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "tinyshakespeare"
RECIPE = {"n_layer": 4, "n_head": 4, "n_embd": 128, "block": 64, "batch": 12, "vocab": 65, "bias": False}
GPT2 = {"n_layer": 12, "n_head": 12, "n_embd": 768, "block": 1024, "batch": 8, "vocab": 50304, "bias": True}
SMOKE = {"n_layer": 1, "n_head": 2, "n_embd": 32, "block": 16, "batch": 4, "vocab": 65, "bias": False}
SYNTHETIC_TOKENS = 2_000_000


def synthetic(folder: Path, vocab: int) -> Path:
    """A ``data=tokens`` folder of random ids (uint16): train.bin, val.bin and meta.json."""
    import numpy as np

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for split, n in (("train", SYNTHETIC_TOKENS), ("val", SYNTHETIC_TOKENS // 10)):
        rng.integers(0, vocab, n, dtype=np.uint16).tofile(folder / f"{split}.bin")
    (folder / "meta.json").write_text(json.dumps({"vocab_size": vocab}))
    return folder


def corpus(root: Path) -> list[int]:
    """The training split's character ids (nanoGPT's: the first 90%; ids of the sorted characters)."""
    text = (root / "input.txt").read_text(encoding="utf-8")
    train = text[: int(len(text) * 0.9)]
    index = {c: i for i, c in enumerate(sorted(set(train)))}
    return [index[c] for c in train]


def plain(data: Any, sizes: dict[str, int], steps: int, warmup: int, device: str, bf16: bool) -> float:
    """Median ms per step of nanoGPT's loop over ``steps`` steps after ``warmup`` (on the CPU: one thread,
    one core)."""
    import torch

    sys.path.insert(0, str(ROOT))
    from runner.models.gpt import GPTConfig
    from runner.optim import decay_groups

    cores = os.sched_getaffinity(0)
    if device == "cpu":  # as the runner's rank: one core (given back at the end: the runner's job needs them)
        os.sched_setaffinity(0, {min(cores)})
        torch.set_num_threads(1)
    torch.manual_seed(0)
    block, batch = sizes["block"], sizes["batch"]
    cfg = GPTConfig(
        input_shape=[block],
        vocab_size=sizes["vocab"],
        n_layer=sizes["n_layer"],
        n_head=sizes["n_head"],
        n_embd=sizes["n_embd"],
        bias=sizes["bias"],
    )
    model = cfg.build().to(device)
    opt = torch.optim.AdamW(decay_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.99))
    data = torch.as_tensor(data, dtype=torch.long)
    cuda = device == "cuda"
    total, times = steps + warmup, []
    for it in range(total):
        start = time.perf_counter()
        lr = 1e-3 * (it / 100 if it < 100 else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (it - 100) / 1900)))
        for group in opt.param_groups:
            group["lr"] = lr
        offsets = torch.randint(len(data) - block - 1, (batch,))
        x = torch.stack([data[i : i + block] for i in offsets]).to(device, non_blocking=True)
        y = torch.stack([data[i + 1 : i + 1 + block] for i in offsets]).to(device, non_blocking=True)
        with torch.autocast(device, dtype=torch.bfloat16, enabled=bf16):
            logits = model(x)
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if it % 10 == 0:
            loss.item()
        if cuda:
            torch.cuda.synchronize()
        if it >= warmup:
            times.append(time.perf_counter() - start)
    os.sched_setaffinity(0, cores)
    return 1e3 * statistics.median(times)


def runner(data: list[str], sizes: dict[str, int], steps: int, warmup: int, scratch: Path) -> float:
    """Median ``step_ms`` of the runner's job (the records after ``warmup`` steps); ``data``: the data set's
    and the device's overrides."""
    log_every = 10
    argv = [
        sys.executable,
        "-m",
        "runner",
        "recipe=shakespeare_char",
        "devices=1",
        *data,
        f"data.block_size={sizes['block']}",
        f"train.batch_size={sizes['batch']}",
        f"model.n_layer={sizes['n_layer']}",
        f"model.n_head={sizes['n_head']}",
        f"model.n_embd={sizes['n_embd']}",
        f"model.bias={str(sizes['bias']).lower()}",
        f"train.max_steps={steps + warmup}",
        f"schedule.warmup_steps={min(100, steps + warmup)}",  # the recipe's 100, within a short run
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
    p.add_argument("--preset", choices=("recipe", "gpt2"), default="recipe")
    p.add_argument("--corpus", choices=("shakespeare", "synthetic"), default=None)
    p.add_argument("--root", type=Path, default=SHARED if (SHARED / "input.txt").is_file() else None)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak, for MFU")
    p.add_argument("--smoke", action="store_true", help="check that it runs: a tiny GPT, 1 round of 20 steps")
    args = p.parse_args()
    sizes = GPT2 if args.preset == "gpt2" else RECIPE
    if args.smoke:
        args.rounds, args.steps, args.warmup, sizes = 1, 20, 10, SMOKE
    corpus_kind = args.corpus or ("synthetic" if args.smoke or args.preset == "gpt2" else "shakespeare")
    results: dict[str, list[float]] = {"plain": [], "runner": []}
    with tempfile.TemporaryDirectory() as scratch:
        data, ids = prepare(args, corpus_kind, sizes, Path(scratch))
        for r in range(args.rounds):
            order = ["plain", "runner"] if r % 2 == 0 else ["runner", "plain"]
            for name in order:
                if name == "plain":
                    ms = plain(ids, sizes, args.steps, args.warmup, args.device, args.precision == "bf16")
                else:
                    ms = runner(data, sizes, args.steps, args.warmup, Path(scratch) / str(r))
                results[name].append(ms)
                print(f"round {r + 1} {name}: {ms:.2f} ms/step", file=sys.stderr)
    table(args, sizes, results)


def prepare(
    args: argparse.Namespace, kind: str, sizes: dict[str, int], scratch: Path
) -> tuple[list[str], Any]:
    """The runner's overrides for the corpus and the device, and the training ids the plain loop reads."""
    if kind == "synthetic":
        import numpy as np

        folder = synthetic(scratch / "tokens", sizes["vocab"])
        data = ["data=tokens", f"data.root={folder}"]
        ids = np.fromfile(folder / "train.bin", dtype=np.uint16).astype(np.int64)
    else:
        if args.root is None:
            sys.path.insert(0, str(ROOT))
            from runner.data.shakespeare_char import ShakespeareCharConfig, cache_folder

            ShakespeareCharConfig()  # fetches the corpus into the cache folder where it is not there yet
            args.root = cache_folder()
        data, ids = [f"data.root={args.root}"], corpus(args.root)
    if args.device == "cuda":
        data += ["hardware=gpu", f"train.precision={args.precision}"]
    elif args.precision == "bf16":
        data += ["train.precision=bf16"]
    return data, ids


def table(args: argparse.Namespace, sizes: dict[str, int], results: dict[str, list[float]]) -> None:
    """The medians, tokens/s, the ratio to the plain loop and (on a GPU) the model FLOPs utilisation."""
    sys.path.insert(0, str(ROOT))
    from runner.models.gpt import GPTConfig

    cfg = GPTConfig(
        input_shape=[sizes["block"]],
        vocab_size=sizes["vocab"],
        n_layer=sizes["n_layer"],
        n_head=sizes["n_head"],
        n_embd=sizes["n_embd"],
        bias=sizes["bias"],
    )
    with torch_meta():
        flops = cfg.build().flops_per_token()
    base = statistics.median(results["plain"])
    tokens = sizes["batch"] * sizes["block"]
    shape = f"{sizes['n_layer']}×{sizes['n_head']}×{sizes['n_embd']}, batch {sizes['batch']}×{sizes['block']}"
    print(f"GPT {shape} on {args.device} ({args.precision}); {args.rounds} rounds of {args.steps} steps")
    mfu = args.device == "cuda"
    print("| loop | ms/step | tokens/s | ÷ plain |" + " MFU |" * mfu)
    print("| --- | --- | --- | --- |" + " --- |" * mfu)
    for name, times in results.items():
        ms = statistics.median(times)
        rate = tokens / ms * 1e3
        util = f" {100 * rate * flops / (args.peak_tflops * 1e12):.1f}% |" * mfu
        print(f"| {name} | {ms:.2f} | {rate:,.0f} | {ms / base:.2f} |" + util)


def torch_meta() -> Any:
    """Build on the meta device (no memory, no initialisation) to count."""
    import torch

    return torch.device("meta")


if __name__ == "__main__":
    main()
