"""How sure the sweep report is (issue 38): seeds as one point with mean ± spread, ties within noise in
words, and the model scored per rule with EASGD's workers' mean beside its center. Synthetic run folders
(no training), and one real 2-rule × 3-seed sweep (slow)."""

from __future__ import annotations

import csv
import json
import logging
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.launcher.callbacks import SweepReport
from runner.report.__main__ import main
from runner.report.confidence import SCORED, Spread
from runner.report.plots import heatmap_grid
from runner.report.write import write_report
from tests.conftest import run_cli
from tests.helpers.rules import rules
from tests.report.test_report import make_run, report_of

SAMPLES = 360  # the default job's validation set (digits: 20% of 1797)


def seeded(root: Path, points: dict[str, list[float]], val_count: int | None = SAMPLES, **workers) -> Path:
    """A sweep ``-m rule=A,B train.seed=1,2,...``: per point (``rule=...``) a run per final accuracy;
    ``workers``: per rule, the workers' mean model's accuracy each run recorded beside its own."""
    sweep = root / "sweep"
    sweep.mkdir(parents=True)
    seeds = max(len(accs) for accs in points.values())
    task = [f"rule={','.join(points)}", f"train.seed={','.join(str(s + 1) for s in range(seeds))}"]
    (sweep / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": task}}}))
    job = 0
    for rule, accs in points.items():
        for seed, acc in enumerate(accs, 1):
            extra = {} if val_count is None else {"val_count": val_count}
            run = make_run(
                sweep / str(job), [f"rule={rule}", f"train.seed={seed}"], [0.3, acc], rule=rule, **extra
            )
            if rule in workers:
                add_workers_mean(run, workers[rule][seed - 1])
            job += 1
    return sweep


def add_workers_mean(run: Path, acc: float) -> None:
    """EASGD's records: ``worker_mean_val_acc`` beside each validation of the center (``val_acc``)."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    for record in records:
        if record["kind"] == "val":
            record.update(worker_mean_val_acc=acc, worker_mean_val_loss=1 - acc)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def md_of(sweep: Path, *args) -> str:
    write_report([sweep], *args)
    return (sweep / "report.md").read_text()


def line(md: str, start: str) -> str:
    """The first line of ``md`` that starts with ``start``."""
    return next(text for text in md.splitlines() if text.startswith(start))


def test_seeds_of_a_point_are_aggregated_as_mean_and_spread_with_n(tmp_path):
    sweep = seeded(tmp_path, {"bsp": [0.95, 0.96, 0.955], "easgd": [0.90, 0.91, 0.92]})
    report = report_of(sweep)
    assert [(p.name, p.best.n) for p in report.points] == [("rule=bsp", 3), ("rule=easgd", 3)]
    assert report.points[0].best.mean == pytest.approx(0.955)
    assert report.points[0].best.text() == "0.9550 (range 0.9500–0.9600, n=3)"
    md = md_of(sweep)
    assert "## Points (mean over seeds)" in md
    assert (
        "| rule=bsp | 3 of 3 | 0.9550 (range 0.9500–0.9600, n=3) | 0.9550 (range 0.9500–0.9600, n=3) |" in md
    )
    assert "for n ≤ 3 seeds the range (min–max), for more ± the sample standard deviation" in md
    rows = list(csv.DictReader(open(sweep / "report.csv", newline="")))
    assert sorted({(r["point"], r["train.seed"]) for r in rows}) == [
        (f"rule={rule}", str(seed)) for rule in ("bsp", "easgd") for seed in (1, 2, 3)
    ]
    assert {r["val_count"] for r in rows} == {"360"}
    five = Spread((0.95, 0.96, 0.955, 0.94, 0.945))  # more than 3 seeds: ± the sample standard deviation
    assert five.text() == "0.9500 ± 0.0079 (n=5)" and five.low == pytest.approx(0.95 - 0.0079, abs=1e-4)


def test_one_seed_within_one_validation_sample_is_a_tie_in_words(tmp_path):
    """The issue's case: 0.9944 against 0.9917, 358 and 357 of 360 samples, was ranked without comment."""
    sweep = seeded(tmp_path, {"bsp": [358 / SAMPLES], "easgd": [357 / SAMPLES]})
    md = md_of(sweep)
    assert "**No clear best: rule=bsp,train.seed=1 and rule=easgd,train.seed=1 tie**" not in md  # points
    assert "**No clear best: rule=bsp and rule=easgd tie** (best val_acc 0.9944 and 0.9917: within one " in md
    assert (
        "Ranking by best val_acc: 1. rule=bsp at 0.9944 and rule=easgd at 0.9917 tie: within one validation "
        "sample (1/360) of each other." in md
    )
    assert "One seed per point: runs within one validation sample (1/360) of each other tie" in md
    assert "Best run:" not in md
    apart = seeded(tmp_path / "apart", {"bsp": [358 / SAMPLES], "easgd": [356 / SAMPLES]})  # 2 samples
    md = md_of(apart)
    assert "**Best run: rule=bsp" in md and "tie" not in line(md, "Ranking")
    assert "1. rule=bsp at 0.9944; 2. rule=easgd at 0.9889." in md


def test_without_a_validation_size_one_seed_is_not_tested_and_says_so(tmp_path):
    sweep = seeded(tmp_path, {"bsp": [358 / SAMPLES], "easgd": [357 / SAMPLES]}, val_count=None)
    md = md_of(sweep)
    assert "**Best run: rule=bsp" in md
    assert (
        "differences are not tested against noise; repeat each point with seeds (-m ... train.seed=1,2,3)"
        in md
    )
    losses = md_of(seeded(tmp_path / "loss", {"bsp": [0.99], "easgd": [0.989]}), "val_loss")
    assert "**Best run: rule=bsp" in losses  # a loss counts no samples: one sample does not apply


def test_repeats_whose_spreads_overlap_tie(tmp_path):
    sweep = seeded(tmp_path, {"bsp": [0.95, 0.96, 0.97], "easgd": [0.93, 0.955, 0.975]})
    md = md_of(sweep)
    assert "**No clear best: rule=bsp and rule=easgd tie**" in md
    assert "tie: their spreads overlap." in md
    assert "Two points tie when their spreads overlap or lie within one validation sample (1/360)" in md
    assert main([str(sweep)]) == 0
    near = seeded(tmp_path / "near", {"bsp": [0.95, 0.955, 0.96], "easgd": [0.94, 0.945, 0.9489]})
    assert "tie: their spreads overlap or lie within one validation sample (1/360) of each other." in md_of(
        near
    )


def test_a_clear_winner_is_named_and_ranked(tmp_path, capsys):
    sweep = seeded(tmp_path, {"easgd": [0.90, 0.91, 0.92], "bsp": [0.95, 0.96, 0.955]})
    md = md_of(sweep)
    assert (
        "**Best point: rule=bsp** (best val_acc, mean over its seeds: 0.9550 (range 0.9500–0.9600, n=3))"
        in md
    )
    assert (
        "Ranking by best val_acc (mean over seeds where repeated): 1. rule=bsp at 0.9550 (range "
        "0.9500–0.9600, n=3); 2. rule=easgd at 0.9100 (range 0.9000–0.9200, n=3)." in md
    )
    assert "tie" not in line(md, "Ranking") + line(md, "**")
    assert main([str(sweep)]) == 0
    assert "6 runs; best: rule=bsp, val_acc 0.9550 (range 0.9500–0.9600, n=3);" in capsys.readouterr().out


def test_ties_chain_so_no_order_is_claimed_between_points_that_tie(tmp_path):
    """A ties B and B ties C (each a sample apart): one group, though A is two samples above C."""
    sweep = seeded(tmp_path, {"bsp": [358 / SAMPLES], "easgd": [357 / SAMPLES], "asgd": [356 / SAMPLES]})
    groups = report_of(sweep).standing.groups
    assert [[p.name for p in g] for g in groups] == [["rule=bsp", "rule=easgd", "rule=asgd"]]
    sweep = seeded(
        tmp_path / "two", {"bsp": [358 / SAMPLES], "easgd": [357 / SAMPLES], "asgd": [355 / SAMPLES]}
    )
    md = md_of(sweep)
    assert (
        "1. rule=bsp at 0.9944 and rule=easgd at 0.9917 tie: within one validation sample (1/360) of each "
        in md
    )
    assert "other; 3. rule=asgd at 0.9861." in md


def test_easgd_is_scored_by_its_center_with_its_workers_mean_beside_it(tmp_path):
    """The issue's case: workers averaging 0.969 ranked last on a center of 0.378, without a word."""
    sweep = seeded(
        tmp_path,
        {"bsp": [0.95, 0.96, 0.955], "easgd": [0.378, 0.40, 0.39]},
        easgd=[0.969, 0.97, 0.968],
    )
    md = md_of(sweep)
    assert "Scored model (what each run reports and saves as model.pt, the one a user keeps): bsp: the " in md
    assert "easgd: the center x̃. Shown beside it, not ranked: easgd's workers' mean model." in md
    assert "| point | runs ok | best val_acc | final val_acc | best val_acc: workers' mean model |" in md
    assert "| rule=easgd | 3 of 3 | 0.3893 (range 0.3780–0.4000, n=3) | " in md
    assert "| 0.9690 (range 0.9680–0.9700, n=3) |" in md
    assert (
        "rule=easgd: its workers' mean model reached best val_acc 0.9690 (range 0.9680–0.9700, n=3), its "
        "scored center x̃ 0.3893 (range 0.3780–0.4000, n=3); model.pt keeps the latter (--metric "
        "worker_mean_val_acc ranks by the former)." in md
    )
    runs = md.split("## Runs")[1]
    assert "| best val_acc | best val_acc: workers' mean model |" in runs and "| 0.3780 | 0.9690 |" in runs
    page = (sweep / "report.html").read_text()
    assert "<th>best val_acc: workers&#x27; mean model</th>" in page and "the center x̃" in page
    rows = list(csv.DictReader(open(sweep / "report.csv", newline="")))
    assert sorted(float(r["best_worker_mean_val_acc"]) for r in rows if r["point"] == "rule=easgd") == [
        0.968,
        0.969,
        0.97,
    ]
    close = seeded(tmp_path / "close", {"easgd": [0.95]}, easgd=[0.951])  # within a sample: no line
    assert "model.pt keeps the latter" not in md_of(close)


def test_every_rule_names_the_model_it_scores():
    """A rule's author adds its scored model (the one model.pt keeps) to runner/report/confidence.py."""
    missing = [rule for rule in rules() if rule not in SCORED]
    assert not missing, f"add {missing} to SCORED in runner/report/confidence.py: the model each reports"


def test_the_heatmap_of_a_seeded_two_key_sweep_shows_each_points_mean(tmp_path):
    sweep = tmp_path / "sweep"
    task = ["rule.alpha=0.1,0.5", "optim.lr=0.01,0.05", "train.seed=1,2"]
    (sweep).mkdir()
    (sweep / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": task}}}))
    job = 0
    for alpha in (0.1, 0.5):
        for lr in (0.01, 0.05):
            for seed in (1, 2):
                acc = 0.5 + alpha + lr + seed / 100
                overrides = [f"rule.alpha={alpha}", f"optim.lr={lr}", f"train.seed={seed}"]
                make_run(sweep / str(job), overrides, [acc], val_count=SAMPLES)
                job += 1
    grid = heatmap_grid(report_of(sweep))
    assert (grid.row_key, grid.col_key) == ("rule.alpha", "optim.lr")
    assert sum(grid.values, []) == pytest.approx([0.625, 0.665, 1.025, 1.065])  # the means of 2 seeds


def test_the_callback_logs_the_verdict(tmp_path, caplog):
    sweep = seeded(tmp_path, {"bsp": [358 / SAMPLES], "easgd": [357 / SAMPLES]})
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(sweep)}}})
    with caplog.at_level(logging.INFO, logger="runner"):
        SweepReport().on_multirun_end(config)
    assert "(2 runs; best: a tie: rule=bsp and rule=easgd (val_acc within noise))" in caplog.text


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(240)
def test_a_real_two_rule_three_seed_sweep_reports_points_and_easgds_workers(tmp_path):
    sweep = tmp_path / "sweep"
    overrides = ["rule=bsp,easgd", "train.seed=1,2,3", "model=mlp", "train.max_steps=12"]
    run = run_cli(sweep, *overrides, multirun=True, timeout=220)
    assert run.returncode == 0, run.output
    summaries = [json.loads((sweep / str(job) / "summary.json").read_text()) for job in range(6)]
    assert all(s["status"] == "ok" and s["val_count"] == SAMPLES for s in summaries)
    report = report_of(sweep)
    assert sorted((p.name, p.best.n) for p in report.points) == [("rule=bsp", 3), ("rule=easgd", 3)]
    easgd = next(p for p in report.points if p.rule == "easgd")
    assert list(easgd.others) == ["worker_mean"] and easgd.others["worker_mean"].n == 3
    md = (sweep / "report.md").read_text()
    assert "## Points (mean over seeds)" in md and "easgd: the center x̃" in md
    assert "| best val_acc: workers' mean model |" in md
    assert ("**Best point: " in md) != ("**No clear best: " in md), md
    assert "sweep report: " in run.output and "(6 runs; best: " in run.output


