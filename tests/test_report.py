"""The sweep report on synthetic run folders (no training), and on real sweeps (slow)."""

from __future__ import annotations

import csv
import json
import logging
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from runner.launcher.callbacks import SweepReport
from runner.report.__main__ import main
from runner.report.plots import heatmap_grid
from runner.report.runs import load_runs
from runner.report.table import score
from runner.report.write import write_report
from tests.conftest import ROOT, run_cli
from tests.helpers.rules import rules

PNG = b"\x89PNG\r\n\x1a\n"


def make_run(
    path: Path,
    overrides: list[str],
    accs: list[float],
    status: str = "ok",
    bytes_sent: float = 4e6,
    devices: int = 2,
    identity: bool = True,
    **summary,
) -> Path:
    """A run folder as the launcher leaves it: one validation per 10 steps and 1 s, an epoch record each."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    records = []
    for i, acc in enumerate(accs):
        step, time = 10 * (i + 1), float(i + 1)
        records.append({"kind": "val", "step": step, "time": time, "val_acc": acc, "val_loss": 1 - acc})
        records.append(
            {"kind": "epoch", "step": step, "time": time, "samples_per_s": 100.0, "comm_frac": 0.2}
        )
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    body = {"status": status, "devices": devices, "wall_time_s": 10.0, **summary}
    if status == "ok":
        body.update(bytes_sent=bytes_sent, samples_per_s=1000.0, comm_fraction=0.25)
    (path / "summary.json").write_text(json.dumps(body))
    return path


def make_sweep(root: Path, failed_cell: bool = False) -> Path:
    """A multirun over rule.alpha × optim.lr; with ``failed_cell`` the (0.5, 0.05) point failed at step 10."""
    sweep = root / "sweep"
    sweep.mkdir()
    task = ["rule=easgd", "rule.alpha=0.1,0.5", "optim.lr=0.01,0.05"]
    (sweep / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": task}}}))
    grid = {
        (0.1, 0.01): [0.5, 0.7],
        (0.1, 0.05): [0.8, 0.96],
        (0.5, 0.01): [0.6, 0.9],
        (0.5, 0.05): [0.7, 0.95],
    }
    for n, ((alpha, lr), accs) in enumerate(grid.items()):
        kwargs = {}
        if failed_cell and (alpha, lr) == (0.5, 0.05):
            accs = [0.7]
            kwargs = {"status": "failed", "error": "rank 1 failed: RuntimeError: boom", "cause": "boom"}
        make_run(sweep / str(n), ["rule=easgd", f"rule.alpha={alpha}", f"optim.lr={lr}"], accs, **kwargs)
    return sweep


def report_of(*dirs: Path, **kwargs):
    runs, keys = load_runs(list(dirs))
    return score(runs, keys, dirs[0], **kwargs)


def test_rows_are_named_by_the_swept_values_sorted_best_first_and_timed_to_target(tmp_path):
    report = report_of(make_sweep(tmp_path))
    assert report.keys == ["rule.alpha", "optim.lr"]
    names = [r.name for r in report.runs]
    assert names == [
        "rule.alpha=0.1,optim.lr=0.05",
        "rule.alpha=0.5,optim.lr=0.05",
        "rule.alpha=0.5,optim.lr=0.01",
        "rule.alpha=0.1,optim.lr=0.01",
    ]
    assert [(r.final, r.best) for r in report.runs][0] == (0.96, 0.96)
    assert report.best.name == names[0]
    assert report.target == pytest.approx(0.95 * 0.96)
    assert [r.target_time_s for r in report.runs] == [2.0, 2.0, None, None]
    assert [r.target_step for r in report.runs] == [20, 20, None, None]
    assert report.runs[0].bytes_per_worker == 2e6 and report.runs[0].swept == {
        "rule.alpha": 0.1,
        "optim.lr": 0.05,
    }


def test_a_given_target_and_a_loss_metric_which_is_minimised(tmp_path):
    report = report_of(make_sweep(tmp_path), target=0.85)
    assert [r.target_time_s for r in report.runs] == [2.0, 2.0, 2.0, None]
    report = report_of(tmp_path / "sweep", metric="val_loss")
    assert report.runs[0].best == pytest.approx(0.04) and not report.maximize
    assert report.target == pytest.approx(0.04 / 0.95)


def test_a_failed_run_is_listed_with_its_cause_while_the_rest_are_compared(tmp_path):
    sweep = make_sweep(tmp_path, failed_cell=True)
    report = report_of(sweep)
    last = report.runs[-1]
    assert (last.name, last.status, last.best) == ("rule.alpha=0.5,optim.lr=0.05", "failed", 0.7)
    assert last.cause == "rank 1 failed: RuntimeError: boom" and last.bytes_per_worker is None
    assert last.samples_per_s == 100.0 and last.comm_fraction == 0.2  # from its epoch records
    assert [r.name for r in report.failed] == [last.name]
    assert report.best.name == "rule.alpha=0.1,optim.lr=0.05" and report.target == pytest.approx(0.912)
    from runner.report.table import markdown

    md = markdown(report, [])
    assert "**Best run: rule.alpha=0.1,optim.lr=0.05**" in md
    assert "- **rule.alpha=0.5,optim.lr=0.05** (failed, " in md and "RuntimeError: boom" in md
    rows = [line for line in md.splitlines() if line.startswith("| rule.")]
    assert len(rows) == 4 and rows[-1].startswith("| rule.alpha=0.5,optim.lr=0.05 | failed | 0.7000 |")


def test_the_heatmap_grid_of_a_two_key_sweep(tmp_path):
    grid = heatmap_grid(report_of(make_sweep(tmp_path, failed_cell=True)))
    assert (grid.row_key, grid.col_key, grid.rows, grid.cols) == (
        "rule.alpha",
        "optim.lr",
        [0.1, 0.5],
        [0.01, 0.05],
    )
    assert grid.values == [[0.7, 0.96], [0.9, 0.7]]
    assert grid.status == [["ok", "ok"], ["ok", "failed"]]
    one_key = tmp_path / "one"
    make_run(one_key / "0", ["optim.lr=0.01"], [0.5])
    make_run(one_key / "1", ["optim.lr=0.05"], [0.6])
    assert heatmap_grid(report_of(one_key)) is None


def test_separate_runs_are_named_by_what_differs_and_prefer_the_recorded_identity(tmp_path):
    for rule in rules():
        overrides = [] if rule == "bsp" else [f"rule={rule}"]  # the default rule: no override recorded
        make_run(tmp_path / rule, [*overrides, "model=mlp"], [0.9], rule=rule)
    report = report_of(*(tmp_path / r for r in rules()))
    assert report.keys == ["rule"]
    assert sorted(r.name for r in report.runs) == [f"rule={r}" for r in rules()]
    sweep = tmp_path / "recorded"
    make_run(sweep / "0", ["optim.lr=0.01"], [0.5], name="optim.lr=0.010", swept={"optim.lr": 0.01})
    make_run(sweep / "1", ["optim.lr=0.05"], [0.6], name="optim.lr=0.050", swept={"optim.lr": 0.05})
    assert [r.name for r in report_of(sweep).runs] == ["optim.lr=0.050", "optim.lr=0.010"]


def test_csv_round_trip(tmp_path):
    write_report([make_sweep(tmp_path, failed_cell=True)])
    with open(tmp_path / "sweep" / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows][0] == "rule.alpha=0.1,optim.lr=0.05" and len(rows) == 4
    first, last = rows[0], rows[-1]
    assert float(first["best_val_acc"]) == 0.96 and float(first["time_to_target_s"]) == 2.0
    assert float(first["rule.alpha"]) == 0.1 and float(first["optim.lr"]) == 0.05
    assert float(first["bytes_sent_per_worker"]) == 2e6 and float(first["comm_fraction"]) == 0.25
    assert last["status"] == "failed" and last["cause"] == "rank 1 failed: RuntimeError: boom"
    assert last["bytes_sent_per_worker"] == "" and last["time_to_target_s"] == ""


def test_the_html_shows_every_png_which_are_valid(tmp_path):
    sweep = make_sweep(tmp_path, failed_cell=True)
    with open(sweep / "0" / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"kind": "epoch", "step": 20, "time": 2.0, "center_distance": 0.3}) + "\n")
    write_report([sweep])
    pngs = sorted(p.name for p in sweep.glob("*.png"))
    assert pngs == [
        "bytes_per_worker.png",
        "curves.png",
        "heatmap.png",
        "rule_metrics.png",
        "time_to_target.png",
    ]
    page = (sweep / "report.html").read_text()
    assert sorted(re.findall(r"<img src='([^']+)'", page)) == pngs
    assert all((sweep / p).read_bytes().startswith(PNG) for p in pngs)
    assert "<script" not in page and "RuntimeError: boom" in page
    assert all(f"]({p})" in (sweep / "report.md").read_text() for p in pngs)


def test_a_single_run_gets_its_curves(tmp_path):
    run = make_run(tmp_path / "run", ["model=mlp"], [0.5, 0.8])
    assert main([str(run)]) == 0
    assert (run / "curves.png").read_bytes().startswith(PNG)
    assert "| model=mlp | ok | 0.8000 | 0.8000 |" in (run / "report.md").read_text()


def test_a_folder_without_runs_or_an_unknown_metric_is_refused_with_exit_2(tmp_path, capsys):
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path) in err and "no run folders" in err and "outputs/multirun/DATE/TIME" in err
    assert len(err.strip().splitlines()) == 1
    make_run(tmp_path / "0", [], [0.5])
    assert main([str(tmp_path), "--metric", "val_accuracy"]) == 2
    assert "no run recorded 'val_accuracy'; the validations have: val_acc, val_loss" in (
        capsys.readouterr().err
    )


def test_the_callback_logs_a_report_it_cannot_write_and_never_raises(tmp_path, caplog):
    config = OmegaConf.create({"hydra": {"sweep": {"dir": str(tmp_path / "missing")}}})
    with caplog.at_level(logging.INFO, logger="runner"):
        SweepReport().on_multirun_end(config)
    assert "the sweep report could not be written: NoRuns" in caplog.text
    make_sweep(tmp_path)
    config.hydra.sweep.dir = str(tmp_path / "sweep")
    with caplog.at_level(logging.INFO, logger="runner"):
        SweepReport(target=0.9).on_multirun_end(config)
    assert "sweep report: " in caplog.text and (tmp_path / "sweep" / "report.html").exists()
    (tmp_path / "sweep" / "report.html").unlink()
    at_exit = SweepReport()  # a sweep that raised: the report is written as the launcher exits
    at_exit.sweep_dir = tmp_path / "sweep"
    at_exit._at_exit()
    assert (tmp_path / "sweep" / "report.html").exists()


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_real_two_by_two_sweep_leaves_its_report(tmp_path):
    sweep = tmp_path / "sweep"
    overrides = ["rule=easgd", "rule.alpha=0.1,0.5", "optim.lr=0.01,0.05", "train.epochs=1", "model=mlp"]
    run = run_cli(sweep, *overrides, multirun=True, timeout=280)
    assert run.returncode == 0, run.output
    assert "sweep report: " in run.output
    for name in ("report.md", "report.csv", "report.html", "curves.png", "heatmap.png", "time_to_target.png"):
        assert (sweep / name).is_file(), name
    with open(sweep / "report.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    combos = set()
    for job in range(4):  # one folder per combination, each with its own values
        summary = json.loads((sweep / str(job) / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["rule"] == "easgd"
        config = (sweep / str(job) / "config.yaml").read_text()
        combos.add((config.split("alpha: ")[1].split()[0], config.split("lr: ")[1].split()[0]))
    assert combos == {("0.1", "0.01"), ("0.1", "0.05"), ("0.5", "0.01"), ("0.5", "0.05")}
    assert sorted((float(r["rule.alpha"]), float(r["optim.lr"])) for r in rows) == [
        (0.1, 0.01),
        (0.1, 0.05),
        (0.5, 0.01),
        (0.5, 0.05),
    ]
    assert all(r["status"] == "ok" and float(r["bytes_sent_per_worker"]) > 0 for r in rows)
    runs, keys = load_runs([sweep])
    assert keys == ["rule.alpha", "optim.lr"]
    grid = heatmap_grid(score(runs, keys, sweep))
    assert len(grid.values) == 2 and all(len(row) == 2 and None not in row for row in grid.values)


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(200)
def test_a_sweep_with_a_failed_point_still_leaves_its_report(tmp_path):
    """Hydra skips on_multirun_end when a point failed: the report is written as the launcher exits."""
    sweep = tmp_path / "sweep"
    searchpath = f"hydra.searchpath=[file://{ROOT / 'tests' / 'conf'}]"
    run = run_cli(sweep, searchpath, "model=mlp,exploding", "train.epochs=1", multirun=True, timeout=180)
    assert run.returncode == 1, run.output
    md = (sweep / "report.md").read_text()
    assert "**Best run: model=mlp**" in md
    assert "- **model=exploding** (failed, " in md and "RuntimeError: injected failure" in md


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(300)
def test_a_collapsed_sweep_point_ends_diverged_and_the_report_says_why(tmp_path):
    """EASGD with alpha=0.9 and lr=0.1 on 2 workers: the loss explodes while finite (val_loss 1.09 after
    epoch 0, 212 after epoch 3, 2.4e9 after epoch 9); it used to end ``ok``, exit 0."""
    sweep = tmp_path / "sweep"
    overrides = ["rule=easgd", "rule.alpha=0.1,0.9", "optim.lr=0.1", "train.epochs=6"]
    run = run_cli(sweep, *overrides, multirun=True, timeout=280)
    assert run.returncode == 3, run.output
    healthy, collapsed = (json.loads((sweep / str(job) / "summary.json").read_text()) for job in (0, 1))
    assert healthy["status"] == "ok" and healthy["final_val_acc"] > 0.9, healthy
    assert collapsed["status"] == "diverged" and collapsed["exit_status"] == 3, collapsed
    first = collapsed["validations"][0]["val_loss"]
    step = int(re.search(r"step (\d+): validation loss", collapsed["error"]).group(1))
    last = next(v for v in collapsed["validations"] if v["step"] == step)
    assert last["val_loss"] > 100 * first and all(
        v["val_loss"] <= 100 * first for v in collapsed["validations"][:-1]
    )
    assert "train.diverge_at=100" in collapsed["error"] and "no checkpoint was written" in collapsed["error"]
    md = (sweep / "report.md").read_text()
    assert "- **rule.alpha=0.9** (diverged, " in md and "train.diverge_at" in md, md
    rows = list(csv.DictReader(open(sweep / "report.csv", newline="")))
    assert {r["rule.alpha"]: r["status"] for r in rows} == {"0.1": "ok", "0.9": "diverged"}


def test_the_report_compares_the_runs_monitored_metric_by_default(tmp_path):
    """Runs that monitored val_loss (a regression, say) are compared on it, lowest first."""
    sweep = tmp_path / "sweep"
    for i, accs in enumerate([[0.2, 0.5], [0.3, 0.9]]):  # val_loss = 1 - acc: run 1 has the lower loss
        make_run(sweep / str(i), [f"optim.lr={i}"], accs, monitor="val_loss")
    report = write_report([sweep])
    assert report.metric == "val_loss" and not report.maximize
    assert [r.best for r in report.runs] == pytest.approx([0.1, 0.5])
    assert write_report([sweep], "val_acc").maximize
