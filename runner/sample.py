"""Sample text from a finished language-model run's saved model (:mod:`runner.rank.sample` does the work).

    python -m runner.sample outputs/2026-11-23/10-00-00                      # 500 characters after a newline
    python -m runner.sample RUN_DIR --start "ROMEO:" --tokens 200 --seed 1
    python -m runner.sample RUN_DIR --start-ids 50256 --top-k 0             # a data set without a decoder

Prints the text, the prompt included; where the data set has no decoder (data=tokens), the token ids
separated by spaces. The run folder is data: its config.yaml is checked before anything is built and
model.pt is read with torch.load(weights_only=True) after its CRC-32 check.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

RAW = argparse.RawDescriptionHelpFormatter


def count(text: str) -> int:
    """A whole number >= 0 (argparse type)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def positive(text: str) -> float:
    """A number > 0 (argparse type)."""
    value = float(text)
    if not value > 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"{text} must be > 0 (lower: more likely tokens; 1: the model's)")
    return value


def id_list(text: str) -> list[int]:
    """Token ids separated by commas: ``1,2,3`` (argparse type)."""
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not token ids separated by commas, e.g. 1,2,3"
        ) from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("python -m runner.sample", description=__doc__, formatter_class=RAW)
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="a finished run of task=language_model")
    p.add_argument("--tokens", type=count, default=500, help="tokens to draw after the prompt (default 500)")
    p.add_argument("--temperature", type=positive, default=0.8, help="> 0: divides the logits (default 0.8)")
    p.add_argument("--top-k", type=count, default=200, help="draw from the k likeliest (default 200; 0: all)")
    p.add_argument("--seed", type=count, default=0, help="the same seed gives the same text (default 0)")
    start = p.add_mutually_exclusive_group()
    start.add_argument(
        "--start", help="the prompt, as text (default: a newline for character data, else id 0)"
    )
    start.add_argument("--start-ids", type=id_list, metavar="IDS", help="the prompt as token ids: 1,2,3")
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="default: cuda where the run trained on a GPU and one is here, else cpu",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from runner.rank.sample import sample_run  # (after the arguments: --help needs no torch)

    try:
        drawn = sample_run(
            args.run_dir,
            args.tokens,
            args.temperature,
            args.top_k,
            args.seed,
            args.start,
            args.start_ids,
            args.device,
        )
    except (ValueError, OSError) as err:
        print(f"cannot sample from {args.run_dir}: {err}", file=sys.stderr)
        return 2
    if drawn.text is None:
        print(f"note: {drawn.data_name} has no decoder: printing token ids", file=sys.stderr)
        print(" ".join(map(str, drawn.ids)))
    else:
        print(drawn.text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
