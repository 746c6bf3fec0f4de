"""The report over link speeds (runner/report/network.py): a sentence per speed naming the rule that reached
the target first and by how much, a tie within noise, none reached; the crossover plot. From hand-made run
folders, in process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from runner.report.crossover_plot import crossover_figure
from runner.report.network import HEADING, crossover, grid, section, sentences, summary_line
from runner.report.runs import load_runs
from runner.report.table import markdown, score
from runner.report.write import write_report
from tests.report.test_report import make_sweep

LINK = "simulate.link_gbps"
#: (rule, link speed or None for free links) -> validations' accuracies and the seconds between them. The
#: target is 0.95: at 0.01 none reaches it; at 0.1 diloco (2 s) before gosgd (4 s) and bsp (10 s); at 1 bsp
#: (3 s) and diloco (3.5 s) tie, within bsp's validation interval (1 s); with free links bsp (1 s) before
#: diloco (3 s), gosgd never.
LOW, HIGH = 0.9, 0.96
CELLS = {
    ("bsp", 0.01): ([LOW] * 4, 5.0),
    ("diloco", 0.01): ([LOW] * 8, 1.0),
    ("gosgd", 0.01): ([LOW] * 8, 1.0),
    ("bsp", 0.1): ([LOW] * 4 + [HIGH, 0.97], 2.0),
    ("diloco", 0.1): ([LOW, 0.955, 0.96, 0.962], 1.0),
    ("gosgd", 0.1): ([LOW] * 3 + [HIGH] * 2, 1.0),
    ("bsp", 1): ([LOW, LOW, 0.97, 0.975], 1.0),
    ("diloco", 1): ([LOW] * 6 + [HIGH, 0.965], 0.5),
    ("gosgd", 1): ([LOW] * 5 + [HIGH], 1.0),
    ("bsp", None): ([0.97, 0.98], 1.0),
    ("diloco", None): ([LOW] * 5 + [0.96], 0.5),
    ("gosgd", None): ([LOW] * 4, 1.0),
}


def make_run(path: Path, overrides: list[str], accs: list[float], every: float, status: str = "ok") -> None:
    """A run folder whose validations come ``every`` seconds (and 10 steps) apart."""
    (path / ".hydra").mkdir(parents=True)
    (path / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    records = [
        {"kind": "val", "step": 10 * (i + 1), "time": every * (i + 1), "val_acc": acc}
        for i, acc in enumerate(accs)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = {"status": status, "devices": 4, "wall_time_s": 10.0, "steps": 10 * len(accs)}
    (path / "summary.json").write_text(json.dumps({**summary, "val_count": 360}))


def make_link_sweep(root: Path, cells: dict = CELLS, seeds: tuple[int, ...] = ()) -> Path:
    """A multirun over rule × simulate.link_gbps (null: free links), one node per rank (and over seeds)."""
    sweep = root / "sweep"
    sweep.mkdir(parents=True)
    rules = ",".join(dict.fromkeys(r for r, _ in cells))
    speeds = ",".join(dict.fromkeys(_speed(g) for _, g in cells))
    task = [f"rule={rules}", f"{LINK}={speeds}", "simulate.ranks_per_node=1"]
    task += [f"train.seed={','.join(map(str, seeds))}"] if seeds else []
    (sweep / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": task}}}))
    n = 0
    for (rule, gbps), value in cells.items():
        for seed, (accs, every) in zip(seeds or (None,), value if seeds else [value], strict=True):
            speed = _speed(gbps)
            extra = [] if seed is None else [f"train.seed={seed}"]
            overrides = [f"rule={rule}", f"{LINK}={speed}", "simulate.ranks_per_node=1", *extra]
            make_run(sweep / str(n), overrides, accs, every)
            n += 1
    return sweep


def _speed(gbps) -> str:
    """A link speed as an override's value: ``0.1``, ``[1,1,0.05]`` (one per node), ``null``."""
    if isinstance(gbps, tuple):
        return "[" + ",".join(f"{g:g}" for g in gbps) + "]"
    return "null" if gbps is None else str(gbps)


def report_of(sweep: Path, target: float | None = 0.95):
    runs, keys = load_runs([sweep])
    return score(runs, keys, sweep, "val_acc", target)


