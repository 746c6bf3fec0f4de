"""The sweep report on synthetic run folders (no training), and on real sweeps (slow)."""

from __future__ import annotations

import csv
import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import yaml
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
    config: dict | None = None,
    **summary,
) -> Path:
    """A run folder as the launcher leaves it: one validation per 10 steps and 1 s, an epoch record each;
    ``config``: its config.yaml (none by default)."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    if config is not None:
        (path / "config.yaml").write_text(json.dumps(config))  # JSON is YAML
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
        body = {"bytes_sent": bytes_sent, "samples_per_s": 1000.0, "comm_fraction": 0.25, **body}
        body.setdefault("steps", 10 * len(accs))
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
        overrides = ["rule=easgd", f"rule.alpha={alpha}", f"optim.lr={lr}"]
        make_run(sweep / str(n), overrides, accs, bytes_sent=4e6 if alpha == 0.1 else 8e6, **kwargs)
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
        assert summary["load"]["cpus"] >= 1 and summary["load"]["start"] >= 0 and summary["load"]["end"] >= 0
        config = yaml.safe_load((sweep / str(job) / "config.yaml").read_text())
        combos.add((str(config["rule"]["alpha"]), str(config["optim"]["lr"])))
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
    assert "Traceback" not in run.output and "did not complete" not in run.output, "every point ran"
    assert "1 sweep point(s) did not end ok: rule.alpha=0.9 diverged" in run.output, run.output
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


# -- issue 24: reports that explain (load, steps to target, plots that carry information) ----------------

LOADED = {"start": 3.1, "end": 3.5, "cpus": 2}
IDLE = {"start": 0.2, "end": 2.1, "cpus": 2}
BATCH = {"devices": 2, "train": {"batch_size": 32, "accumulate": 2}}


def test_the_launcher_records_the_machine_load_in_every_summary(tmp_path, monkeypatch):
    """``load`` in summary.json: the load average at the job's start (measured by launch) and end, and the
    CPUs; in the ranks' summary completed, in one written for a failed job, and None where unknown."""
    import os
    import types

    import runner.launcher.launch as launcher
    from runner.launcher.supervise import Outcome
    from tests.conftest import compose_config

    cfg, cpus = compose_config(), os.cpu_count()
    averages = iter([0.3, 1.7])
    monkeypatch.setattr(launcher, "load_average", lambda: next(averages))

    class Supervisor:  # the job: the ranks write their summary.json and exit 0
        def __init__(self, argv, run_dir, *args, **kwargs):
            self.run_dir = run_dir

        def run(self):
            self.run_dir.mkdir()
            (self.run_dir / "summary.json").write_text('{"status": "ok", "monitor": "val_acc"}')
            return Outcome(0)

    planned = types.SimpleNamespace(argv=["mpirun"], warning=None, lease=None, env={})
    checked = types.SimpleNamespace(
        world_size=2, launched=2, devices=2, train=types.SimpleNamespace(stall_timeout=60.0)
    )
    monkeypatch.setattr(launcher, "_prepare", lambda *args, **kwargs: (planned, checked))
    monkeypatch.setattr(launcher, "Supervisor", Supervisor)
    done = launcher.launch(cfg, tmp_path / "ok")
    assert done["load"] == {"start": 0.3, "end": 1.7, "cpus": cpus}
    assert json.loads((tmp_path / "ok" / "summary.json").read_text())["load"] == done["load"]
    monkeypatch.setattr(launcher, "load_average", lambda: 2.5)
    failed = tmp_path / "failed"
    (failed / "logs").mkdir(parents=True)
    with pytest.raises(launcher.JobEnded):
        launcher.conclude(cfg, failed, Outcome(1), 1.0, 0.4)
    summary = json.loads((failed / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["load"] == {"start": 0.4, "end": 2.5, "cpus": cpus}
    launcher.write_failure_summary(cfg, failed, "failed", "launcher error", 1.0)
    assert json.loads((failed / "summary.json").read_text())["load"]["start"] is None
    monkeypatch.undo()
    assert isinstance(launcher.load_average(), float)

    def no_load_average():
        raise OSError("no load average here")

    monkeypatch.setattr(os, "getloadavg", no_load_average)
    assert launcher.load_average() is None


def test_steps_and_samples_to_target_are_columns_and_break_ties_between_equal_bests(tmp_path):
    sweep = tmp_path / "sweep"
    make_run(sweep / "0", ["optim.lr=0.01"], [0.5, 0.7, 0.92, 0.95])  # the target at step 30
    make_run(sweep / "1", ["optim.lr=0.05"], [0.5, 0.95, 0.95, 0.95], config=BATCH)  # at step 20
    report = write_report([sweep])
    assert [r.name for r in report.runs] == ["optim.lr=0.05", "optim.lr=0.01"]  # equal bests: fewer steps
    assert [r.target_step for r in report.runs] == [20, 30]
    assert [r.target_samples for r in report.runs] == [20 * 2 * 32 * 2, None]  # no config.yaml: unknown
    md = (sweep / "report.md").read_text()
    assert "ranked by best val_acc (highest first; equal bests: fewer steps to target first" in md
    assert "| time to target (s) | steps to target | samples to target | wall time (s) |" in md
    assert "| optim.lr=0.05 | ok | 0.9500 | 0.9500 | 2.00 | 20 | 2,560 | 10.0 | unknown |" in md
    assert "| optim.lr=0.01 | ok | 0.9500 | 0.9500 | 3.00 | 30 | — | 10.0 | unknown |" in md
    rows = list(csv.DictReader(open(sweep / "report.csv", newline="")))
    assert [(r["step_at_target"], r["samples_at_target"]) for r in rows] == [("20", "2560.0"), ("30", "")]


def test_wall_times_taken_under_different_loads_are_flagged_above_the_table(tmp_path):
    from runner.report.table import load_note

    sweep = tmp_path / "sweep"
    make_run(sweep / "0", ["optim.lr=0.01"], [0.5, 0.9], load=IDLE)
    make_run(sweep / "1", ["optim.lr=0.05"], [0.6, 0.9], load=LOADED)
    make_run(sweep / "2", ["optim.lr=0.1"], [0.6, 0.8])  # an older run: no load recorded
    write_report([sweep])
    note = (
        "Wall times were taken under different machine loads (1-minute load average at the start: 0.2-3.1, "
        "above its CPU count for 1 run; unknown for 1 run): compare steps to target"
    )
    lines = (sweep / "report.md").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if note in line)
    assert lines[at + 2].startswith("| run |") and "| load (start→end) |" in lines[at + 2]
    assert any("| 3.1→3.5 on 2 CPUs |" in line for line in lines)
    assert any(line.startswith("| optim.lr=0.1 |") and "| unknown |" in line for line in lines)
    page = (sweep / "report.html").read_text()
    assert page.index(note) < page.index("<table>")
    rows = list(csv.DictReader(open(sweep / "report.csv", newline="")))
    assert {(r["load_start"], r["load_end"], r["cpus"]) for r in rows} == {
        ("0.2", "2.1", "2"),
        ("3.1", "3.5", "2"),
        ("", "", ""),
    }
    runs = report_of(sweep).runs
    alike = [r for r in runs if r.load is not None and r.load.start == 0.2]
    assert load_note(alike + [r for r in runs if r.load is None]) is None  # known loads that agree
    overloaded = load_note([r for r in runs if r.load is not None and r.load.start == 3.1])
    assert overloaded.startswith("Wall times were taken under a machine loaded beyond its CPUs (1-minute")
    old = tmp_path / "old"
    make_run(old / "0", ["optim.lr=0.01"], [0.5])
    make_run(old / "1", ["optim.lr=0.05"], [0.6])
    assert main([str(old)]) == 0 and "Wall times were taken" not in (old / "report.md").read_text()


def test_bytes_are_per_worker_and_step_so_rules_are_told_apart_and_equal_ones_not_drawn(tmp_path):
    """The same bytes over runs of different lengths are different communication; equal bars say nothing."""
    from runner.report.plots import figures

    sweep = tmp_path / "sweep"
    make_run(sweep / "0", ["rule=bsp"], [0.5, 0.6, 0.7, 0.9], bytes_sent=8e6)  # 2 workers × 40 steps
    make_run(sweep / "1", ["rule=easgd"], [0.5, 0.9], bytes_sent=8e6)  # 2 × 20 steps
    make_run(sweep / "2", ["rule=asgd"], [0.5, 0.9], bytes_sent=4e6, steps_per_worker=[30, 10])
    make_run(sweep / "3", ["rule=diloco"], [0.5, 0.9], bytes_sent=2e6, steps=40, resumed_from_step=30)
    # validating sent half of SPARTA's bytes (the mean model each time): the training's are the rest
    make_run(sweep / "4", ["rule=sparta"], [0.5, 0.9], bytes_sent=8e6, bytes_sent_validating=4e6)
    report = report_of(sweep)
    per_step = {r.name: r.bytes_per_step for r in report.runs}
    expected = {"rule=bsp": 1e5, "rule=easgd": 2e5, "rule=asgd": 1e5, "rule=diloco": 1e5, "rule=sparta": 1e5}
    assert per_step == expected
    totals = {r.bytes_per_worker for r in report.runs if r.name in ("rule=bsp", "rule=easgd")}
    assert totals == {4e6}  # their totals alone do not tell them apart
    bars = figures(report)["bytes_per_worker"]
    assert bars._suptitle.get_text().startswith("Bytes sent per worker per training step")
    assert "per optimizer step" in bars.axes[0].get_xlabel()
    write_report([sweep])
    md = (sweep / "report.md").read_text()
    assert "sent per worker per step (MB) |" in md and "| 0.200 |" in md
    assert (sweep / "bytes_per_worker.png").read_bytes().startswith(PNG)
    for run in ("2", "3"):  # two runs that sent the same per step: no plot, and an earlier one removed
        shutil.rmtree(sweep / run)
    write_report([sweep / "0", sweep / "1"], out=sweep)
    assert (sweep / "bytes_per_worker.png").exists()
    (sweep / "1" / "summary.json").write_text(json.dumps({"status": "ok", "devices": 2, "bytes_sent": 4e6}))
    write_report([sweep / "0", sweep / "1"], out=sweep)
    assert not (sweep / "bytes_per_worker.png").exists()


def test_axes_are_logarithmic_where_values_span_orders_of_magnitude(tmp_path):
    from runner.report.figure import log_scale
    from runner.report.plots import figures

    assert log_scale([0.01, 5.0]) and not log_scale([0.1, 0.3, None, 0, -1, "x", float("nan")])
    sweep = tmp_path / "sweep"
    make_run(sweep / "0", ["rule.alpha=0.1"], [0.5, 0.9, 0.95])
    make_run(sweep / "1", ["rule.alpha=0.9"], [0.5, 0.2, 0.1], status="diverged", error="exploded")
    for run, distances in (("0", [0.1, 0.05, 0.03]), ("1", [0.2, 50.0, 3000.0])):
        with open(sweep / run / "metrics.jsonl", "a") as f:
            for i, d in enumerate(distances):
                record = {"kind": "epoch", "step": 10 * (i + 1), "time": i, "center_distance": d}
                f.write(json.dumps(record) + "\n")
    drawn = figures(report_of(sweep))
    axes = drawn["rule_metrics"].axes[0]
    assert axes.get_yscale() == "log" and axes.get_ylabel().endswith("(log scale)")
    assert drawn["curves"].axes[0].get_yscale() == "linear"  # accuracies 0.1-0.95
    drawn = figures(report_of(sweep, metric="val_loss"))  # losses 0.05-0.9: linear too
    assert drawn["curves"].axes[0].get_yscale() == "linear"
    with open(sweep / "1" / "metrics.jsonl", "a") as f:
        f.write(
            json.dumps({"kind": "val", "step": 40, "time": 4.0, "val_acc": 0.0, "val_loss": 2.4e9}) + "\n"
        )
    assert figures(report_of(sweep, metric="val_loss"))["curves"].axes[0].get_yscale() == "log"
    shutil.rmtree(sweep / "1")
    assert figures(report_of(sweep))["rule_metrics"].axes[0].get_yscale() == "linear"
    write_report([sweep])
    assert all(p.read_bytes().startswith(PNG) for p in sweep.glob("*.png"))


def test_the_heatmap_colours_are_logarithmic_where_the_best_values_span_orders_of_magnitude(tmp_path):
    sweep = make_sweep(tmp_path)
    colorbar = figures_of(sweep, metric="val_loss")["heatmap"].axes[1]
    assert colorbar.get_yscale() == "linear" and "log scale" not in colorbar.get_ylabel()
    with open(sweep / "1" / "metrics.jsonl", "a") as f:  # one cell far below the others
        f.write(
            json.dumps({"kind": "val", "step": 30, "time": 3.0, "val_acc": 0.99, "val_loss": 1e-4}) + "\n"
        )
    colorbar = figures_of(sweep, metric="val_loss")["heatmap"].axes[1]
    assert colorbar.get_yscale() == "log" and colorbar.get_ylabel() == "best val_loss (log scale)"
    write_report([sweep], "val_loss")
    assert (sweep / "heatmap.png").read_bytes().startswith(PNG)


def figures_of(sweep: Path, **kwargs) -> dict:
    from runner.report.plots import figures

    return figures(report_of(sweep, **kwargs))


def test_a_long_name_is_shortened_in_the_plots_and_kept_whole_in_the_tables(tmp_path):
    """Runs of separate folders are named by every key that differs: a plot shows at most LABEL_CHARS of a
    name (its start and its end), the CSV the whole."""
    from runner.report.plots import LABEL_CHARS, _tag

    keys = [f"model.layer{i}.width={64 * i}" for i in range(1, 8)]
    report = report_of(
        make_run(tmp_path / "a", keys, [0.5, 0.9]), make_run(tmp_path / "b", keys[:3], [0.4, 0.8])
    )
    long = max(report.runs, key=lambda r: len(r.name))
    assert len(long.name) > LABEL_CHARS
    shown = _tag(long)
    assert len(shown) == LABEL_CHARS and shown.startswith(long.name[:20]) and shown.endswith(long.name[-20:])
    long.name = "rule=bsp"
    assert _tag(long) == "rule=bsp", "a short name is shown whole"
