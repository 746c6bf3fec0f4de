"""Every rule trains the CNN on digits with 4 workers from the command line; a sweep over EASGD's keys."""

from __future__ import annotations

import json

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.mpi]


@pytest.mark.parametrize("rule", ["bsp", "easgd", "gosgd", "asgd"])
def test_rule_trains_the_cnn_on_digits_with_4_workers(cli, rule):
    run = cli(f"rule={rule}", "devices=4", "hardware.oversubscribe=true", timeout=300)
    assert run.returncode == 0, run.output
    s = run.summary
    assert s["final_val_acc"] >= 0.93, f"{rule}: {s['final_val_acc']:.4f}"
    assert s["devices"] == 4 and s["rule"] == rule
    assert s["world_size"] == 4 + (1 if rule == "asgd" else 0)


def test_easgd_sweep_one_folder_per_combination(cli):
    run = cli(
        "rule=easgd", "rule.alpha=0.1,0.5", "optim.lr=0.01,0.05", "train.epochs=1", multirun=True, timeout=300
    )
    assert run.returncode == 0, run.output
    combos = set()
    for job in range(4):
        summary = json.loads((run.dir / str(job) / "summary.json").read_text())
        assert summary["status"] == "ok" and summary["rule"] == "easgd"
        config = (run.dir / str(job) / "config.yaml").read_text()
        combos.add((config.split("alpha: ")[1].split()[0], config.split("lr: ")[1].split()[0]))
    assert combos == {("0.1", "0.01"), ("0.1", "0.05"), ("0.5", "0.01"), ("0.5", "0.05")}
