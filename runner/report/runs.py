"""Run folders as the sweep report reads them: what each run recorded, and a name for each run.

The name is built from the keys its sweep varied (or, for runs started separately, the overrides whose values
differ between them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.run_folder import (
    CONFIG,
    HYDRA_CONFIG,
    HYDRA_DIR,
    HYDRA_OVERRIDES,
    IDENTITY,
    METRICS,
    SUMMARY,
    SWEEP_CONFIG,
    parse_number,
    read_json,
    read_metrics,
)
from runner.schema.identity import parse_overrides, varied_keys

#: The factors of a step's samples: a key of the run's config and its default (None: required).
SAMPLES_PER_STEP = (("devices", 1), ("train.batch_size", None), ("train.accumulate", 1))
#: Where a run's config says how many tokens a sample holds: ``data.shape``'s last entry, else this key.
BLOCK_SIZE = "data.block_size"
#: A sweep's manifest, where a point refused before its job started has its reason
#: (:data:`runner.launcher.sweep_resume.MANIFEST`; the launcher imports the report, not the other way).
MANIFEST = "sweep.json"
#: Files that make a folder a run folder.
RUN_FILES = (SUMMARY, METRICS, IDENTITY, f"{HYDRA_DIR}/{HYDRA_OVERRIDES}")


class NoRuns(ValueError):
    """A folder given to the report holds no run folder."""


def finite_or_none(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def _read_yaml(path: Path) -> Any:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


@dataclass(frozen=True)
class Load:
    """The machine's 1-minute load average at a run's start and end, and its CPU count.

    ``load`` in summary.json; None where unknown."""

    start: float | None
    end: float | None
    cpus: int | None

    @classmethod
    def of(cls, recorded: Any) -> Load | None:
        """The ``load`` a summary.json recorded, or None (a run older than the field, or a damaged one)."""
        if not isinstance(recorded, dict):
            return None
        start, end = finite_or_none(recorded.get("start")), finite_or_none(recorded.get("end"))
        cpus = finite_or_none(recorded.get("cpus"))
        return None if start is None and end is None else cls(start, end, int(cpus) if cpus else None)

    def text(self) -> str:
        """``0.4→2.1 on 2 CPUs``: the load at the start and the end, and the CPUs."""
        start, end = (_fmt_load(v) for v in (self.start, self.end))
        return f"{start}→{end}" + (f" on {self.cpus} CPUs" if self.cpus else "")


def _fmt_load(value: float | None) -> str:
    return "?" if value is None else f"{value:.1f}"


@dataclass
class Run:
    """One run folder: what it recorded, its swept values and name, and (once scored) its results.

    Rates come from summary.json, else (a run that failed) from the mean of its epoch records. Bytes per step:
    per worker and optimizer step; samples per step: the global batch, devices × batch_size × accumulate.
    ``others``: once scored, the best metric of the rule's other validated models by record prefix (EASGD's
    ``worker_mean``); ``beside``: the final and best of the metric shown beside the scored one (a loss's
    perplexity). A run counts tokens (a language model) where it recorded ``tokens_per_s``."""

    dir: Path
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    given: dict[str, tuple[Any, str]]
    swept: dict[str, Any] = field(default_factory=dict)
    name: str = ""
    final: float | None = None
    best: float | None = None
    target_time_s: float | None = None
    target_step: int | None = None
    target_samples: float | None = None
    target_tokens: float | None = None
    others: dict[str, float] = field(default_factory=dict)
    beside: tuple[float | None, float | None] = (None, None)
    status: str = field(init=False)
    cause: str | None = field(init=False)
    wall_time_s: float | None = field(init=False)
    samples_per_s: float | None = field(init=False)
    tokens_per_s: float | None = field(init=False)
    comm_fraction: float | None = field(init=False)
    bytes_per_worker: float | None = field(init=False)
    bytes_per_step: float | None = field(init=False)
    load: Load | None = field(init=False)

    def __post_init__(self) -> None:
        s = self.summary
        self.status = str(s.get("status") or "unfinished")
        self.cause = None if self.ok else s.get("error") or s.get("cause") or "no cause recorded"
        if not s:
            self.cause = "no summary.json: the run did not end (still running, or its launcher was killed)"
        self.wall_time_s = finite_or_none(s.get("wall_time_s"))
        self.samples_per_s = self._rate("samples_per_s", "samples_per_s")
        self.tokens_per_s = self._rate("tokens_per_s", "tokens_per_s")
        self.comm_fraction = self._rate("comm_fraction", "comm_frac")
        sent, devices = finite_or_none(s.get("bytes_sent")), finite_or_none(s.get("devices"))
        self.bytes_per_worker = None if sent is None or not devices else sent / devices
        steps = _worker_steps(s, devices, self.records)
        validating = finite_or_none(s.get("bytes_sent_validating")) or 0.0  # (the training's bytes: without)
        self.bytes_per_step = None if sent is None or steps <= 0 else (sent - validating) / steps
        self.load = Load.of(s.get("load"))

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def kind(self, kind: str) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("kind") == kind]

    @property
    def vals(self) -> list[dict[str, Any]]:
        return self.kind("val") or [v for v in self.summary.get("validations") or [] if "step" in v]

    def _rate(self, summary_key: str, epoch_key: str) -> float | None:
        rates = [v for r in self.kind("epoch") if (v := finite_or_none(r.get(epoch_key))) is not None]
        value = finite_or_none(self.summary.get(summary_key))
        return value if value is not None or not rates else sum(rates) / len(rates)

    @property
    def samples_per_step(self) -> float | None:
        """The global batch: devices × ``train.batch_size`` × ``train.accumulate`` (None: batch unknown)."""
        sizes = [finite_or_none((self.lookup(k) or (default, ""))[0]) for k, default in SAMPLES_PER_STEP]
        return None if None in sizes else math.prod(sizes)

    @property
    def tokens_per_sample(self) -> float | None:
        """Tokens in a sample of a run that counts them.

        Its config's ``data.shape[-1]``, else ``data.block_size`` (None: the run counts no tokens, or its
        config does not say)."""
        if self.tokens_per_s is None:
            return None
        shape = self.config(("data", "shape"))
        if isinstance(shape, list) and shape:
            return finite_or_none(shape[-1])
        return finite_or_none((self.lookup(BLOCK_SIZE) or (None, ""))[0])

    def config(self, path: tuple[str, ...]) -> Any:
        """The value at ``path`` in the run's config.yaml (None: no such key, or no config)."""
        value = _read_yaml(self.dir / CONFIG) or {}
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        return value

    def lookup(self, key: str) -> tuple[Any, str] | None:
        """``(value, text)`` of ``key`` in this run.

        Its override, else its config group's choice, summary or config value (a key that another run
        overrode)."""
        if key in self.given:
            return self.given[key]
        hydra = _read_yaml(self.dir / HYDRA_DIR / HYDRA_CONFIG) or {}
        value = (((hydra.get("hydra") or {}).get("runtime") or {}).get("choices") or {}).get(key)
        value = self.summary.get(key) if value is None else value
        if value is None:
            value = self.config(tuple(key.split(".")))
        return None if value is None or isinstance(value, (dict, list)) else (value, str(value))


