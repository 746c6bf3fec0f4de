"""The top-level schema (``conf/config.yaml``), its registration with Hydra, and the launcher's check.

The groups' schemas are dataclasses next to the code they configure (see :mod:`runner.schema`); this module
imports none of them, nor torch or MPI.
"""

from __future__ import annotations

import dataclasses
import difflib
import itertools
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from runner.schema import GROUPS, one_of, register_source, require
from runner.target import of_node

#: ``train.precision``: the forward pass's type under autocast (fp16 with a gradient scaler, GPUs only).
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass
class TrainConfig:
    epochs: int = 10
    batch_size: int = 32
    val_batch_size: int = 256
    seed: int = 0
    val_every: int = 1
    log_every: int = 10
    max_steps: int | None = None
    save_model: str = "rank0"
    progress: bool = True
    same_init: bool = True
    on_nonfinite: str = "stop"
    stall_timeout: float | None = 300.0
    precision: str = "fp32"
    accumulate: int = 1
    grad_clip: float | None = None
    monitor: str | None = None
    early_stop: int | None = None

    def __post_init__(self) -> None:
        require(self.epochs >= 1, "epochs", self.epochs, "train for at least one epoch (train.epochs=10)")
        require(self.batch_size >= 1, "batch_size", self.batch_size, "the per-rank batch must be >= 1")
        require(self.val_batch_size >= 1, "val_batch_size", self.val_batch_size, "must be >= 1")
        require(self.val_every >= 1, "val_every", self.val_every, "validate every N >= 1 epochs")
        require(self.log_every >= 1, "log_every", self.log_every, "log every N >= 1 steps")
        require(
            self.max_steps is None or self.max_steps >= 1,
            "max_steps",
            self.max_steps,
            "use null for no limit or a positive step count",
        )
        one_of("save_model", self.save_model, ("rank0", "all", "none"))
        one_of("on_nonfinite", self.on_nonfinite, ("stop", "skip"))
        require(
            self.stall_timeout is None or self.stall_timeout > 0,
            "stall_timeout",
            self.stall_timeout,
            "seconds without progress before the job is ended, > 0 (e.g. 300), or null to never end it",
        )
        one_of("precision", self.precision, PRECISIONS)
        require(
            self.accumulate >= 1,
            "accumulate",
            self.accumulate,
            "batches of gradients summed per optimizer step, >= 1 (1: no accumulation)",
        )
        require(
            self.grad_clip is None or (math.isfinite(self.grad_clip) and self.grad_clip > 0),
            "grad_clip",
            self.grad_clip,
            "the largest gradient norm, > 0 (e.g. train.grad_clip=1.0), or null for no clipping",
        )
        require(
            self.early_stop is None or self.early_stop >= 1,
            "early_stop",
            self.early_stop,
            "validations without improvement of train.monitor before stopping, >= 1, or null",
        )


@dataclass
class CheckpointConfig:
    """When checkpoints are written (one is always written at the end of a run and on preemption)."""

    every: int | None = None
    every_minutes: float | None = 30.0
    keep: int = 2

    def __post_init__(self) -> None:
        require(
            self.every is None or self.every >= 1,
            "every",
            self.every,
            "steps between checkpoints, >= 1 (e.g. checkpoint.every=500), or null",
        )
        require(
            self.every_minutes is None or self.every_minutes > 0,
            "every_minutes",
            self.every_minutes,
            "minutes between checkpoints, > 0 (e.g. 30), or null",
        )
        require(self.keep >= 1, "keep", self.keep, "keep at least the latest checkpoint (checkpoint.keep=2)")


