"""The run's results as a worker reports them (``summary.json``'s training fields)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from runner.results import final_and_best

if TYPE_CHECKING:
    from runner.comm.face import CommLike
    from runner.rank.guard import Guard
    from runner.rank.records.meter import Meter


@dataclass
class Outcome:
    """What the loop ends with.

    The validations (``history``, the reported model's under ``prefix``), the metric the run reports
    (``monitor``), the epoch after which early stopping ended training (None: it did not), whether the loss
    was scaled (fp16: overflowed steps are counted), and the items a validation counts (``val_count``:
    samples, tokens for a language model; None before the first validation)."""

    history: list[dict[str, float]]
    prefix: str
    monitor: str
    stopped_early: int | None
    fp16: bool
    val_count: float | None = None
    val_bytes: float = 0.0  # bytes this worker sent validating (the rule's models made, the sums)
    #: This worker's seconds in each part of the control plane (agreement, deal, heartbeat), and its
    #: part of the last checkpoint.
    control_s: dict[str, float] = field(default_factory=dict)
    checkpoint_s: float = 0.0


def summary(
    outcome: Outcome, epochs: int, steps: int, meter: Meter, guard: Guard, workers: CommLike
) -> dict[str, Any]:
    """Collective over the workers: the run's results.

    Validation results are None when it was preempted before its first; rates are this worker's, samples
    per second and bytes sent all workers'."""
    rates = meter.total.rates(workers.size)
    own = meter.total.samples / max(meter.total.total, 1e-12)  # this worker's samples/s
    rates["samples_per_s"] = workers.allreduce_values([own])[0]  # all workers' (unequal: dynamic)
    per_sample = meter.tokens_per_sample
    tokens = {}
    if per_sample:  # a language model: tokens/s and the tokens trained on, all workers'
        seen = meter.job_samples + workers.allreduce_values([meter.new_samples()])[0]  # (lost, joined)
        tokens = {"tokens_per_s": rates["samples_per_s"] * per_sample, "tokens": seen * per_sample}
    return {
        "epochs": epochs,
        "steps": steps,
        "monitor": outcome.monitor,
        **final_and_best(outcome.history, outcome.prefix),
        "stopped_early_after_epoch": outcome.stopped_early,
        "fp16_overflow_steps": guard.overflows if outcome.fp16 else None,
        "samples_per_s": rates["samples_per_s"],
        **tokens,
        "comm_fraction": rates["comm_frac"],
        "emulated_comm_s": meter.total.emulated,  # of the steps' communication, waits on emulated links
        "data_wait_fraction": rates["data_frac"],
        "compute_fraction": rates["compute_frac"],
        "bytes_sent": workers.allreduce_values([workers.stats.bytes_sent])[0],
        "bytes_sent_validating": workers.allreduce_values([outcome.val_bytes])[0],  # (in bytes_sent)
        "steps_per_worker": workers.allgather_object(steps),  # dynamic assignment: unequal
        "skipped_steps": guard.skipped,
        "validations": outcome.history,
        "val_count": outcome.val_count,  # one validation sample is 1/val_count of an accuracy (the report)
        **control(outcome, steps, workers),
    }


def control(outcome: Outcome, steps: int, workers: CommLike) -> dict[str, Any]:
    """Collective over the workers: what the control plane cost.

    Milliseconds per step in each of its parts (the workers' mean; the heartbeat's are spent on its own
    thread), and the last checkpoint's seconds (the slowest worker's: the job waits for it)."""
    parts = sorted(outcome.control_s)
    per_step = [1000 * outcome.control_s[p] / max(steps, 1) for p in parts]
    means = workers.allreduce_values(per_step) if parts else []
    slowest = workers.allreduce_values([outcome.checkpoint_s], op="max")[0]
    return {
        "control_ms_per_step": {p: m / workers.size for p, m in zip(parts, means, strict=True)},
        "checkpoint_s": slowest,
    }