def _worker_steps(summary: dict[str, Any], devices: float | None, records: list[dict[str, Any]]) -> float:
    """The optimizer steps all workers took in this job (a resumed job: since its checkpoint).

    From ``steps_per_worker``, else ``steps`` (or the last record's step) × devices; 0 where unknown."""
    each = summary.get("steps_per_worker")
    each = [v for v in each if finite_or_none(v) is not None] if isinstance(each, list) else []
    steps = finite_or_none(summary.get("steps"))
    if steps is None:
        steps = max((finite_or_none(r.get("step")) or 0.0 for r in records), default=0.0)
    workers = len(each) or devices or 0
    total = sum(each) if each else steps * workers
    return total - (finite_or_none(summary.get("resumed_from_step")) or 0) * workers


def declared_keys(folder: Path) -> list[str]:
    """The keys a sweep folder's multirun.yaml says its sweep varied.

    Its sweep overrides (lists, ranges, Optuna's intervals) and ``hydra.sweeper.params``. (Without one, the
    keys whose values differ count.)"""
    hydra = (_read_yaml(folder / SWEEP_CONFIG) or {}).get("hydra") or {}
    keys = varied_keys((hydra.get("overrides") or {}).get("task") or [])
    return list(dict.fromkeys(keys + [str(k) for k in (hydra.get("sweeper") or {}).get("params") or {}]))