@dataclass
class SimulateConfig:
    """Conditions imposed on a healthy job to study the rules under them: ``straggler_ranks`` (worker
    ranks, ``0 .. devices-1``) each sleep ``straggler_ms`` milliseconds at the start of every training
    step, a worker whose compute is that much slower. Either one empty or zero leaves the job as it is,
    with a warning when the other is set (so a sweep may include the no-straggler point)."""

    straggler_ranks: list[int] = field(default_factory=list)
    straggler_ms: float = 0.0

    def __post_init__(self) -> None:
        require(
            math.isfinite(self.straggler_ms) and self.straggler_ms >= 0,
            "straggler_ms",
            self.straggler_ms,
            "the delay per training step in milliseconds, >= 0 (e.g. simulate.straggler_ms=30)",
        )
        require(
            len(set(self.straggler_ranks)) == len(self.straggler_ranks),
            "straggler_ranks",
            self.straggler_ranks,
            "name each rank once (e.g. simulate.straggler_ranks=[1,3])",
        )

    def delay_s(self, rank: int) -> float:
        """Seconds that worker ``rank`` sleeps per training step."""
        return self.straggler_ms / 1e3 if rank in self.straggler_ranks else 0.0

    def record(self) -> dict[str, Any] | None:
        """summary.json's ``straggler``: the ranks slowed down and the delay, or None when none is."""
        if not self.straggler_ranks or not self.straggler_ms:
            return None
        return {"ranks": list(self.straggler_ranks), "ms": self.straggler_ms}

    def check_devices(self, devices: int, servers: int) -> None:
        """Only worker ranks may straggle: ``0 .. devices-1`` (the ``servers`` ranks after them serve)."""
        served = ""
        if servers == 1:
            served = f"; rank {devices} is the rule's server"
        elif servers > 1:
            served = f"; ranks {devices}..{devices + servers - 1} are the rule's servers"
        require(
            all(0 <= r < devices for r in self.straggler_ranks),
            "straggler_ranks",
            self.straggler_ranks,
            f"only workers may straggle: name ranks in 0..{devices - 1} (devices={devices}){served}",
        )

    def warning(self) -> str | None:
        """What to tell about a setting that slows no rank although half of it is given."""
        if self.straggler_ranks and not self.straggler_ms:
            return (
                f"simulate.straggler_ranks={self.straggler_ranks} with simulate.straggler_ms=0: no rank is "
                "slowed down (set e.g. simulate.straggler_ms=30)"
            )
        if self.straggler_ms and not self.straggler_ranks:
            return (
                f"simulate.straggler_ms={self.straggler_ms:g} with no simulate.straggler_ranks: no rank is "
                "slowed down (set e.g. simulate.straggler_ranks=[1])"
            )
        return None


@dataclass
class Config:
    """Schema of ``conf/config.yaml``; each group holds the schema object of the option selected."""

    devices: int = 2
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    resume: str | None = None
    eval: str | None = None
    hardware: Any = MISSING
    model: Any = MISSING
    data: Any = MISSING
    rule: Any = MISSING
    optim: Any = MISSING
    schedule: Any = MISSING
    task: Any = MISSING

    def __post_init__(self) -> None:
        self.model = of_node("model", self.model)
        self.optim = of_node("optim", self.optim)
        require(
            isinstance(self.devices, int) and self.devices >= 1,
            "devices",
            self.devices,
            "the number of worker ranks must be >= 1 (e.g. devices=2)",
        )

    @property
    def world_size(self) -> int:
        """Ranks in the job: the workers plus any extra ranks the rule needs (servers)."""
        return self.devices + self.rule.extra_ranks()


#: ``_schemas_`` entry of a group given by its class (``model=custom model._target_=...``): no schema.
TARGET_NODE = "target"


def unique_dir(path: str, resume: str | None = None, evaluated: str | None = None) -> str:
    """``path`` if this call could create it, else the first of ``path-2``, ``path-3``... it could: the
    directories are made here with one atomic ``mkdir`` each, so two launchers started in the same second
    (two ``outputs/DATE/TIME``) never get the same folder. With ``resume`` or ``evaluated`` (``eval=``),
    that run's folder."""
    if resume or evaluated:
        return resume or evaluated
    base = Path(path)
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir()
        except FileExistsError:
            continue
        return str(candidate)
    raise AssertionError("unreachable")


def register() -> None:
    """Make the schemas known to Hydra (idempotent): ``schema`` here, the groups' through ``mpitrain://``,
    and the resolver ``${mpitrain_unique:PATH}`` (:func:`unique_dir`) that ``hydra.run.dir`` and
    ``hydra.sweep.dir`` use. It is cached, so every read of one config (and of the sweep points' configs,
    which Hydra gives the cache of the sweep's config) sees the same folder."""
    from runner.hardware.slurm import register_launcher

    ConfigStore.instance().store(name="schema", node=Config)
    register_source()
    register_launcher()
    OmegaConf.register_new_resolver("mpitrain_unique", unique_dir, use_cache=True, replace=True)
    OmegaConf.register_new_resolver(
        "mpitrain_hydra_subdir",
        lambda resume, now, evaluated=None: (
            f".hydra/resumed-{now}" if resume else f".hydra/eval-{now}" if evaluated else ".hydra"
        ),
        use_cache=True,
        replace=True,
    )


