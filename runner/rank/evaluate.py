"""``python -m runner eval=RUN_DIR``: evaluate a finished run's saved model.

``python -m runner.rank.evaluate RUN_DIR`` (what ``eval=RUN_DIR`` starts) is one process, without MPI: it
builds the run's model, task and data from the run folder's ``config.yaml``, loads ``model.pt`` (the model the
run reported), evaluates it on the whole validation set with the run's precision, prints the metrics and
writes them to ``RUN_DIR/eval.json``. Nothing is built before the config is checked
(:mod:`runner.schema.trust`: a run folder's file is data, never code), and ``model.pt`` is checked against
the size and CRC-32 written with it (``model.pt.crc``, :mod:`runner.rank.saved_model`) before it is loaded.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from runner.rank.saved_model import load_model
from runner.rank.validation import validation_sums
from runner.run_folder import CONFIG, EVAL, MODEL, write_atomic


def evaluate_run(run_dir: Path) -> dict[str, Any]:
    """Evaluate ``run_dir``'s saved model on its validation data; returns (and writes) ``eval.json``."""
    from runner.schema.config import load, monitored

    cfg = load(run_dir / CONFIG)
    device = torch.device("cuda" if cfg.hardware.device != "cpu" and torch.cuda.is_available() else "cpu")
    model = cfg.model.build().to(device)
    state = load_model(run_dir / MODEL, "train the run again to evaluate it", map_location=device)
    model.load_state_dict(state)
    data = cfg.data.build()
    task = cfg.task.build(data.num_classes)
    loader = data.val_loader(0, 1, cfg.train.val_batch_size, pin_memory=device.type == "cuda")
    start = time.perf_counter()
    results = task.results(validation_sums(model, loader, task, device, cfg.train.precision))
    record = {
        "run": str(run_dir),
        "model": str(run_dir / MODEL),
        "monitor": monitored(cfg),
        **{f"val_{k}": v for k, v in results.items()},
        "samples": len(loader.dataset),
        "device": str(device),
        "seconds": time.perf_counter() - start,
    }
    write_atomic(run_dir / EVAL, json.dumps(record, indent=1) + "\n")  # (never through a link)
    return record


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m runner.rank.evaluate RUN_DIR")
    try:
        record = evaluate_run(Path(argv[0]))
    except ValueError as err:  # the run's data or model cannot be built or loaded: one line, status 2
        print(f"cannot evaluate {argv[0]}: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    metrics = ", ".join(f"{k} {v:.4f}" for k, v in record.items() if k.startswith("val_"))
    print(f"{record['model']}: {metrics} ({record['samples']} validation samples on {record['device']})")


if __name__ == "__main__":
    main()