def _is_run(path: Path) -> bool:
    return any((path / f).exists() for f in RUN_FILES)


def run_folders(folder: Path) -> list[Path]:
    """``folder`` itself if it is a run folder, else its run subfolders (numbered ones in order)."""
    if _is_run(folder):
        return [folder]
    subs = [p for p in folder.iterdir() if p.is_dir() and _is_run(p)] if folder.is_dir() else []
    return sorted(subs, key=lambda p: (1, 0, p.name) if (n := parse_number(p.name)) is None else (0, n, ""))


def load_run(path: Path) -> Run:
    summary, ident = read_json(path / SUMMARY) or refused(path), read_json(path / IDENTITY)
    overrides = summary.get("overrides") or ident.get("overrides")
    if overrides is None:
        overrides = _read_yaml(path / HYDRA_DIR / HYDRA_OVERRIDES) or []
    given = parse_overrides([str(o) for o in overrides])
    for key, value in (summary.get("swept") or ident.get("swept") or {}).items():
        given[key] = (value, given[key][1] if key in given else str(value))
    run = Run(path, summary, read_metrics(path / METRICS), given)
    run.name = summary.get("name") or ident.get("name") or ""
    return run


def refused(path: Path) -> dict[str, Any]:
    """The summary of a sweep point that was refused before its job started, else {}.

    It has no summary.json of its own: the sweep's manifest says ``invalid``, with its one-line reason."""
    points = read_json(path.parent / MANIFEST).get("points")
    point = points.get(path.name) if isinstance(points, dict) else None
    if not isinstance(point, dict) or point.get("state") != "invalid":
        return {}
    reason = point.get("error") or f"its reason is in the log in {path}"
    return {"status": "invalid", "error": f"refused before it started: {reason}"}


def short_value(value: Any, text: str) -> str:
    """A swept value as a name shows it: a long float to 4 significant digits, else its text."""
    return f"{value:.4g}" if isinstance(value, float) and len(text) > 8 else text


def label(runs: list[Run], declared: list[str]) -> list[str]:
    """Set each run's ``swept`` and ``name``; returns the keys.

    The keys are the ``declared`` ones and those whose values differ between the runs. A name the run recorded
    is kept when it names the same keys."""
    keys = list(declared)
    seen = list(dict.fromkeys(k for run in runs for k in run.given))
    for key in seen:
        if key not in keys and len({repr((run.lookup(key) or [None])[0]) for run in runs}) > 1:
            keys.append(key)
    for run in runs:
        values = {k: v for k in keys if (v := run.lookup(k)) is not None}
        run.swept = {k: v[0] for k, v in values.items()}
        if values and (not run.name or set(run.summary.get("swept") or ()) != set(keys)):
            run.name = ",".join(f"{k}={short_value(*v)}" for k, v in values.items())
        given = ",".join(f"{k}={short_value(*v)}" for k, v in run.given.items())
        run.name = run.name or given or run.dir.name
    names = [run.name for run in runs]
    for run in runs:
        if names.count(run.name) > 1:
            run.name = f"{run.name} [{run.dir.name}]"
    return keys


def load_runs(dirs: list[Path]) -> tuple[list[Run], list[str]]:
    """The runs of ``dirs`` (sweep folders, folders of runs, run folders), named; and the swept keys."""
    runs, declared = [], []
    for folder in dirs:
        found = run_folders(folder)
        if not found:
            raise NoRuns(
                f"{folder}: no run folders in it (no summary.json, metrics.jsonl or .hydra/overrides.yaml "
                "there or in its subfolders); give a sweep folder (outputs/multirun/DATE/TIME) or run folders"
            )
        declared += declared_keys(folder) if found != [folder] else []
        runs += [load_run(p) for p in found]
    return runs, label(runs, list(dict.fromkeys(declared)))