def test_a_sentence_per_speed_names_the_first_its_ratios_a_tie_and_none_reached(tmp_path):
    cross = crossover(report_of(make_link_sweep(tmp_path)))
    assert cross.speeds == [0.01, 0.1, 1, None] and cross.series == ["bsp", "diloco", "gosgd"]
    none, winner, tie, free = sentences(cross)
    assert none == "At 0.01 Gbit/s, no rule reached val_acc ≥ 0.95 (closest: bsp, best val_acc 0.9000)."
    assert winner == (
        "At 0.1 Gbit/s, diloco reached val_acc ≥ 0.95 first, in 2 s: 0.5× the runner-up gosgd's 4 s, "
        "0.2× bsp's 10 s; final val_acc diloco 0.9620 and bsp 0.9700."
    )
    assert tie == (
        "At 1 Gbit/s, bsp and diloco tie in reaching val_acc ≥ 0.95 first (bsp 3 s and diloco 3.5 s: within "
        "one validation interval, 1 s, of each other): 0.5× the runner-up gosgd's 6 s; final val_acc bsp "
        "0.9750 and diloco 0.9650."
    )
    assert free == (
        "With free links, bsp reached val_acc ≥ 0.95 first, in 1 s: 0.33× the runner-up diloco's 3 s; "
        "final val_acc bsp 0.9800."
    )


def test_times_further_apart_than_a_validation_interval_do_not_tie(tmp_path):
    cells = dict(CELLS)
    cells[("diloco", 1)] = ([LOW] * 8 + [HIGH], 0.5)  # 4.5 s: 1.5 s after bsp's 3 s, beyond its 1 s interval
    sentence = sentences(crossover(report_of(make_link_sweep(tmp_path, cells))))[2]
    assert sentence.startswith(
        "At 1 Gbit/s, bsp reached val_acc ≥ 0.95 first, in 3 s: 0.67× the runner-up diloco"
    )


def test_only_one_reached_and_bsp_did_not(tmp_path):
    cells = {k: v for k, v in CELLS.items() if k[1] in (0.01, 0.1)}
    cells[("gosgd", 0.1)] = cells[("bsp", 0.1)] = ([LOW] * 3, 1.0)
    last = sentences(crossover(report_of(make_link_sweep(tmp_path, cells))))[-1]
    assert last == (
        "At 0.1 Gbit/s, diloco reached val_acc ≥ 0.95 first, in 2 s: no other rule reached it, bsp did not "
        "reach it; final val_acc diloco 0.9620 and bsp 0.9000."
    )


def test_seeds_whose_times_overlap_tie_and_a_seed_that_missed_leaves_its_point_unreached(tmp_path):
    cells = {
        ("bsp", 0.1): [([LOW, HIGH], 1.0), ([LOW] * 5 + [HIGH], 1.0)],  # 2 s and 6 s
        ("diloco", 0.1): [([LOW] * 29 + [HIGH], 0.1)] * 2,  # 3 s both: inside bsp's 2-6 s
        ("gosgd", 0.1): [([HIGH], 0.1), ([LOW], 0.1)],  # one seed missed
        ("bsp", 1): [([HIGH], 1.0)] * 2,
        ("diloco", 1): [([LOW, HIGH], 2.0)] * 2,
        ("gosgd", 1): [([LOW], 1.0)] * 2,
    }
    tie, one = sentences(crossover(report_of(make_link_sweep(tmp_path, cells, seeds=(1, 2)))))
    assert tie.startswith(
        "At 0.1 Gbit/s, diloco and bsp tie in reaching val_acc ≥ 0.95 first (diloco 3 s and bsp 4 s"
    )
    assert "gosgd" not in tie  # its one seed that reached it does not make it first
    assert one.startswith("At 1 Gbit/s, bsp reached val_acc ≥ 0.95 first, in 1 s: 0.25× the runner-up diloco")


def test_the_crossover_plot_has_a_line_per_rule_through_its_times_and_free_links_apart(tmp_path):
    fig = crossover_figure(crossover(report_of(make_link_sweep(tmp_path))))
    axes, apart = fig.axes
    assert axes.get_xscale() == "log"
    lines = {line.get_gid(): (list(line.get_xdata()), list(line.get_ydata())) for line in axes.lines}
    assert lines["bsp"] == ([0.1, 1], [10.0, 3.0])
    assert lines["diloco"] == ([0.1, 1], [2.0, 3.5])
    assert lines["gosgd"] == ([0.1, 1], [4.0, 6.0])
    assert lines["bsp: not reached"][0] == [0.01] and lines["gosgd: not reached"][0] == [0.01]
    assert [text.get_text() for text in axes.get_legend().get_texts()][:3] == ["bsp", "diloco", "gosgd"]
    free = {line.get_gid(): list(line.get_ydata()) for line in apart.lines}
    assert free["bsp: free links"] == [1.0] and free["diloco: free links"] == [3.0]
    assert "gosgd: free links: not reached" in free and "gosgd: free links" not in free


