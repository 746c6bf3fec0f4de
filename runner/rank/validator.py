"""The loop's validator: validating the rule's models, recording the results, and the collapse check on them.

Models are validated with every worker, or one worker alone, and the validator says when by time.

The loop says where a validation comes (an epoch's end, ``train.val_every`` within the epoch, a meeting of
dynamic assignment, an agreement by time); the validator does it. Under dynamic assignment, a rule that
validates alone (:attr:`~runner.rules.base.Rule.solo_validation`) lets the worker that drew a validation's
chunk validate the whole validation set while the others train on; it sends the results to worker 0
(tag ``VALIDATED``), which records them.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from runner.comm.tags import VALIDATED
from runner.rank.assignment import claim_slot
from runner.rank.guard import Diverged, collapse
from runner.rank.state import Owner
from runner.rank.validation import nonfinite_batch, validation_sums

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

    from runner.comm.face import CommLike
    from runner.rank.assignment import Dealer
    from runner.rank.guard import Guard
    from runner.rank.records.meter import Meter
    from runner.rank.records.metrics import MetricsLog
    from runner.rank.state import Position
    from runner.rules.base import Rule
    from runner.schema.sections import TrainConfig
    from runner.tasks import Task

#: Seconds a worker whose validation share is finite waits before it, too, ends the job on non-finite
#: validation data found by another worker, which names where (its error then comes first).
DATA_ERROR_GRACE_S = 2.0
#: The most validation sums such a message carries (a task's results come from a few).
SUMS_SENT = 60


class Validator(Owner):
    """Validates one worker's rule's models on ``val_loader`` and keeps the results.

    ``parts``: the model it trains, the rule, the task; ``val_loader``: this worker's share of the
    validation set. The results kept: ``history`` (every validation all workers took, which early stopping
    reads), the record prefix of the model the run reports, and the first validation loss
    (``train.diverge_at``'s reference). ``records``: the metrics log, the meter and the non-finite guard;
    ``dealer``: this worker's dealer under dynamic assignment (None: static shards)."""

    STATE = ("history", "first_val_loss", "reported_prefix", "val_asked")
    TRANSIENT = {
        **dict.fromkeys(
            ("cfg", "workers", "device", "model", "rule", "task", "log", "meter", "guard", "dealer"), "given"
        ),
        **dict.fromkeys(("val_loader", "val_share", "whole_val"), "the loaders, made anew by each job"),
        "val_count": "each validation's own count",
        "alone": "follows from the rule and the data's assignment",
        **dict.fromkeys(
            ("solo_sent", "solo_got", "solo_seen"), "an epoch's validations alone, emptied at its end"
        ),
        "val_bytes": "this job's traffic, as the other byte counts are",
    }

    def __init__(
        self,
        cfg: TrainConfig,
        parts: tuple[nn.Module, Rule, Task],
        workers: CommLike,
        device: torch.device,
        records: tuple[MetricsLog, Meter, Guard],
        val_loader: DataLoader | None,
        dealer: Dealer | None = None,
    ):
        self.cfg, self.workers, self.device = cfg, workers, device
        self.model, self.rule, self.task = parts
        self.log, self.meter, self.guard = records
        self.val_loader, self.dealer = val_loader, dealer
        self.history: list[dict[str, float]] = []
        self.first_val_loss: float | None = None  # the reference of train.diverge_at
        self.reported_prefix = ""  # the record prefix of the model the run reports ("" or e.g. "center_")
        self.val_count: float | None = None  # the items the last validation counted (samples; tokens: LM)
        self.val_share: Callable[[int, int], DataLoader] | None = None  # (r, n) -> loader of share r of n
        self.whole_val: DataLoader | None = None  # the loader of the whole validation set (alone)
        self.alone = dealer is not None and self.rule.solo_validation  # validations within an epoch: alone
        self.solo_sent: list[tuple[int, list[float]]] = []  # validations taken alone and sent to worker 0
        # this epoch, on the workers' communicator as it is: (this worker's rank, the message)
        self.solo_got = 0  # worker 0: those it received
        self.solo_seen: set[tuple[int, float]] = set()  # worker 0: their (sender's rank, time)
        self.val_asked = 0  # train.val_every_s: the last validation by time asked for (or claimed)
        self.val_bytes = 0.0  # sent validating (the rule's mean models, the sums): bytes_sent_validating

    def validate(self, epoch: int, step: int, done: float | None = None, **extra: Any) -> nn.Module:
        """Evaluate the rule's models, record them (with ``extra`` fields) and return the one the run reports.

        The one reported is the first. ``done``: the part of the epoch trained, for a validation within it."""
        self.guard.check()  # (a model past a non-finite step is not validated: the run ends at that step)
        record: dict[str, float] = {}
        sent = self.workers.stats.bytes_sent
        models = self.rule.eval_models()
        first = next(iter(models))
        self.reported_prefix = f"{first}_" if first else ""
        for name, model in models.items():
            prefix = f"{name}_" if name else ""
            record.update({f"{prefix}val_{k}": v for k, v in self.evaluate(model).items()})
        self.val_bytes += self.workers.stats.bytes_sent - sent
        self.history.append(record)
        self.log.write("val", step, epoch=epoch, **extra, **record)
        where = f"epoch {epoch}" + (f" ({done:.0%})" if done is not None else "")
        where += f", by time #{extra['due']}" if "due" in extra else ""
        self.meter.echo(f"{where}: " + ", ".join(f"{k} {v:.4f}" for k, v in record.items()))
        self.check_collapse(record.get(f"{self.reported_prefix}val_loss"), step, together=True)
        return next(iter(models.values()))

    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """The task's metrics of ``model`` over the whole validation set (all ranks' shares)."""
        sums = self.workers.allreduce_values(
            validation_sums(model, self.val_loader, self.task, self.device, self.cfg.precision)
        )
        self.val_count = sums[-1]  # (the task's sums end with the count)
        return self.task.results(sums)

    def check_collapse(self, loss: float | None, step: int, together: bool) -> None:
        """End the run as diverged when the reported model's validation ``loss`` is not finite or exploded.

        ``loss`` is None when the task has none; it exploded against the run's first (``train.diverge_at``).
        Not when the validation data is what is not finite (:meth:`check_data`; ``together``: every worker
        validated, on its share)."""
        if loss is None:
            return
        if not math.isfinite(loss):
            self.check_data(together)
        if self.first_val_loss is None:
            first = self.history[0].get(f"{self.reported_prefix}val_loss") if self.history else None
            self.first_val_loss = loss if first is None else first
        why = collapse(loss, self.first_val_loss, self.cfg.diverge_at)
        if why is not None:
            raise Diverged(
                f"step {step}: {why}: the run collapsed; lower optim.lr or change the rule's settings, or "
                f"train.diverge_at=null to train on; {self.guard.kept_checkpoint()}"
            )

    def check_data(self, together: bool) -> None:
        """A validation loss that is not finite: raise ValueError when the validation data holds NaN or inf.

        The data is this worker's share; with ``together``, any worker's: all raise alike. The error names
        where."""
        found = nonfinite_batch(self.val_loader if together else self.whole_val)
        bad = [self.workers.rank] if found else []
        if together:
            bad = [
                r
                for r in self.workers.allgather_object(self.workers.rank if found else None)
                if r is not None
            ]
        if not bad:
            return
        if found:
            where = (
                f"batch {found[0]} of worker {self.workers.rank}'s share holds {found[1]} NaN or inf values"
            )
        else:  # the worker that found them ends the job with their place first (its error is the cause)
            time.sleep(DATA_ERROR_GRACE_S)
            where = f"worker {bad[0]}'s share holds NaN or inf values"
        raise ValueError(
            f"the validation data is not finite ({where}): the validation loss cannot be computed; fix the "
            "data set (or its transform) that yields them (the model is not at fault)"
        )

    # -- validation by time (train.val_every_s) ----------------------------------------------------------
    def newly_due(self) -> int | None:
        """The validation by time (``train.val_every_s``) that this worker's clock says is due.

        Only if it is later than the last one asked for or claimed; else None."""
        due = int(self.log.elapsed() // self.cfg.val_every_s)
        return due if due > self.val_asked else None

    def due_by_time(self) -> int:
        """Worker 0, at an agreement: the validation by time due, else 0.

        It is due if ``train.val_every_s`` more seconds of training passed since the last one it asked for
        (the workers then validate together where they agree)."""
        due = self.newly_due()
        if due is None:
            return 0
        self.val_asked = due
        return due

    def by_time(self, pos: Position, due: int) -> None:
        """Every worker, where they agreed that validation by time ``due`` is due on worker 0's clock."""
        self.validate(pos.epoch, pos.step, due=due)  # (recorded by worker 0, which asked)
        self.model.train()

    def claim(self, pos: Position) -> None:
        """Dynamic assignment, rules that validate alone, ``train.val_every_s``: claim the next validation.

        The first worker to start a step once the next validation is due takes it (an atomic maximum on the
        counter's last slot: of the workers that see it due, one raises it), and validates alone."""
        due = self.newly_due()
        if due is None:
            return
        before = self.dealer.counter.fetch_max(claim_slot(self.workers.size), due)
        self.val_asked = max(due, before)
        if before < due:
            self.validate_alone(pos, due)

    # -- validation alone (dynamic assignment, Rule.solo_validation) -------------------------------------
    def validate_alone(self, pos: Position, due: int | None = None) -> None:
        """Within an epoch of dynamic assignment: validate alone on the whole validation set.

        Called by the worker that drew the chunk at a validation's position (the first free one). It
        validates the rule's reported model as it reads it alone (:meth:`~runner.rules.base.Rule.solo_model`)
        while the others train on. Worker 0 records it (:meth:`collect`); it is not kept in the history early
        stopping reads (only one worker has it). ``due``: the validation by time (``train.val_every_s``) it
        is."""
        self.guard.check()
        if self.whole_val is None:
            self.whole_val = self.val_share(0, 1)
        sent = self.workers.stats.bytes_sent
        model = self.rule.solo_model()
        self.val_bytes += self.workers.stats.bytes_sent - sent
        sums = validation_sums(model, self.whole_val, self.task, self.device, self.cfg.precision)
        self.model.train()
        results = self.task.results(sums)
        if self.workers.rank == 0:
            self.record_alone(pos.step, pos.epoch, time.time(), results, 0, due)
        else:
            assert len(sums) <= SUMS_SENT, f"{len(sums)} validation sums, more than {SUMS_SENT}"
            head = [len(sums), pos.step, pos.epoch, time.time(), -1 if due is None else due]
            message = torch.tensor([*head, *sums], dtype=torch.float64)
            self.workers.send(message, 0, VALIDATED)
            self.solo_sent.append((self.workers.rank, message.tolist()))
        self.check_collapse(results.get("loss"), pos.step, together=False)

    def record_alone(
        self, step: int, epoch: int, at: float, results: dict[str, float], by: int, due: int | None = None
    ) -> None:
        """Worker 0: record the ``results`` of a validation worker ``by`` took alone at ``at``.

        ``at``: its ``time.time()``; ``due``: the validation by time it is (None: one at a position of the
        epoch)."""
        record = {f"val_{k}": v for k, v in results.items()}
        timed = {} if due is None else {"due": due}
        self.log.write("val", step, at=at, epoch=epoch, alone=True, by=by, **timed, **record)
        shown = ", ".join(f"{k} {v:.4f}" for k, v in record.items())
        self.meter.echo(f"epoch {epoch} (in progress, worker {by}): {shown}")

    def collect(self, expected: int | None = None) -> None:
        """Worker 0: record the validations other workers took alone and sent.

        With ``expected`` (how many they sent this epoch), wait for those still on their way, and take no
        more."""
        buf = torch.empty(5 + SUMS_SENT, dtype=torch.float64)
        while self.solo_got < expected if expected is not None else self.workers.iprobe(tag=VALIDATED):
            source, _ = self.workers.recv(buf, tag=VALIDATED)
            self.record_message(source, buf.tolist())
            self.solo_got += 1

    def record_message(self, source: int, message: list[float]) -> None:
        """Worker 0: record a validation worker ``source`` took alone, as :meth:`validate_alone` sent it."""
        n, step, epoch, at, due = message[:5]
        self.solo_seen.add((source, at))
        results = self.task.results(message[5 : 5 + int(n)])
        self.record_alone(int(step), int(epoch), at, results, source, None if due < 0 else int(due))

    def gather(self) -> None:
        """Collective over the workers: worker 0 records every validation taken alone this epoch.

        Dynamic assignment, rules that validate alone. They are recorded before the epoch's own records."""
        if not self.alone:
            return
        sent = self.workers.allreduce_values([float(len(self.solo_sent))])[0]
        if self.workers.rank == 0:
            self.collect(expected=round(sent))
        self.solo_sent, self.solo_got, self.solo_seen = [], 0, set()

    def resend(self, record: bool) -> None:
        """Collective over the workers once their communicator was replaced (workers lost or joined).

        The validations taken alone that worker 0 had not received went with the old one (worker 0 would
        wait for them at the epoch's end), so every worker hands those it sent over again, worker 0 records
        the ones it had not (``record`` False: a new worker 0, which cannot tell what the lost one recorded),
        and the count of those on their way starts over."""
        if not self.alone:
            return
        sent = self.workers.allgather_object(self.solo_sent)
        if self.workers.rank == 0 and record:
            for source, message in (m for row in sent for m in row):
                if (source, message[3]) not in self.solo_seen:
                    self.record_message(source, message)
        self.solo_sent, self.solo_got, self.solo_seen = [], 0, set()

    def regrow(self) -> None:
        """The workers' communicator changed size: this worker's share of the validation set anew."""
        if self.val_share is not None:
            self.val_loader = self.val_share(self.workers.rank, self.workers.size)

    def loaders(self) -> tuple[Any, ...]:
        """The validation loaders (their processes are stopped when the worker leaves)."""
        return self.val_loader, self.whole_val
