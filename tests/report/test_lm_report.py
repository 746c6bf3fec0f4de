"""The sweep report of language-model runs (val_loss monitored, tokens counted): a loss target reached from
above, tokens to target and tokens/s, perplexity beside the loss, and the crossover over link speeds with a
loss target. From hand-made run folders, in process."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.launcher.callbacks import SweepReport
from runner.report.network import crossover, grid, sentences
from runner.report.runs import load_runs
from runner.report.table import csv_table, markdown, score, table
from tests.report.test_report import BATCH, make_run

LINK = "simulate.link_gbps"
#: A run's samples/s; its tokens/s is this × its block size.
SAMPLES_PER_S = 375.0


def lm_run(
    path: Path,
    overrides: list[str],
    losses: list[float],
    every: float = 1.0,
    devices: int = 2,
    batch: int = 12,
    accumulate: int = 1,
    block: int = 64,
) -> Path:
    """An LM run folder as the launcher leaves it: a validation (loss, ppl, acc) and an epoch record per
    10 steps and ``every`` seconds, its config.yaml (data.shape [block]) and a summary counting tokens."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    config = {
        "devices": devices,
        "train": {"batch_size": batch, "accumulate": accumulate, "monitor": "val_loss"},
        "data": {"block_size": block, "shape": [block]},
    }
    (path / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
    records, rates = [], {"samples_per_s": SAMPLES_PER_S, "tokens_per_s": SAMPLES_PER_S * block}
    per_step = devices * batch * accumulate * block
    for i, loss in enumerate(losses):
        step, time = 10 * (i + 1), every * (i + 1)
        val = {"val_loss": loss, "val_ppl": math.exp(loss), "val_acc": 0.3 + 0.01 * i}
        records.append({"kind": "val", "step": step, "time": time, **val})
        epoch = {"comm_frac": 0.2, "tokens": step * per_step, **rates}
        records.append({"kind": "epoch", "step": step, "time": time, **epoch})
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    steps = 10 * len(losses)
    summary = {"status": "ok", "devices": devices, "wall_time_s": 20.0, "steps": steps, "monitor": "val_loss"}
    summary |= {"bytes_sent": 8e6, "comm_fraction": 0.25, "tokens": steps * per_step, "val_count": 10_000}
    (path / "summary.json").write_text(json.dumps({**summary, **rates}))
    return path


def lm_sweep(root: Path) -> Path:
    """A multirun over optim.lr: 0.001 first reaches val_loss 1.9 at step 30 (3 s), 0.003 never does."""
    sweep = root / "sweep"
    sweep.mkdir(parents=True)
    (sweep / "multirun.yaml").write_text(
        json.dumps({"hydra": {"overrides": {"task": ["optim.lr=1e-3,3e-3"]}}})
    )
    lm_run(sweep / "0", ["optim.lr=1e-3"], [2.6, 2.0, 1.9, 1.7, 1.75], devices=4, accumulate=2)
    lm_run(sweep / "1", ["optim.lr=3e-3"], [2.5, 1.95, 1.91, 1.92])
    return sweep


def report_of(*dirs: Path, metric: str = "val_loss", target: float | None = None):
    runs, keys = load_runs(list(dirs))
    return score(runs, keys, dirs[0], metric, target)


def test_a_loss_target_given_to_the_callback_is_the_first_validation_at_or_below_it(tmp_path, monkeypatch):
    sweep = lm_sweep(tmp_path)
    monkeypatch.setattr("runner.report.plots.write_plots", lambda report: [])  # (the plots: test_report.py)
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    SweepReport(target=1.9).on_multirun_end(config)  # hydra.callbacks.report.target=1.9
    md = (sweep / "report.md").read_text()
    assert "**Best run: optim.lr=0.001**" in md and "ranked by best val_loss (lowest first;" in md
    assert "Target: val_loss ≤ 1.9. " in md
    rows = {r["run"]: r for r in csv.DictReader(open(sweep / "report.csv", newline=""))}
    assert (rows["optim.lr=0.001"]["step_at_target"], rows["optim.lr=0.001"]["time_to_target_s"]) == (
        "30",
        "3.0",
    )
    assert rows["optim.lr=0.003"]["step_at_target"] == ""  # 1.91 is above 1.9: not reached


def test_the_default_loss_target_is_the_best_run_s_best_divided_by_the_fraction_and_says_so(tmp_path):
    report = report_of(lm_sweep(tmp_path))
    assert report.target == pytest.approx(1.7 / 0.95) and report.target_default
    assert report.target_text() == "val_loss ≤ 1.789 (the best run's best, 1.7, ÷ 0.95)"
    assert [r.target_step for r in report.runs] == [40, None]


def test_tokens_to_target_are_the_target_step_times_the_global_batch_times_the_block(tmp_path):
    report = report_of(lm_sweep(tmp_path), target=1.9)
    first, second = report.runs
    assert first.target_tokens == 30 * 4 * 12 * 2 * 64  # step × devices × batch × accumulate × data.shape[-1]
    assert first.target_samples == 30 * 4 * 12 * 2 and second.target_tokens is None
    assert first.tokens_per_s == SAMPLES_PER_S * 64
    header, cells = table(report)
    assert header[6:] == [
        "time to target (s)",
        "steps to target",
        "tokens to target",
        "wall time (s)",
        "load (start→end)",
        "tokens/s",
        "comm (% of step)",
        "sent per worker per step (MB)",
    ]
    assert cells[0][6:12] == ["3.00", "30", "184,320", "20.0", "unknown", "24,000"]
    assert (
        "(tokens: × the global batch, devices × batch_size × accumulate × the tokens of a sample, "
        in markdown(report, [])
    )
    header, rows = csv_table(report)
    row = dict(zip(header, rows[0], strict=True))
    assert (row["tokens_at_target"], row["tokens_per_s"], row["tokens"]) == (
        184_320,
        24_000.0,
        50 * 4 * 12 * 2 * 64,
    )
    assert row["samples_at_target"] == 30 * 4 * 12 * 2  # the CSV keeps samples too


def test_a_sweep_mixing_runs_with_and_without_tokens_shows_both_counts(tmp_path):
    sweep = tmp_path / "sweep"
    lm_run(sweep / "0", ["model=gpt"], [2.0, 0.5], batch=8)
    make_run(sweep / "1", ["model=mlp"], [0.5, 0.6], config=BATCH)  # val_loss 0.5 then 0.4, no tokens
    report = report_of(sweep, target=0.5)
    header, cells = table(report)
    rows = {row[0]: dict(zip(header, row, strict=True)) for row in cells}
    gpt, mlp = rows["model=gpt"], rows["model=mlp"]
    assert (gpt["samples to target"], gpt["tokens to target"]) == ("320", "20,480")  # 20 × 2 × 8 (× 64)
    assert (mlp["samples to target"], mlp["tokens to target"]) == ("1,280", "—")  # 10 × 2 × 32 × 2
    assert (gpt["samples/s"], gpt["tokens/s"], mlp["samples/s"], mlp["tokens/s"]) == (
        "375",
        "24,000",
        "1,000",
        "—",
    )
    assert (gpt["final val_ppl"], mlp["final val_ppl"]) == (f"{math.exp(0.5):.4f}", "—")
    assert "samples: × the global batch" in markdown(report, [])


def test_perplexity_is_shown_beside_the_loss_and_its_best_is_the_lowest(tmp_path):
    sweep = tmp_path / "sweep"
    lm_run(sweep / "0", ["optim.lr=1e-3"], [2.5, 1.8, 2.0])
    report = report_of(sweep, target=1.9)
    header, cells = table(report)
    assert header[2:6] == ["final val_loss", "best val_loss", "final val_ppl", "best val_ppl"]
    assert cells[0][2:6] == ["2.0000", "1.8000", f"{math.exp(2.0):.4f}", f"{math.exp(1.8):.4f}"]
    assert "val_ppl beside it, not ranked (best: its lowest)" in markdown(report, [])
    header, rows = csv_table(report)
    assert dict(zip(header, rows[0], strict=True))["best_val_ppl"] == pytest.approx(math.exp(1.8))
    ranked_by_ppl = report_of(sweep, metric="val_ppl")
    assert not ranked_by_ppl.maximize and ranked_by_ppl.runs[0].beside == (2.0, 1.8)  # the loss beside it


def test_runs_without_perplexity_or_tokens_get_neither_column(tmp_path):
    sweep = tmp_path / "sweep"
    make_run(sweep / "0", ["optim.lr=0.01"], [0.5, 0.9], config=BATCH)
    header, _ = table(report_of(sweep))
    assert "final val_ppl" not in header and "tokens/s" not in header and "samples/s" in header
    assert "tokens_at_target" not in csv_table(report_of(sweep))[0]


#: (rule, link speed) -> validation losses and the seconds between them; the target is val_loss ≤ 1.9. At
#: 0.01 none reaches it (diloco comes closest, 1.95); at 0.1 diloco (6 s) before bsp (12 s); at 1 bsp
#: (2 s) before diloco (6 s): the winner changes with the link speed.
CELLS = {
    ("bsp", 0.01): ([2.5, 2.2, 2.0], 10.0),
    ("diloco", 0.01): ([2.6, 2.2, 1.95], 3.0),
    ("bsp", 0.1): ([2.4, 2.1, 1.85], 4.0),
    ("diloco", 0.1): ([2.8, 2.3, 2.0, 1.8], 1.5),
    ("bsp", 1): ([2.3, 1.88], 1.0),
    ("diloco", 1): ([2.8, 2.3, 2.0, 1.85], 1.5),
}


def link_sweep(root: Path) -> Path:
    """A multirun of LM runs over rule × simulate.link_gbps, one node per rank."""
    sweep = root / "sweep"
    sweep.mkdir(parents=True)
    task = ["rule=bsp,diloco", f"{LINK}=0.01,0.1,1", "simulate.ranks_per_node=1"]
    (sweep / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": task}}}))
    for n, ((rule, gbps), (losses, every)) in enumerate(CELLS.items()):
        lm_run(sweep / str(n), [f"rule={rule}", f"{LINK}={gbps}", "simulate.ranks_per_node=1"], losses, every)
    return sweep


def test_the_crossover_with_a_loss_target_names_the_first_at_each_speed(tmp_path):
    cross = crossover(report_of(link_sweep(tmp_path), target=1.9))
    assert cross.speeds == [0.01, 0.1, 1] and not cross.maximize
    assert sentences(cross) == [
        "At 0.01 Gbit/s, no rule reached val_loss ≤ 1.9 (closest: diloco, best val_loss 1.9500).",
        "At 0.1 Gbit/s, diloco reached val_loss ≤ 1.9 first, in 6 s: 0.5× the runner-up bsp's 12 s; final "
        "val_loss diloco 1.8000 and bsp 1.8500.",
        "At 1 Gbit/s, bsp reached val_loss ≤ 1.9 first, in 2 s: 0.33× the runner-up diloco's 6 s; final "
        "val_loss bsp 1.8800.",
    ]
    _, rows = grid(cross)
    assert rows == [
        ["bsp", "not reached (2.0000)", "12 s (1.8500)", "2 s (1.8800)"],
        ["diloco", "not reached (1.9500)", "6 s (1.8000)", "6 s (1.8500)"],
    ]
