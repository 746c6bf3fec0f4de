"""Every rule trains the CNN on digits with 4 workers from the command line (a sweep over EASGD's keys:
tests/report/test_report.py). DiLoCo's defaults are held to 97% (its issue's bar; measured 0.98-1.00 over
seeds)."""

from __future__ import annotations

import pytest

from tests.helpers.rules import needs, per_rule, rules

pytestmark = [pytest.mark.slow, pytest.mark.mpi]


#: Epochs (and options) per rule, for the rules tests/helpers/rules.py discovers; a rule not named here trains
#: 5 epochs with its defaults and must pass 0.93 on as many ranks as workers. The synchronous rules pass 0.95
#: by their 4th (measured). The asynchronous ones swing from epoch to epoch at a constant rate (ASGD's stale
#: updates between 0.80 and 0.99, 0.86 after 10 epochs in one full run; GoSGD's 5th epoch 0.939-0.953 in 4
#: runs, against the bar of 0.93), so they decay it: with a cosine schedule ASGD ended at 0.994 in 3 of 3 runs
#: of 8 epochs, GoSGD at 0.969-0.972 in 3 runs of 5. DiLoCo needs its rounds.
EPOCHS = per_rule({"asgd": 8, "diloco": 10, "async_diloco": 10}, default=5)
COSINE = per_rule({"asgd": ["schedule=cosine"], "gosgd": ["schedule=cosine"]}, default=[])
EXTRA = {rule: [*needs(rule), *extra] for rule, extra in COSINE.items()}
BAR = per_rule({"diloco": 0.97}, default=0.93)
SERVERS = per_rule({"asgd": 1, "async_diloco": 1}, default=0)  # ranks beside the 4 workers


@pytest.mark.parametrize("rule", rules())
def test_rule_trains_the_cnn_on_digits_with_4_workers(cli, rule):
    run = cli(
        f"rule={rule}",
        "devices=4",
        "hardware.oversubscribe=true",
        f"train.epochs={EPOCHS[rule]}",
        *EXTRA[rule],
        timeout=300,
    )
    assert run.returncode == 0, run.output
    s = run.summary
    assert s["final_val_acc"] >= BAR[rule], f"{rule}: {s['final_val_acc']:.4f}"
    assert s["devices"] == 4 and s["rule"] == rule
    assert s["world_size"] == 4 + SERVERS[rule]