def test_the_report_writes_the_section_and_the_plot_only_for_a_sweep_over_link_speeds(tmp_path):
    sweep = make_link_sweep(tmp_path / "links")
    report = write_report([sweep], target=0.95)
    md = (sweep / "report.md").read_text()
    assert f"## {HEADING}" in md and "- At 0.1 Gbit/s, diloco reached val_acc ≥ 0.95 first" in md
    assert "| diloco | not reached (0.9000) | 2 s (0.9620) | 3.5 s (0.9650) | 3 s (0.9600) |" in md
    assert "![crossover](crossover.png)" in md and (sweep / "crossover.png").read_bytes()[:4] == b"\x89PNG"
    assert "diloco reached val_acc" in (sweep / "report.html").read_text()
    assert md.count("## Runs") == 1 and report.target == 0.95
    other = make_sweep(tmp_path)  # rule.alpha × optim.lr: no link speeds
    assert crossover(report_of(other)) is None and HEADING not in markdown(report_of(other), [])


def test_one_link_speed_or_no_target_is_no_crossover(tmp_path):
    cells = {k: v for k, v in CELLS.items() if k[1] == 0.1}
    assert crossover(report_of(make_link_sweep(tmp_path, cells))) is None
    report = report_of(make_link_sweep(tmp_path / "all"))
    report.target = None
    assert crossover(report) is None
    assert HEADING not in markdown(report, [])


def test_a_rule_whose_run_failed_did_not_reach_the_target_and_its_cell_says_so(tmp_path):
    sweep = make_link_sweep(tmp_path)
    failed = next(p for p in sweep.iterdir() if "- rule=diloco\n- simulate.link_gbps=0.1\n" in _overrides(p))
    body = json.loads((failed / "summary.json").read_text())
    (failed / "summary.json").write_text(json.dumps({**body, "status": "failed", "error": "rank 1 died"}))
    cross = crossover(report_of(sweep))
    assert sentences(cross)[1].startswith("At 0.1 Gbit/s, gosgd reached val_acc ≥ 0.95 first, in 4 s: 0.4× ")
    header, rows = grid(cross)
    assert header[2] == "0.1 Gbit/s: time to target (final val_acc)"
    assert rows[1][:3] == ["diloco", "not reached (0.9000)", "no run ok (failed)"]


def _overrides(run: Path) -> str:
    return (run / ".hydra" / "overrides.yaml").read_text() if run.is_dir() else ""


def test_the_headline_and_the_console_line_answer_what_the_sweep_varied(tmp_path):
    """Over link speeds the report's first line and the console's give the first to the target at each
    speed, before the best by accuracy; lines that do not cross say so."""
    from runner.report.table import verdict_line

    report = report_of(make_link_sweep(tmp_path / "a"))
    first = markdown(report, []).splitlines()[2]
    assert first.startswith(
        "**First to val_acc ≥ 0.95, by link speed: 0.01 Gbit/s: none reached it; 0.1 Gbit/s:"
    )
    assert "1 Gbit/s: a tie of bsp and diloco; free links: bsp**" in first, first
    assert "(no crossover in this range)" in first
    assert "By best val_acc: best run: rule=bsp" in markdown(report, [])
    assert verdict_line(report) == (
        "first to val_acc ≥ 0.95 by link speed: 0.01 Gbit/s none, 0.1 Gbit/s diloco, 1 Gbit/s bsp=diloco, "
        "free links bsp"
    )
    cross = crossover(report)
    assert section(cross)[-1].startswith("No crossover in this range: diloco reached")
    crossing = {**CELLS, ("diloco", 1): ([LOW] * 8 + [HIGH], 0.5)}  # bsp alone first at 1 Gbit/s
    other = report_of(make_link_sweep(tmp_path / "b", crossing))
    assert "(the lines cross)" in markdown(other, []).splitlines()[2]
    assert not any(s.startswith("No crossover") for s in section(crossover(other)))
    one_speed = {k: v for k, v in CELLS.items() if k[1] in (0.1, None)}  # one emulated speed and free links
    alone = markdown(report_of(make_link_sweep(tmp_path / "c", one_speed)), []).splitlines()[2]
    assert "(the target was reached at fewer than two emulated link speeds: no crossover to tell)" in alone


