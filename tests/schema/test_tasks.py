"""Tasks (loss, metrics, checks of the first batch), classes given by ``_target_``, ``train.monitor``,
``train.precision``, and early stopping's decision: in-process, in milliseconds."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from runner.rank.loop import grouped
from runner.results import final_and_best, no_improvement
from runner.schema.target import Target
from runner.tasks import maximized
from runner.tasks.classification import ClassificationConfig
from runner.tasks.language_model import LanguageModelConfig
from runner.tasks.regression import RegressionConfig
from tests.conftest import checked_config


def totals(task, batches) -> dict[str, float]:
    """The task's metrics over ``batches`` of (outputs, targets), as validation adds them up."""
    sums = torch.zeros(task.width, dtype=torch.float64)
    for out, y in batches:
        sums += torch.stack([s.double() for s in task.sums(out, y)])
    return task.results(sums.tolist())


def test_classification_metrics_are_the_means_over_all_batches():
    torch.manual_seed(0)
    batches = [(torch.randn(n, 8), torch.randint(0, 8, (n,))) for n in (5, 7, 3)]
    got = totals(ClassificationConfig().build(8), batches)
    out, y = torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches])
    assert got["loss"] == pytest.approx(F.cross_entropy(out, y).item(), rel=1e-6)
    assert got["acc"] == pytest.approx((out.argmax(1) == y).float().mean().item())
    top5 = sum(int(t in row) for t, row in zip(y.tolist(), out.topk(5, 1).indices.tolist(), strict=True))
    assert got["top5"] == pytest.approx(top5 / len(y)) and got["top5"] >= got["acc"]
    assert "top5" not in totals(ClassificationConfig().build(4), [(torch.randn(6, 4), torch.arange(6) % 4)])


def test_classification_refuses_float_targets_and_labels_beyond_the_outputs():
    task = ClassificationConfig().build(3)
    with pytest.raises(ValueError, match="integer class labels.*float32.*task=regression"):
        task.check(torch.randn(4, 3), torch.randn(4))
    with pytest.raises(ValueError, match="labels 0..7 but the model outputs 3 classes.*model.num_classes"):
        task.check(torch.randn(4, 3), torch.tensor([0, 1, 2, 7]))
    with pytest.raises(ValueError, match=r"outputs \[batch, classes, ...\]"):
        task.check(torch.randn(4), torch.tensor([0, 1, 2, 1]))
    task.check(torch.randn(4, 3), torch.tensor([0, 1, 2, 1]))


def test_regression_mse_and_mae_and_its_refusals():
    out, y = torch.randn(10, 2), torch.randn(10, 2)
    got = totals(RegressionConfig().build(), [(out[:4], y[:4]), (out[4:], y[4:])])
    assert got["loss"] == pytest.approx(F.mse_loss(out, y).item(), rel=1e-6)
    assert got["mae"] == pytest.approx((out - y).abs().mean().item(), rel=1e-6)
    task = RegressionConfig().build()
    with pytest.raises(ValueError, match=r"shaped like the targets.*\[10, 1\].*\[10\]"):
        task.check(torch.randn(10, 1), torch.randn(10))  # MSE would broadcast to [10, 10]
    with pytest.raises(ValueError, match="real-valued targets.*int64.*task=classification"):
        task.check(torch.randn(10), torch.arange(10))


def test_language_model_perplexity_is_exp_of_the_token_loss_without_padding():
    torch.manual_seed(1)
    out, y = torch.randn(3, 5, 11), torch.randint(0, 11, (3, 5))
    y[0, 3:] = -100  # padding
    got = totals(LanguageModelConfig().build(), [(out[:1], y[:1]), (out[1:], y[1:])])
    keep = y != -100
    nll = F.cross_entropy(out[keep], y[keep])
    assert got["loss"] == pytest.approx(nll.item(), rel=1e-6)
    assert got["ppl"] == pytest.approx(math.exp(nll.item()), rel=1e-6)
    assert got["acc"] == pytest.approx((out[keep].argmax(1) == y[keep]).float().mean().item())
    with pytest.raises(ValueError, match=r"outputs \[batch, time, vocabulary\]"):
        LanguageModelConfig().build().check(torch.randn(3, 11), torch.randint(0, 11, (3,)))


