"""``python -m runner``: compose the config with Hydra and run one mpirun job (or one per sweep point).

This process composes, checks, starts and supervises; it imports neither torch nor MPI.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from runner.config import register
from runner.launch import JobFailed, launch

log = logging.getLogger("runner")
register()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Train; returns the final validation accuracy so sweepers (e.g. Optuna) can optimise it."""
    hydra_cfg = HydraConfig.get()
    try:
        summary = launch(cfg, Path(hydra_cfg.runtime.output_dir))
    except ValueError as err:
        if hydra_cfg.mode == RunMode.RUN:  # a user error, named with its key and fix: no traceback
            log.error("invalid input, nothing was started: %s", err)
            raise SystemExit(2) from None
        raise
    except JobFailed as err:
        log.error("job failed: %s", err)
        if hydra_cfg.mode == RunMode.RUN:
            raise SystemExit(err.status) from None
        raise
    return summary["final_val_acc"]


if __name__ == "__main__":
    main()
