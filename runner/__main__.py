"""``python -m runner``: compose the config with Hydra and run one mpirun job (or one per sweep point).

This process composes, checks, starts and supervises; it imports neither torch nor MPI. Its exit status
says how a single run ended (the table is :mod:`runner.launch`'s): 0 ok, 1 failed, 2 invalid input
(Hydra's own compose errors included), 3 diverged, 4 stalled, 5 preempted, 130 interrupted.
"""

from __future__ import annotations

import logging
import sys
import traceback
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig
from omegaconf.errors import OmegaConfBaseException

from runner.config import register
from runner.identity import concurrent_points, identity, sweep_overrides
from runner.launch import EXIT, JobEnded, launch

log = logging.getLogger("runner")
register()
# A log file that cannot be written (full disk) must not print a traceback per message: the console
# handler still shows them, and the launcher reports the run folder's I/O errors itself.
logging.raiseExceptions = False


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Train; returns the final validation accuracy so sweepers (e.g. Optuna) can optimise it."""
    hydra_cfg = HydraConfig.get()
    single = hydra_cfg.mode == RunMode.RUN
    run_dir = Path(hydra_cfg.runtime.output_dir)
    sweep = None if single else sweep_overrides(Path(hydra_cfg.sweep.dir))
    ident = identity(list(hydra_cfg.overrides.task), sweep)
    share = 1 if single else concurrent_points(hydra_cfg.launcher, sweep)
    try:
        if cfg.resume:  # the run's own folder, config and identity; the command line may change safe keys
            from runner.resume import resume_config

            cfg, run_dir = resume_config(cfg, list(hydra_cfg.overrides.task))
            ident = None
        summary = launch(cfg, run_dir, ident, label=None if single else ident["name"], share=share)
    except (ValueError, OmegaConfBaseException) as err:
        if single:  # a user error, named with its key and fix: no traceback
            log.error("invalid input, nothing was started: %s", err)
            raise SystemExit(EXIT["invalid"]) from None
        raise
    except JobEnded as err:
        (log.warning if err.status == "preempted" else log.error)("job %s: %s", err.status, err)
        if single:
            raise SystemExit(err.code) from None
        raise
    return summary["final_val_acc"]


def invalid_input(err: BaseException | None) -> bool:
    """Whether ``err``, which made Hydra give up before or around the task, is the user's input: a config
    that does not compose (unknown option, misspelt key, wrong type, bad override syntax) or a value
    refused. An OS error anywhere in its chain (an unwritable output folder) is not."""
    top, seen = err, set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and not isinstance(err, HydraException):
            return False
        err = err.__cause__ or err.__context__
    return isinstance(top, (HydraException, OmegaConfBaseException, ValueError))


def run() -> None:
    """:func:`main`, with Hydra's exit status 1 for a config it could not compose turned into 2."""
    try:
        main()
    except SystemExit as done:
        if done.code == 1 and invalid_input(done.__context__):
            raise SystemExit(EXIT["invalid"]) from None
        raise
    except Exception as err:  # HYDRA_FULL_ERROR=1: Hydra re-raises instead of exiting
        if not invalid_input(err):
            raise
        traceback.print_exc()
        sys.exit(EXIT["invalid"])


if __name__ == "__main__":
    run()
