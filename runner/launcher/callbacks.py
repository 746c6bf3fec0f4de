"""Hydra callbacks of the launcher: the sweep report at the end of every multirun.

Registered in ``conf/config.yaml`` (``hydra.callbacks.report``). Hydra calls ``on_multirun_end`` only when
the sweeper returns: every point ended ok, or the sweep was stopped (Ctrl-C, which it takes:
:mod:`runner.launcher.sweep_stop`); a failed point run elsewhere makes it raise first, so the report of a
sweep that did not complete is written when the launcher exits instead; none for a sweep refused before any
point started (its folder may be another sweep's). Either way a report that cannot be written is logged
and changes nothing else: not the sweep's exit status, not its folders.
"""

from __future__ import annotations

import atexit
import logging
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from runner.launcher import outcomes, sweep_stop

log = logging.getLogger("runner")


class SweepReport(Callback):
    """Writes :mod:`runner.report.write`'s report into the sweep folder (``hydra.sweep.dir``).

    ``metric`` is the validation metric compared (``hydra.callbacks.report.metric=val_loss``; None: the
    runs' ``train.monitor``), ``target`` the value of time to target (None: 95% of the best run's best),
    ``enabled=false`` turns it off."""

    def __init__(self, metric: str | None = None, target: float | None = None, enabled: bool = True):
        self.metric, self.target, self.enabled = metric, target, enabled
        self.sweep_dir: Path | None = None
        self.done = False

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if self.enabled:
            self.sweep_dir = Path(config.hydra.sweep.dir)
            atexit.register(self._at_exit)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        if self.enabled:
            self.write(Path(config.hydra.sweep.dir))

    def _at_exit(self) -> None:
        if self.sweep_dir in outcomes.REFUSED:  # refused before any point started: maybe another's folder
            return
        if not self.done and self.sweep_dir is not None and self.sweep_dir.is_dir():
            self.write(self.sweep_dir, quiet_if_empty=True)

    def write(self, sweep_dir: Path, quiet_if_empty: bool = False) -> None:
        """Write the report of ``sweep_dir``; log (never raise) why it could not be written."""
        self.done = True
        try:
            from runner.report.table import verdict_line
            from runner.report.write import NoRuns, write_report

            try:
                report = write_report([sweep_dir], self.metric, self.target)
            except NoRuns:
                if quiet_if_empty:
                    return
                if sweep_stop.requested():  # (the last line gives the resume= command)
                    log.info("no sweep report: the sweep was stopped before any of its points ran")
                    return
                raise
            if quiet_if_empty:
                log.info("the sweep did not complete: reporting the runs it has")
            log.info(
                "sweep report: %s (%d run%s; %s)",
                sweep_dir / "report.html",
                len(report.runs),
                "" if len(report.runs) == 1 else "s",
                verdict_line(report),
            )
        except Exception as err:  # a report is a convenience: it must not fail the sweep
            log.warning(
                "the sweep report could not be written: %s: %s; try: python -m runner.report %s",
                type(err).__name__,
                err,
                sweep_dir,
                exc_info=log.isEnabledFor(logging.DEBUG),
            )
