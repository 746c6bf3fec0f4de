"""Training options end to end, in real mpirun jobs: gradient accumulation, clipping, optimizers with a
learning-rate schedule, bf16, early stopping, and evaluating a saved model."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tests.conftest import COMMON, ROOT, STEPS, assert_close, params_of, reference_params

pytestmark = [pytest.mark.slow, pytest.mark.mpi]

BATCH = 8


def test_accumulated_steps_equal_one_process_with_n_times_k_times_the_batch(cli):
    """2 ranks × 2 micro-batches × 8 = one process with batch 32, to 1e-5; the buckets' all-reduce runs on
    the communication thread during backward, which must wait for the last micro-batch."""
    overrides = ["model=mlp", *COMMON]
    run = cli(
        "devices=2",
        f"train.batch_size={BATCH}",
        "train.accumulate=2",
        "train.save_model=all",
        "rule.overlap=thread",
        "rule.bucket_mb=0.01",
        *overrides,
    )
    assert run.returncode == 0, run.output
    ref = reference_params(2 * 2 * BATCH, overrides)
    one_batch = reference_params(2 * BATCH, overrides)
    assert max((ref[k] - one_batch[k]).abs().max().item() for k in ref) > 1e-4, "the batches must differ"
    for r in range(2):
        assert_close(params_of(run.dir / f"model.rank{r}.pt"), ref)
    assert run.summary["steps"] == STEPS


def test_clipping_applies_to_the_averaged_gradient_identically_on_every_rank(cli):
    overrides = ["model=mlp", *COMMON]
    run = cli(
        "devices=2", f"train.batch_size={BATCH}", "train.grad_clip=0.05", "train.save_model=all", *overrides
    )
    assert run.returncode == 0, run.output
    ref, unclipped = reference_params(2 * BATCH, overrides, clip=0.05), reference_params(2 * BATCH, overrides)
    assert max((ref[k] - unclipped[k]).abs().max().item() for k in ref) > 1e-3, "clipping must act here"
    ranks = [params_of(run.dir / f"model.rank{r}.pt") for r in range(2)]
    assert all((ranks[0][k] == ranks[1][k]).all() for k in ranks[0]), "ranks must stay bit-identical"
    assert_close(ranks[0], ref)


# Two rules, not each rule: a test of the optimizer and the schedule, whose rate the loop sets whatever the
# rule (each rule trains in tests/rules/test_rules_train.py). BSP (gradients averaged before the step) and
# EASGD (local steps between exchanges) stand for the two kinds of rule; each job is 4 epochs of mpirun.
@pytest.mark.parametrize("rule", ["bsp", "easgd"])
def test_adamw_with_a_cosine_schedule_and_warmup_trains_at_the_formulas_rate(cli, rule):
    run = cli(
        f"rule={rule}",
        "optim=adamw",
        "optim.lr=0.01",
        "schedule=cosine",
        "schedule.warmup_steps=50",
        "train.epochs=4",
        "train.log_every=1",
    )
    assert run.returncode == 0, run.output
    total, warmup = run.summary["steps"], 50
    assert total == 4 * 23

    def rate(s: int) -> float:  # the rate of the step after s steps
        if s < warmup:
            return 0.01 * s / warmup
        return 0.01 * (1 + math.cos(math.pi * (s - warmup) / (total - warmup))) / 2

    steps = run.records("step")
    assert [r["step"] for r in steps] == list(range(1, total + 1))
    for r in steps:
        assert r["lr"] == pytest.approx(rate(r["step"] - 1), rel=1e-9, abs=1e-15), r["step"]
    assert run.summary["final_val_acc"] >= 0.93


def test_bf16_on_the_cpu_trains_the_default_job(cli):
    """The default job in bf16 autocast, 3 of its 10 epochs (bf16 convolutions are slow on CPUs without
    bf16 units: 9× the fp32 step here); the whole job reached 0.989."""
    run = cli("train.precision=bf16", "train.epochs=3")
    assert run.returncode == 0, run.output
    assert run.summary["final_val_acc"] >= 0.95


def test_early_stop_ends_training_and_eval_of_the_saved_model_gives_its_final_metrics(cli, tmp_path):
    """With a zero learning rate the validation loss never changes: patience 2 stops after epoch 2. Then
    ``eval=RUN_DIR``, from another folder, on the model the run saved."""
    run = cli("optim.lr=0", "train.epochs=10", "train.monitor=val_loss", "train.early_stop=2")
    assert run.returncode == 0, run.output
    s = run.summary
    assert s["status"] == "ok" and s["stopped_early_after_epoch"] == 2 and len(s["validations"]) == 3
    assert s["steps"] == 3 * 23 and s["monitor"] == "val_loss"
    assert "early stop after epoch 2: val_loss did not improve in the last 2 validations" in run.output

    argv = [sys.executable, "-m", "runner", f"eval={run.dir}"]
    done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    record = json.loads((run.dir / "eval.json").read_text())
    for key in ("val_loss", "val_acc", "val_top5"):
        assert record[key] == pytest.approx(s[f"final_{key}"], abs=1e-6), key
    assert f"val_loss {record['val_loss']:.4f}" in done.stdout
    missing = subprocess.run(
        [*argv[:3], f"eval={tmp_path / 'nothing'}"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "config.yaml" in missing.stderr + missing.stdout


def test_a_language_model_learns_next_tokens_to_a_perplexity_near_one(cli):
    run = cli(
        "data=dataset",
        "data.train._target_=tests.helpers.tiny_lm.Counting",
        "model=custom",
        "model._target_=tests.helpers.tiny_lm.NextToken",
        "task=language_model",
        "optim=adam",
        "optim.lr=0.05",
        "train.epochs=3",
    )
    assert run.returncode == 0, run.output
    s = run.summary
    assert s["monitor"] == "val_loss" and s["model"] == "tests.helpers.tiny_lm.NextToken"
    assert s["final_val_ppl"] < 1.2 and s["final_val_acc"] > 0.98, s["validations"]
    assert s["final_val_ppl"] == pytest.approx(math.exp(s["final_val_loss"]))
