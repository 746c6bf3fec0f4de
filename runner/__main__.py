"""``python -m runner``: compose the config with Hydra and run one mpirun job (or one per sweep point)."""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

import runner.config  # noqa: F401  (registers the structured-config schemas)
from runner.launch import JobFailed, launch

log = logging.getLogger("runner")


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Train; returns the final validation accuracy so sweepers (e.g. Optuna) can optimise it."""
    hydra_cfg = HydraConfig.get()
    try:
        summary = launch(cfg, Path(hydra_cfg.runtime.output_dir))
    except JobFailed as err:
        log.error("job failed: %s", err)
        if hydra_cfg.mode == RunMode.RUN:
            raise SystemExit(err.status) from None
        raise
    return summary["final_val_acc"]


if __name__ == "__main__":
    main()