def test_the_wall_time_caveat_stands_by_the_times_to_target_where_loads_differed(tmp_path):
    sweep = make_link_sweep(tmp_path)
    for n, run in enumerate(sorted(p for p in sweep.iterdir() if p.is_dir())):
        summary = json.loads((run / "summary.json").read_text())
        summary["load"] = {"start": 0.1 + 3.0 * (n % 2), "end": 1.0, "cpus": 2}
        (run / "summary.json").write_text(json.dumps(summary))
    text = markdown(report_of(sweep), [])
    section = text.split(f"## {HEADING}", 1)[1].split("## Runs", 1)[0]
    assert "Wall times were taken under" in section, section


@pytest.mark.slow
def test_no_warning_for_the_free_links_point_the_command_asked_for(cli):
    """``simulate.link_gbps=null`` given (the network sweep's point without links) is what was asked: no
    warning; ``simulate.ranks_per_node`` alone still gets it."""
    asked = cli("simulate.ranks_per_node=1", "simulate.link_gbps=null", "train.max_steps=2", "devices=1")
    assert asked.returncode == 0, asked.output
    assert "no link is emulated" not in asked.output
    forgotten = cli("simulate.ranks_per_node=1", "train.max_steps=2", "devices=1")
    assert forgotten.returncode == 0 and "no link is emulated" in forgotten.output, forgotten.output


def test_a_link_per_node_is_a_network_of_its_own_named_by_its_links_and_ordered_by_the_slowest(tmp_path):
    """One node at 50 Mbit/s beside three at 1 Gbit/s: not free links, not 1 Gbit/s; its sentence names
    each node's link, it comes between 0.01 and 0.1 Gbit/s (its slowest), and the plot's bandwidth axis
    leaves it out."""
    one_slow = (1.0, 1.0, 1.0, 0.05)
    cells = {k: v for k, v in CELLS.items() if k[1] in (0.01, 0.1)}
    cells |= {("bsp", one_slow): ([LOW] * 6 + [HIGH], 1.0), ("diloco", one_slow): ([LOW, HIGH], 1.0)}
    cross = crossover(report_of(make_link_sweep(tmp_path, cells)))
    assert cross.speeds == [0.01, one_slow, 0.1]
    said = sentences(cross)[1]
    assert said.startswith("At 1/1/1/0.05 Gbit/s by node") and "diloco" in said, said
    figure = crossover_figure(cross)
    assert [t.get_text() for t in figure.axes[0].get_xticklabels()] == ["0.01", "0.1"]


def test_a_tie_of_rules_that_reached_the_target_at_their_first_validation_says_to_validate_more(tmp_path):
    """diloco 1.75 s and bsp 9.55 s tie by the noise rule (bsp's crossing lies anywhere in its first 9.55
    s); the sentence says the validations came too late to tell, and the fix."""
    cells = {("bsp", 0.1): ([HIGH], 9.55), ("diloco", 0.1): ([HIGH], 1.75)}
    cells |= {("bsp", 1): ([LOW, HIGH], 1.0), ("diloco", 1): ([LOW, HIGH], 0.9)}
    said = sentences(crossover(report_of(make_link_sweep(tmp_path, cells))))
    assert "diloco and bsp reaching it at their first validation: too few validations" in said[0], said[0]
    assert "train.val_every=0.25" in said[0] and "first validation" not in said[1], said[1]