def test_a_loss_given_by_its_class_replaces_the_tasks_own():
    cfg = checked_config(["task=regression", "task.loss={_target_: torch.nn.HuberLoss, delta: 0.5}"])
    assert isinstance(cfg.task.loss, Target) and cfg.task.loss.path == "torch.nn.HuberLoss"
    task = cfg.task.build()
    out, y = torch.randn(6) * 3, torch.randn(6)
    assert torch.equal(task.loss(out, y), F.huber_loss(out, y, delta=0.5))
    with pytest.raises(ValueError, match="task.loss._target_=nowhere.Loss: no module 'nowhere'"):
        checked_config(["task.loss={_target_: nowhere.Loss}"])
    with pytest.raises(
        ValueError, match=r"task.loss._target_=torch.nn.HuberLoss cannot be called.*task.loss.dlta"
    ):
        checked_config(["task.loss={_target_: torch.nn.HuberLoss, dlta: 0.5}"]).task.build()


def test_a_model_and_an_optimizer_given_by_their_class():
    cfg = checked_config(
        ["model=custom", "model._target_=torch.nn.Linear", "+model.in_features=64", "+model.out_features=10"]
        + ["optim=custom", "optim._target_=torch.optim.RMSprop", "+optim.lr=0.01", "+optim.alpha=0.9"]
    )
    model = cfg.model.build()
    assert isinstance(model, torch.nn.Linear) and model.weight.shape == (10, 64)
    optimizer = cfg.optim.build(model.parameters())
    assert isinstance(optimizer, torch.optim.RMSprop) and optimizer.defaults["alpha"] == 0.9
    with pytest.raises(
        ValueError, match="optim._target_=torch.optim.RMSprop cannot be called.*optim.momentm"
    ):
        checked_config(
            ["optim=custom", "optim._target_=torch.optim.RMSprop", "+optim.momentm=0.9"]
        ).optim.build(model.parameters())
    with pytest.raises(ValueError, match="model._target_=torch.nn.Linr: torch.nn has no 'Linr'"):
        checked_config(["model=custom", "model._target_=torch.nn.Linr"]).model.build()
    with pytest.raises(ValueError, match="model._target_: no value given"):
        checked_config(["model=custom"])
    with pytest.raises(ValueError, match="model=custom model._target_="):
        checked_config(["+model._target_=torch.nn.Linear"])  # the CNN's keys would come along


def test_an_argument_given_by_its_class_is_built_first_and_checked_before_launch():
    """A model's module argument as a node with its own ``_target_``, in a dict and in a list too."""
    linear = ["model=custom", "model._target_=torch.nn.Sequential"]
    cfg = checked_config(
        ["model=custom", "model._target_=torch.nn.TransformerEncoderLayer", "+model.d_model=8"]
        + ["+model.nhead=2", "+model.activation={_target_: torch.nn.GELU, approximate: tanh}"]
    )
    layer = cfg.model.build()
    assert isinstance(layer.activation, torch.nn.GELU) and layer.activation.approximate == "tanh"
    sizes = Target.of("x", {"_target_": "builtins.dict", "parts": [1, {"_target_": "fractions.Fraction"}]})
    assert sizes.build() == {"parts": [1, 0]}
    with pytest.raises(ValueError, match=r"model\.activation\._target_=nowhere\.Act: no module 'nowhere'"):
        checked_config([*linear, "+model.activation={_target_: nowhere.Act}"])
    modules = [
        "model=custom",
        "model._target_=torch.nn.ModuleList",
        "+model.modules=[{_target_: torch.nn.ReLU}]",
    ]
    assert isinstance(checked_config(modules).model.build()[0], torch.nn.ReLU)
    typo = checked_config(
        [*modules[:2], "+model.modules=[{_target_: torch.nn.ReLU}, {_target_: torch.nn.Relu}]"]
    )
    with pytest.raises(ValueError, match=r"model\.modules\.1\._target_=torch\.nn\.Relu: torch\.nn has no"):
        typo.model.build()  # its module exists (checked before launch); the rank looks the class up
    with pytest.raises(ValueError, match=r"model\._partial_ is not supported.*~model\._partial_"):
        checked_config([*linear, "+model._partial_=true"])


