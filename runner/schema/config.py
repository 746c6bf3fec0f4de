"""The top-level schema (``conf/config.yaml``), its registration with Hydra, and the launcher's check.

The groups' schemas are dataclasses next to the code they configure (see :mod:`runner.schema`); this module
imports none of them, nor torch or MPI.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf

from runner.run_folder import CONFIG_SHA_ENV
from runner.schema import (
    GROUPS,
    READING_RUN_FOLDER,
    collected,
    option_name,
    raise_problems,
    require,
    schema_of,
)
from runner.schema.data_reads import check_data_read
from runner.schema.logger import DEFAULT_LOGGERS, as_loggers
from runner.schema.sections import CheckpointConfig, SimulateConfig, SweepConfig, TrainConfig
from runner.schema.target import of_node
from runner.schema.trust import check_kinds, check_schema_class, check_schemas, targets

#: ``_schemas_`` entry of a group given by its class (``model=custom model._target_=...``): no schema.
TARGET_NODE = "target"
#: The groups that may be given by a class of the user's, and where a stray ``_target_`` should go.
TARGET_GROUPS = ("model", "optim")
TARGET_HINTS = {
    "model": "for a class of your own: model=custom model._target_=my_project.module.Net",
    "optim": "for an optimizer class: optim=custom optim._target_=torch.optim.RMSprop",
    "data": "for a torch Dataset of your own: data=dataset data.train._target_=my_project.module.Set",
    "task": "for a loss of your own: task.loss={_target_: my_project.module.Loss}",
}


@dataclass
class Config:
    """Schema of ``conf/config.yaml``; each group holds the schema object of the option selected."""

    devices: int = 2
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    simulate: SimulateConfig = field(default_factory=SimulateConfig)
    sweep: SweepConfig = field(default_factory=SweepConfig)
    resume: str | None = None
    eval: str | None = None
    trust_folder: bool = False  # resume= a folder not your own with its programs, environment, destinations
    hardware: Any = MISSING
    model: Any = MISSING
    data: Any = MISSING
    rule: Any = MISSING
    optim: Any = MISSING
    schedule: Any = MISSING
    task: Any = MISSING
    logger: Any = field(default_factory=dict)  # name -> schema of each logger chosen (runner.schema.logger)

    def __post_init__(self) -> None:
        self.logger = as_loggers(self.logger)
        for group in TARGET_GROUPS:
            setattr(self, group, of_node(group, getattr(self, group)))
        check_devices(self.devices)

    @property
    def world_size(self) -> int:
        """Ranks in the job: the workers plus any extra ranks the rule needs (servers)."""
        return self.devices + self.rule.extra_ranks()

    @property
    def launched(self) -> int:
        """Ranks mpirun starts: :attr:`world_size` plus the idle spares (``hardware.spares``)."""
        return self.world_size + self.hardware.spares


def schema_paths(cfg: DictConfig) -> dict[str, str]:
    """``group -> module.Class`` of the schema each group of a composed config was built from."""
    paths = {}
    for group in GROUPS:
        if group == "logger":  # several options, each known by its key (runner.schema.logger.as_loggers)
            continue
        cls = OmegaConf.get_type(cfg[group])
        if cls is dict and "_target_" in cfg[group] and group in TARGET_GROUPS:
            paths[group] = TARGET_NODE
            continue
        if cls is None or cls is dict:
            raise ValueError(f"{group}: the option does not extend a schema (defaults: /schema/{group}/...)")
        paths[group] = f"{cls.__module__}.{cls.__qualname__}"
    return paths


def check_keys(node: DictConfig, path: str = "") -> None:
    """Refuse keys a schema does not declare.

    Hydra's ``+key=value`` adds them (and Hydra's own message for a misspelt key suggests exactly that), so a
    typo such as ``+train.epoch=1`` would pass unseen."""
    cls = OmegaConf.get_type(node)
    if dataclasses.is_dataclass(cls):
        known = [f.name for f in dataclasses.fields(cls)]
        for key in node.keys():
            if key not in known:
                close = difflib.get_close_matches(str(key), known, n=1)
                hint = f"did you mean {path}{close[0]}?" if close else "no such key"
                if key == "_target_":
                    hint = TARGET_HINTS.get(path.rstrip("."), hint)
                raise ValueError(
                    f"{path}{key}: not an option of {cls.__name__} ({hint}); the keys are: {', '.join(known)}"
                    + ("" if close else _other_options(path.rstrip("."), str(key)))
                )
    for key in node.keys():
        child = node._get_node(key)
        if isinstance(child, DictConfig) and not child._is_missing() and not child._is_none():
            check_keys(child, f"{path}{key}.")


def _other_options(group: str, key: str) -> str:
    """For a key the chosen option of ``group`` lacks: the other options that have it, or one close to it.

    E.g. ``; rule.alpha is a key of rule=easgd``; nothing for a key no option has, or outside the groups."""
    if group not in GROUPS:
        return ""
    conf = Path(__file__).resolve().parents[1] / "conf" / group
    holders: dict[str, list[str]] = {}
    for option in sorted(p.stem for p in conf.glob("*.yaml")):
        try:  # (an option whose schema is its own module: the rules', for one)
            fields = [f.name for f in dataclasses.fields(schema_of(group, option))]
        except (ImportError, ValueError, TypeError):
            continue
        match = key if key in fields else next(iter(difflib.get_close_matches(key, fields, n=1)), None)
        if match is not None:
            holders.setdefault(match, []).append(f"{group}={option}")
    said = [f"{group}.{k} is a key of {', '.join(options)}" for k, options in sorted(holders.items())]
    return "; " + "; ".join(said) if said else ""


def validate(cfg: DictConfig) -> Config:
    """Check every key and value (the schemas' ``__post_init__``); a ValueError names the full key.

    Every independent problem is told at once, a line each (:class:`runner.schema.ConfigErrors`): those of
    each section and group first, then, when there are none, those of the checks across groups, which need
    them. A setting that has no effect although half of it is given (:meth:`SimulateConfig.warning`) is
    logged.

    Returns the config as schema objects (dataclass instances), interpolations resolved.
    """
    check_keys(cfg)
    check_data_read(cfg)
    missing = OmegaConf.missing_keys(cfg)
    if missing:
        keys = ", ".join(sorted(missing))
        raise ValueError(f"{keys}: no value given; set it on the command line, e.g. {sorted(missing)[0]}=...")
    problems: list[str] = []
    with collected("", problems):
        check_devices(cfg.devices)
    for key in ("train", "checkpoint", "simulate", "sweep", *GROUPS):
        known = len(problems)
        with collected(f"{key}.", problems):
            section = OmegaConf.to_object(cfg[key])
        if key == "logger" and len(problems) == known:
            check_loggers(section, problems)
    raise_problems(problems)
    checked = OmegaConf.to_object(cfg)
    with collected("rule.", problems):
        checked.rule.check_devices(checked.devices)
    with collected("", problems):
        checked.rule.check_model(checked.model)
    with collected("", problems):
        checked.rule.check_optim(checked.optim)
    with collected("simulate.", problems):
        checked.simulate.check_devices(checked.devices, checked.rule.extra_ranks())
    for check in TRAINING_CHECKS:
        with collected("", problems):
            check(checked)
    with collected("data.", problems):
        checked.data.dynamic(checked.rule.asynchronous())
    raise_problems(problems)
    warning = checked.simulate.warning()
    if warning and not (checked.simulate.link_gbps is None and free_links_asked()):
        logging.getLogger("runner").warning(warning)
    return checked


def free_links_asked() -> bool:
    """Whether this command gave ``simulate.link_gbps=null`` itself.

    A sweep's point without links, which the network sweep includes on purpose: no warning that links are free
    is then due."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task = HydraConfig.get().overrides.task if HydraConfig.initialized() else []
    except Exception:  # (no Hydra here: a rank, a test)
        return False
    return any(o.replace(" ", "") in ("simulate.link_gbps=null", "simulate.link_gbps=None") for o in task)


def check_loggers(section: Mapping[str, Any], problems: list[str]) -> None:
    """Add to ``problems`` each logger of ``section`` that is no logger or whose package is not installed.

    ``section``: the ``logger`` node."""
    try:
        loggers = as_loggers(section)
    except ValueError as err:
        problems.append(str(err))
        return
    for logger in loggers.values():
        with collected("", problems):
            logger.check_installed()


def check_devices(devices: Any) -> None:
    """``devices``: the number of worker ranks, a whole number >= 1."""
    require(
        isinstance(devices, int) and devices >= 1,
        "devices",
        devices,
        "the number of worker ranks must be >= 1 (e.g. devices=2)",
    )


def check_training(cfg: Config) -> None:
    """Checks of ``train`` that involve other groups (:data:`TRAINING_CHECKS`), the first failed raised."""
    for check in TRAINING_CHECKS:
        check(cfg)


def check_monitor(cfg: Config) -> None:
    """The monitored metric is one the task reports."""
    metrics = [f"val_{m}" for m in cfg.task.metrics(getattr(cfg.data, "num_classes", None))]
    if cfg.train.monitor is not None and cfg.train.monitor not in metrics:
        task = option_name(type(cfg.task))
        raise ValueError(
            f"train.monitor={cfg.train.monitor!r} is invalid: task={task} reports {', '.join(metrics)}"
        )


def check_workers(cfg: Config) -> None:
    """No more surviving workers are asked for than the job has, nor fewer to grow to.

    The rule holds as many workers as the job may grow to."""
    if cfg.hardware.min_workers > cfg.devices:
        raise ValueError(
            f"hardware.min_workers={cfg.hardware.min_workers} is invalid: the job has devices={cfg.devices} "
            f"workers; give at most {cfg.devices} (the fewest survivors a fault-tolerant job goes on with)"
        )
    most = cfg.hardware.max_workers
    if most is not None and most < cfg.devices:
        raise ValueError(
            f"hardware.max_workers={most} is invalid: the job starts devices={cfg.devices} workers; give at "
            f"least {cfg.devices} (the most workers it may grow to with RUN_DIR/JOIN), or null"
        )
    if most is not None:
        check_rule_grown(cfg, most)


def check_rule_grown(cfg: Config, most: int) -> None:
    """The rule holds the ``most`` workers the job may grow to; its refusal names hardware.max_workers.

    Lowering that key is one of the fixes; the rule's own message names the count, not the key."""
    problems: list[str] = []
    with collected("rule.", problems):
        cfg.rule.check_devices(most)
    if problems:
        raise ValueError(
            f"hardware.max_workers={most} lets the job grow to {most} workers, with which "
            f"{'; '.join(problems)}; or lower hardware.max_workers (at least devices={cfg.devices})"
        )


def check_precision(cfg: Config) -> None:
    """fp16, which needs a GPU's gradient scaler, is not asked of a CPU job."""
    if cfg.train.precision == "fp16" and getattr(cfg.hardware, "device", None) == "cpu":
        raise ValueError(
            "train.precision='fp16' is invalid: float16 training needs a GPU (a gradient scaler keeps its "
            "small gradients); on CPUs use train.precision=bf16"
        )


def check_warmup(cfg: Config) -> None:
    """The warm-up is no longer than ``train.max_steps`` (the ranks check it against an epoch's steps)."""
    steps = cfg.train.max_steps
    if steps is not None:
        cfg.schedule.check_length(steps, f"train.max_steps={steps}", "raise train.max_steps")


#: The checks of ``train`` that involve other groups, each independent of the others.
TRAINING_CHECKS = (check_monitor, check_workers, check_precision, check_warmup)


def monitored(cfg: Config) -> str:
    """The validation metric the run reports to sweepers and early stopping watch.

    ``train.monitor``, or the task's first metric (``val_acc`` for classification, ``val_loss`` for
    regression)."""
    return cfg.train.monitor or f"val_{cfg.task.metrics(None)[0]}"


#: The schemas of groups added since the first release, for run folders written before them.
SCHEMAS_BEFORE = {
    "task": "runner.tasks.classification.ClassificationConfig",
    "schedule": "runner.schedule.constant.ConstantConfig",
}


#: Schemas renamed since (every schema is ``<Name>Config``), for run folders written before.
RENAMED = {
    f"runner.{module}.{old}": f"runner.{module}.{old}Config"
    for module, old in (
        ("optim.sgd", "SGD"),
        ("optim.adam", "Adam"),
        ("optim.adamw", "AdamW"),
        ("hardware.cpu", "CPU"),
        ("hardware.gpu", "GPU"),
        ("hardware.cluster", "Cluster"),
        ("hardware.slurm", "Slurm"),
    )
}


def packaged(path: str) -> str:
    """A schema's path as this version names it.

    Run folders written before the model zoo and the data sets were installed inside ``runner`` name them
    ``models.cnn.CNNConfig``, ``data.digits.DigitsConfig``; before the schemas were all named
    ``<Name>Config``, ``runner.hardware.cpu.CPU``."""
    path = f"runner.{path}" if path.split(".", 1)[0] in ("models", "data") else path
    return RENAMED.get(path, path)


def load_structured(path: str | Path, vouched: bool = False) -> DictConfig:
    """A run folder's ``config.yaml`` (written by the launcher with ``_schemas_``) as a typed config.

    The schemas it names are checked (:mod:`runner.schema.trust`) unless the launcher ``vouched`` for it."""
    from runner.schema import locate

    raw = OmegaConf.load(path)
    refuse_interpolations(raw, path)
    if "logger" not in raw:  # written before the logger group: TensorBoard alone
        raw.logger = {name: {} for name in DEFAULT_LOGGERS}
    given = raw.pop("_schemas_", None)
    if not isinstance(given, Mapping):
        raise ValueError(f"{path}: _schemas_ is missing or not a mapping: not a run folder's config.yaml")
    schemas = {**SCHEMAS_BEFORE, **{g: packaged(p) if isinstance(p, str) else p for g, p in given.items()}}
    # before importing any of them: the file may come from anywhere
    if not vouched:
        check_schemas(schemas, str(path), {TARGET_NODE: TARGET_GROUPS})
    top = OmegaConf.structured(Config)
    for group, cls_path in schemas.items():
        node = raw.pop(group, {})
        if cls_path == TARGET_NODE:
            top[group] = node
            continue
        cls = locate(cls_path)
        if not vouched:
            check_schema_class(group, cls_path, cls, str(path))
        top[group] = OmegaConf.merge(OmegaConf.structured(cls), node)
    return OmegaConf.merge(top, raw)


def refuse_interpolations(node: Any, path: str | Path, key: str = "") -> None:
    """Refuse a saved config that holds an expression rather than values.

    Expressions such as ``${oc.env:SECRET}``, ``${data.shape}``. The launcher writes values, so a folder's
    file with one was written elsewhere, and resolving it would read this machine's environment. Names the
    first key; prints no resolved value."""
    from omegaconf import DictConfig, ListConfig

    names = node.keys() if isinstance(node, DictConfig) else range(len(node))
    for name in names:
        where = f"{key}.{name}" if key else str(name)
        if OmegaConf.is_interpolation(node, name):
            raise ValueError(
                f"{path}: {where} holds an expression ({node._get_node(name)._value()}), not a value; a "
                "saved config.yaml holds values (the runner writes them resolved): write the value there "
                "by hand if you trust this run folder"
            )
        child = node._get_node(name)
        if isinstance(child, (DictConfig, ListConfig)) and not child._is_none():
            refuse_interpolations(child, path, where)


def load(path: str | Path) -> Config:
    """The checked config of a run folder's ``config.yaml``.

    What it names is checked to be of the kind its key builds before anything is built
    (:mod:`runner.schema.trust`), unless the launcher of this job wrote these very bytes
    (``MPITRAIN_CONFIG_SHA256``: the user's own input, or a folder it checked itself), so that a user's
    installed package needs no ``MPITRAIN_TRUSTED_PACKAGES`` for a run of their own."""
    vouched = os.environ.get(CONFIG_SHA_ENV) == hashlib.sha256(Path(path).read_bytes()).hexdigest()
    structured = load_structured(path, vouched)
    if not vouched:
        check_kinds(targets(OmegaConf.to_container(structured, resolve=True)), str(path))
    token = READING_RUN_FOLDER.set(True)
    try:
        return OmegaConf.to_object(structured)
    finally:
        READING_RUN_FOLDER.reset(token)
