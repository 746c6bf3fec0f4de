"""A classifier that ends at chance after having been well above it ends ``diverged`` (exit 3), its best and
final accuracy named (``train.collapse_margin``; issue 37, item 8): EASGD with ``rule.alpha=0.9`` and
``optim.lr=0.1`` on digits fell from 0.60 to 0.19 validation accuracy in 3 epochs (chance 0.10, loss 6.5
above ln 10) and ended ``ok``, exit 0, as its loss never reached ``train.diverge_at`` times its first."""

from __future__ import annotations

import pytest

from runner.rank.guard import fell_to_chance
from runner.schema.sections import TrainConfig
from tests.conftest import run_cli


def vals(*pairs: tuple[float, float], prefix: str = "") -> list[dict[str, float]]:
    return [{f"{prefix}val_acc": acc, f"{prefix}val_loss": loss} for acc, loss in pairs]


def test_the_easgd_collapse_is_named_with_its_best_and_final_accuracy():
    history = vals((0.60, 1.0927), (0.1778, 7.0150), (0.1944, 6.4834), prefix="center_")
    why = fell_to_chance(history, "center_", 10, 0.15)
    assert why is not None and "fell from 0.6 (its best) to 0.1944, near chance (0.1" in why, why
    assert "validation loss 6.483 (chance level ln 10 = 2.3)" in why and "train.collapse_margin=null" in why


@pytest.mark.parametrize(
    "history, classes, margin",
    [
        (vals((0.5, 1.5), (0.9, 0.4), (0.95, 0.2)), 10, 0.15),  # healthy
        (vals((0.9, 0.4), (0.97, 0.2), (0.95, 2.6)), 10, 0.15),  # overfits: loss above ln 10, accuracy high
        (vals((0.11, 2.3), (0.14, 2.29), (0.1, 2.31)), 10, 0.15),  # never above chance: not a collapse
        (vals((0.9, 0.4)), 10, 0.15),  # one validation
        (vals((0.6, 1.1), (0.19, 6.5)), None, 0.15),  # classes not known
        (vals((0.6, 1.1), (0.19, 6.5)), 10, None),  # the check turned off
        ([{"val_loss": 0.5}, {"val_loss": 9.0}], 10, 0.15),  # no accuracy (regression)
        (vals((0.9, 0.3), (0.62, 0.66)), 2, 0.15),  # two classes: 0.62 is not within 0.575 of chance
    ],
)
def test_a_run_that_did_not_collapse_to_chance_is_not_called_so(history, classes, margin):
    assert fell_to_chance(history, "", classes, margin) is None


def test_a_binary_classifier_at_chance_after_being_good_collapsed():
    assert fell_to_chance(vals((0.9, 0.3), (0.55, 0.69)), "", 2, 0.15) is not None
    assert fell_to_chance(vals((0.9, 0.3), (0.6, 0.8)), "", 2, 0.15) is not None, "loss above ln 2"


@pytest.mark.parametrize("margin", [0, 0.5, -0.1, float("nan")])
def test_the_margin_is_checked(margin):
    with pytest.raises(ValueError, match="collapse_margin"):
        TrainConfig(collapse_margin=margin)


@pytest.mark.slow
@pytest.mark.mpi
def test_easgd_that_falls_to_chance_ends_diverged_and_a_healthy_run_ends_ok(tmp_path):
    common = ["optim.lr=0.1", "devices=2", "train.epochs=3"]
    run = run_cli(tmp_path / "collapsed", *common, "rule=easgd", "rule.alpha=0.9", timeout=180)
    assert run.returncode == 3, run.output
    summary = run.summary
    assert summary["status"] == "diverged" and summary["exit_status"] == 3, summary
    assert summary["best_val_acc"] >= 0.5 and summary["final_val_acc"] <= 0.235, summary
    best, final = summary["best_val_acc"], summary["final_val_acc"]
    assert f"fell from {best:.4g} (its best) to {final:.4g}, near chance" in summary["error"], summary
    assert f"to {final:.4g}, near chance" in run.output and "Traceback" not in run.output, run.output
    healthy = run_cli(tmp_path / "healthy", *common, "rule=bsp", timeout=180)
    assert healthy.returncode == 0 and healthy.summary["status"] == "ok", healthy.output
    assert healthy.summary["final_val_acc"] > 0.9, healthy.summary
