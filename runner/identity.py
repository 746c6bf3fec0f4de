"""What a run is, in words: the overrides it was started with, the keys its sweep varied with their values,
and a short name built from them (``rule.alpha=0.5,optim.lr=0.05``) that labels its records and lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Overrides that say where or how a run is shown, not what it is.
IGNORED = ("hydra.", "hydra/", "train.progress", "resume")
IDENTITY_FILE = "run.json"


def override_key(override: str) -> str:
    """The key of a Hydra override string: ``+train.seed=3`` → ``train.seed``."""
    return override.split("=", 1)[0].lstrip("+~")


def identity(task: list[str], sweep: list[str] | None = None) -> dict[str, Any]:
    """``overrides`` (``task`` less the ignored ones), ``swept`` (each key the ``sweep`` overrides vary,
    with this run's value; without a sweep, every override) and ``name``."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    mine = [o for o in task if not override_key(o).startswith(IGNORED)]
    varied = None
    if sweep is not None:
        varied = {o.key_or_group for o in parser.parse_overrides(list(sweep)) if o.is_sweep_override()}
    swept: dict[str, Any] = {}
    parts = []
    for override in parser.parse_overrides(mine):
        key = override.key_or_group
        if varied is not None and key not in varied:
            continue
        value = override.value()
        swept[key] = value if isinstance(value, (bool, int, float, str, type(None))) else str(value)
        parts.append(f"{key}={override.get_value_element_as_str()}")
    return {"overrides": mine, "swept": swept, "name": ",".join(parts) or "defaults"}


def sweep_overrides(sweep_dir: Path) -> list[str] | None:
    """The overrides a multirun was started with (from the ``multirun.yaml`` Hydra wrote), or None."""
    from omegaconf import OmegaConf

    path = sweep_dir / "multirun.yaml"
    if not path.is_file():
        return None
    return list(OmegaConf.load(path).hydra.overrides.task)


def concurrent_points(launcher: Any, sweep: list[str] | None) -> int:
    """How many points of a sweep run at once on this machine: those of Hydra's joblib launcher
    (``n_jobs``) or submitit's local one (all), at most as many as the sweep has (when its overrides say:
    lists of values); 1 for launchers that run points one after another or elsewhere."""
    import os

    target = str(launcher.get("_target_", ""))
    if target.endswith("JoblibLauncher"):
        limit = launcher.get("n_jobs") or 1
        limit = os.cpu_count() or 1 if limit < 0 else limit
    elif target.endswith("LocalLauncher"):  # submitit's local executor starts every point at once
        limit = launcher.get("array_parallelism") or 1_000_000
    else:
        return 1
    if sweep:
        from hydra.core.override_parser.overrides_parser import OverridesParser

        points = 1
        for override in OverridesParser.create().parse_overrides(list(sweep)):
            if override.is_sweep_override():
                try:
                    points *= len(list(override.sweep_iterator()))
                except Exception:  # a range to sample from (Optuna): no count
                    return max(1, limit)
        limit = min(limit, points)
    return max(1, limit)
