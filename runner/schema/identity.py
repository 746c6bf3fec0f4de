"""What a run is, in words: its overrides, the keys its sweep varied, and a short name.

The overrides it was started with, the keys its sweep varied with their values, and a short name built from
them (``rule.alpha=0.5,optim.lr=0.05``) that labels its records and lines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from runner.run_folder import SWEEP_CONFIG
from runner.schema.secrets import hidden

#: Overrides that say where or how a run is shown, not what it is.
IGNORED = ("hydra.", "hydra/", "train.progress", "resume", "trust_folder", "logger", "sweep.")


def override_key(override: str) -> str:
    """The key of a Hydra override string: ``+train.seed=3`` → ``train.seed``."""
    return override.split("=", 1)[0].lstrip("+~")


def _parse(text: str) -> Any:
    """Hydra's parsed override, or None for a string it does not parse."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        return OverridesParser.create().parse_override(text)
    except Exception:
        return None


def parse_overrides(overrides: list[str]) -> dict[str, tuple[Any, str]]:
    """``key -> (value, text)`` of Hydra override strings, less the ignored keys and deletions.

    A sweep, or a string Hydra does not parse, keeps its raw text as the value."""
    out = {}
    for text in overrides:
        key, equals, raw = text.partition("=")
        key = key.lstrip("+")
        if equals and not key.startswith((*IGNORED, "~")):
            o = _parse(text)
            ok = o is not None and not o.is_sweep_override()
            out[key] = (o.value(), o.get_value_element_as_str()) if ok else (raw, raw)
    return out


def command_line_overrides(argv: list[str]) -> list[str]:
    """The Hydra overrides (``key=value``) among a command line's arguments, flags left out."""
    return [a for a in argv if "=" in a and not a.startswith("-")]


def varied_keys(sweep: list[str]) -> list[str]:
    """The keys a sweep's overrides vary: lists of values, ranges, Optuna's intervals."""
    return [o.key_or_group for t in sweep if (o := _parse(str(t))) is not None and o.is_sweep_override()]


def identity(task: list[str], sweep: list[str] | None = None) -> dict[str, Any]:
    """A run's ``overrides``, ``swept`` and ``name``.

    ``overrides``: ``task`` less the ignored ones; ``swept``: each key the ``sweep`` overrides vary, with this
    run's value (without a sweep, every override)."""
    mine = [o for o in task if not override_key(o).startswith(IGNORED)]
    varied = None if sweep is None else set(varied_keys(sweep))
    chosen = {k: v for k, v in parse_overrides(mine).items() if varied is None or k in varied}
    swept = {
        k: v if isinstance(v, (bool, int, float, str, type(None))) else str(v) for k, (v, _) in chosen.items()
    }
    name = ",".join(f"{k}={short(value, text)}" for k, (value, text) in chosen.items())
    return hidden({"overrides": mine, "swept": swept, "name": name or "defaults"})  # hardware.env: secrets


def short(value: Any, text: str) -> str:
    """A value as a run's name shows it: a float to 4 significant digits (Optuna draws 17), else as given."""
    if isinstance(value, float) and not isinstance(value, bool):
        return f"{value:.4g}"
    return text


def sweep_overrides(sweep_dir: Path) -> list[str] | None:
    """The overrides a multirun was started with (from the ``multirun.yaml`` Hydra wrote), or None."""
    from omegaconf import OmegaConf

    path = sweep_dir / SWEEP_CONFIG
    if not path.is_file():
        return None
    return list(OmegaConf.load(path).hydra.overrides.task)


def concurrent_points(launcher: Any, sweep: list[str] | None) -> int:
    """How many points of a sweep run at once on this machine.

    Those of Hydra's joblib launcher (``n_jobs``) or submitit's local one (all), at most as many as the sweep
    has (when its overrides say: lists of values); 1 for launchers that run points one after another or
    elsewhere."""
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
        points = 1
        for override in filter(None, map(_parse, sweep)):
            if override.is_sweep_override():
                try:
                    points *= len(list(override.sweep_iterator()))
                except Exception:  # a range to sample from (Optuna): no count
                    return max(1, limit)
        limit = min(limit, points)
    return max(1, limit)