def test_a_run_whose_saved_final_model_fell_behind_its_ranked_best_is_named(tmp_path):
    """The ranking is by the best validation; model.pt is the final model: where they differ by more than
    noise (one validation sample here), the report says so, naming the run and both values."""
    import json

    from runner.report.runs import load_runs
    from runner.report.table import markdown, score
    from tests.report.test_report_network import make_run

    sweep = tmp_path / "sweep"
    sweep.mkdir()
    task = ["rule=bsp,diloco"]
    (sweep / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": task}}}))
    make_run(sweep / "0", ["rule=bsp"], [0.95, 0.985, 0.9861], 1.0)  # final within noise of its best
    make_run(sweep / "1", ["rule=diloco"], [0.96, 0.9972, 0.9667], 1.0)
    runs, keys = load_runs([sweep])
    text = markdown(score(runs, keys, sweep, "val_acc", None), [])
    said = [line for line in text.splitlines() if line.startswith("Ranked by best val_acc, but")]
    assert len(said) == 1, text
    assert "rule=diloco (best 0.9972, final 0.9667)" in said[0] and "rule=bsp" not in said[0]


def test_one_run_of_a_loss_is_not_said_to_fall_behind_by_more_than_noise(tmp_path):
    """A loss counts no items (no validation sample's worth) and one run has no spread: its noise is
    unknown, so a final 0.0007 above its best (DeMo's on the GPT) is not called more than noise."""
    from runner.report.confidence import Point, Spread
    from runner.report.verdict import final_behind

    point = Point("rule=demo", [], Spread.of([1.9341]), Spread.of([1.9348]), rule="demo")
    standing = type("Standing", (), {"points": [point], "maximize": False, "metric": "val_loss"})()
    assert final_behind(standing) is None
    point.resolution = 1e-4  # (as if one item were worth 1e-4: then it is more than noise)
    assert "rule=demo (best 1.9341, final 1.9348)" in final_behind(standing)