def schema_paths(cfg: DictConfig) -> dict[str, str]:
    """``group -> module.Class`` of the schema each group of a composed config was built from."""
    paths = {}
    for group in GROUPS:
        cls = OmegaConf.get_type(cfg[group])
        if cls is dict and "_target_" in cfg[group]:
            paths[group] = TARGET_NODE
            continue
        if cls is None or cls is dict:
            raise ValueError(f"{group}: the option does not extend a schema (defaults: /schema/{group}/...)")
        paths[group] = f"{cls.__module__}.{cls.__qualname__}"
    return paths


def check_keys(node: DictConfig, path: str = "") -> None:
    """Refuse keys a schema does not declare. Hydra's ``+key=value`` adds them (and Hydra's own message
    for a misspelt key suggests exactly that), so a typo such as ``+train.epoch=1`` would pass unseen."""
    cls = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(cls):
        known = [f.name for f in dataclasses.fields(cls)]
        for key in node.keys():
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean {path}{close[0]}?" if close else "no such key"
                if key == "_target_":
                    group = path.rstrip(".")
                    hint = f"for a class of your own: {group}=custom {group}._target_=my_project.module.Class"
                raise ValueError(
                    f"{path}{key}: not an option of {cls.__name__} ({hint}); the keys are: {', '.join(known)}"
                )
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            check_keys(child, f"{path}{key}.")


def validate(cfg: DictConfig) -> Config:
    """Check every key and value (the schemas' ``__post_init__``); a ValueError names the full key. A
    setting that has no effect although half of it is given (:meth:`SimulateConfig.warning`) is logged.

    Returns the config as schema objects (dataclass instances), interpolations resolved.
    """
    check_keys(cfg)
    missing = OmegaConf.missing_keys(cfg)
    if missing:
        keys = ", ".join(sorted(missing))
        raise ValueError(f"{keys}: no value given; set it on the command line, e.g. {sorted(missing)[0]}=...")
    for key in ("train", "checkpoint", "simulate", *GROUPS):
        try:
            OmegaConf.to_object(cfg[key])
        except ValueError as err:
            raise ValueError(f"{key}.{err}") from None
    checked = OmegaConf.to_object(cfg)
    try:
        checked.rule.check_devices(checked.devices)
    except ValueError as err:
        raise ValueError(f"rule.{err}") from None
    try:
        checked.simulate.check_devices(checked.devices, checked.rule.extra_ranks())
    except ValueError as err:
        raise ValueError(f"simulate.{err}") from None
    check_training(checked)
    warning = checked.simulate.warning()
    if warning:
        logging.getLogger("runner").warning(warning)
    return checked


def check_training(cfg: Config) -> None:
    """Checks of ``train`` that involve other groups: the monitored metric is one the task reports, and fp16
    (which needs a GPU's gradient scaler) is not asked of a CPU job."""
    metrics = [f"val_{m}" for m in cfg.task.metrics(getattr(cfg.data, "num_classes", None))]
    if cfg.train.monitor is not None and cfg.train.monitor not in metrics:
        task = type(cfg.task).__module__.rsplit(".", 1)[-1]
        raise ValueError(
            f"train.monitor={cfg.train.monitor!r} is invalid: task={task} reports {', '.join(metrics)}"
        )
    if cfg.train.precision == "fp16" and getattr(cfg.hardware, "device", None) == "cpu":
        raise ValueError(
            "train.precision='fp16' is invalid: float16 training needs a GPU (a gradient scaler keeps its "
            "small gradients); on CPUs use train.precision=bf16"
        )


def monitored(cfg: Config) -> str:
    """The validation metric the run reports to sweepers and early stopping watch: ``train.monitor`` or
    the task's first metric (``val_acc`` for classification, ``val_loss`` for regression)."""
    return cfg.train.monitor or f"val_{cfg.task.metrics(None)[0]}"


#: The schemas of groups added since the first release, for run folders written before them.
SCHEMAS_BEFORE = {
    "task": "runner.tasks.classification.ClassificationConfig",
    "schedule": "runner.schedule.constant.ConstantConfig",
}


def load_structured(path: str | Path) -> DictConfig:
    """A run folder's ``config.yaml`` (written by the launcher with ``_schemas_``) as a typed config."""
    from runner.schema import locate

    raw = OmegaConf.load(path)
    schemas = {**SCHEMAS_BEFORE, **raw.pop("_schemas_")}
    top = OmegaConf.structured(Config)
    for group, cls_path in schemas.items():
        node = raw.pop(group, {})
        top[group] = (
            node if cls_path == TARGET_NODE else OmegaConf.merge(OmegaConf.structured(locate(cls_path)), node)
        )
    return OmegaConf.merge(top, raw)


def load(path: str | Path) -> Config:
    """The checked config of a run folder's ``config.yaml``."""
    return OmegaConf.to_object(load_structured(path))