def test_monitor_must_be_a_metric_of_the_task_and_fp16_a_gpu_job():
    assert checked_config(["task=regression", "train.monitor=val_mae"]).train.monitor == "val_mae"
    with pytest.raises(ValueError, match="train.monitor='val_mae'.*classification reports val_acc, val_loss"):
        checked_config(["train.monitor=val_mae"])
    with pytest.raises(ValueError, match="train.precision='fp16'.*needs a GPU.*bf16"):
        checked_config(["train.precision=fp16"])
    assert checked_config(["train.precision=bf16"]).train.precision == "bf16"
    for key, value in [("accumulate", 0), ("grad_clip", 0.0), ("early_stop", 0), ("precision", "fp8")]:
        with pytest.raises(ValueError, match=f"train.{key}={value!r} is invalid"):
            checked_config([f"train.{key}={value}"])
    assert maximized("val_acc") and maximized("center_val_top5") and not maximized("val_ppl")


@pytest.mark.parametrize(
    "monitor,values,patience,stop",
    [
        ("val_acc", [0.5, 0.6, 0.6], 1, True),  # equal is no improvement
        ("val_acc", [0.5, 0.6, 0.7], 1, False),
        ("val_acc", [0.5, 0.9, 0.8, 0.85], 2, True),
        ("val_acc", [0.5, 0.9, 0.8], 2, False),  # not yet `patience` validations after the best
        ("val_loss", [1.0, 0.8, 0.9, 0.85], 2, True),
        ("val_loss", [1.0, 0.8, 0.9, 0.7], 2, False),
    ],
)
def test_early_stop_after_patience_validations_without_improvement(monitor, values, patience, stop):
    history = [{monitor: v, "worker_mean_" + monitor: 0.0} for v in values]
    assert no_improvement(history, monitor, patience) is stop
    assert no_improvement(history, monitor, None) is False


def test_summary_keeps_the_final_and_best_of_every_metric_of_the_reported_model():
    history = [
        {"val_loss": 0.5, "val_acc": 0.8, "worker_mean_val_acc": 0.7},
        {"val_loss": 0.6, "val_acc": 0.9},
    ]
    got = final_and_best(history)
    assert got == {
        "final_val_loss": 0.6,
        "best_val_loss": 0.5,
        "final_val_acc": 0.9,
        "best_val_acc": 0.9,
    }
    assert final_and_best([]) == dict.fromkeys(
        ("final_val_acc", "final_val_loss", "best_val_acc", "best_val_loss")
    )


def test_micro_batches_are_grouped_and_an_incomplete_group_dropped():
    assert list(grouped(range(7), 3)) == [[0, 1, 2], [3, 4, 5]]
    assert list(grouped(range(2), 1)) == [[0], [1]]


def test_padding_only_float64_targets_and_an_unknown_class_count_are_handled():
    lm = LanguageModelConfig().build()
    out = torch.randn(2, 3, 5, requires_grad=True)
    loss = lm.loss(out, torch.full((2, 3), -100))  # a micro-batch of padding only: no NaN to stop the run
    assert loss.item() == 0.0
    loss.backward()
    huber = checked_config(["task=regression", "task.loss={_target_: torch.nn.HuberLoss}"]).task.build()
    out, y = torch.randn(4, 2, requires_grad=True), torch.randn(4, 2, dtype=torch.float64)  # numpy's float64
    huber.loss(out, y).backward()
    assert out.grad is not None and out.grad.dtype == torch.float32
    unknown = ClassificationConfig().build(None)
    assert "top5" not in totals(unknown, [(torch.randn(6, 9), torch.arange(6))])
    assert ClassificationConfig().metrics(None) == ("acc", "loss")