def test_a_sweep_over_kinds_of_network_gets_a_sentence_per_network(tmp_path):
    """``network=lan,internet,one_slow_node``: the report's axis is the network, named by its option and
    ordered by its slowest link (from each run's config); no bandwidth plot."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    task = ["rule=bsp,diloco", "network=lan,internet,one_slow_node"]
    (sweep / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": task}}}))
    links = {"lan": 10.0, "internet": 0.1, "one_slow_node": [0.05, 1.0]}
    times = {"bsp": {"lan": 1.0, "internet": 9.0, "one_slow_node": 8.0}}
    times["diloco"] = {"lan": 4.0, "internet": 2.0, "one_slow_node": 2.0}
    for n, (rule, net) in enumerate((r, k) for r in ("bsp", "diloco") for k in links):
        make_run(sweep / str(n), [f"rule={rule}", f"network={net}"], [LOW, HIGH], times[rule][net] / 2)
        config = {"simulate": {"ranks_per_node": 1, "link_gbps": links[net]}}
        (sweep / str(n) / "config.yaml").write_text(json.dumps(config))
    report = report_of(sweep)
    cross = crossover(report)
    assert cross.speeds == ["network=one_slow_node", "network=internet", "network=lan"], cross.speeds
    said = sentences(cross)
    assert said[0].startswith("At network=one_slow_node, diloco reached val_acc ≥ 0.95 first"), said
    assert said[2].startswith("At network=lan, bsp reached"), said
    from runner.report.plots import figures

    assert figures(report).get("crossover") is None
    assert summary_line(cross).startswith("first to val_acc ≥ 0.95 by network: network=one_slow_node diloco")
    from runner.report.network import NETWORK_HEADING
    from runner.report.table import markdown

    assert f"## {NETWORK_HEADING}" in markdown(report, [])


def test_a_sweep_over_latency_gets_a_sentence_per_latency_and_the_plot_over_it(tmp_path):
    """``simulate.link_latency_ms=0.05,20,100`` at one bandwidth: the axis is the latency, the longest
    first; DiLoCo (few exchanges) wins at 100 ms, BSP (an exchange a step) at 0.05 ms; the crossover plot is
    drawn against latency."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    task = ["rule=bsp,diloco", "simulate.link_latency_ms=0.05,20,100", "simulate.link_gbps=1"]
    task += ["simulate.ranks_per_node=1"]
    (sweep / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": task}}}))
    times = {"bsp": {0.05: 1.0, 20: 4.0, 100: 12.0}, "diloco": {0.05: 3.0, 20: 3.2, 100: 3.5}}
    n = 0
    for rule, by_ms in times.items():
        for ms, seconds in by_ms.items():
            overrides = [f"rule={rule}", f"simulate.link_latency_ms={ms}", "simulate.link_gbps=1"]
            make_run(sweep / str(n), [*overrides, "simulate.ranks_per_node=1"], [LOW, HIGH], seconds / 2)
            n += 1
    report = report_of(sweep)
    cross = crossover(report)
    assert [str(g) for g in cross.speeds] == ["100 ms latency", "20 ms latency", "0.05 ms latency"]
    said = sentences(cross)
    assert said[0].startswith("At 100 ms latency, diloco reached val_acc ≥ 0.95 first"), said
    assert said[2].startswith("At 0.05 ms latency, bsp reached"), said
    assert summary_line(cross).startswith("first to val_acc ≥ 0.95 by link latency: 100 ms latency diloco")
    from runner.report.network import LATENCY_HEADING
    from runner.report.plots import figures

    assert f"## {LATENCY_HEADING}" in markdown(report, [])
    fig = figures(report)["crossover"]
    assert fig is not None and "latency" in fig.axes[0].get_xlabel()
    assert sorted(fig.axes[0].get_xticks()) == [0.05, 20, 100]


def test_a_sweep_over_speed_and_latency_keeps_each_latency_a_series_of_its_own(tmp_path):
    """With link speed the axis, the latency the sweep also varied is part of the series (two runs at one
    speed are two cells, not one kept and one dropped)."""
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    task = [
        "rule=bsp",
        "simulate.link_gbps=0.1,1",
        "simulate.link_latency_ms=0.05,40",
        "simulate.ranks_per_node=1",
    ]
    (sweep / "multirun.yaml").write_text(json.dumps({"hydra": {"overrides": {"task": task}}}))
    for n, (gbps, ms) in enumerate((g, m) for g in (0.1, 1) for m in (0.05, 40)):
        overrides = [
            "rule=bsp",
            f"{LINK}={gbps}",
            f"simulate.link_latency_ms={ms}",
            "simulate.ranks_per_node=1",
        ]
        make_run(sweep / str(n), overrides, [LOW, HIGH], 1.0 + ms / 10)
    cross = crossover(report_of(sweep))
    assert sorted(cross.series) == ["simulate.link_latency_ms=0.05", "simulate.link_latency_ms=40"], (
        cross.series
    )
    assert len(cross.cells) == 4
