"""Structured-config schemas: a misspelt key or a wrong type fails when Hydra composes the config.

The top-level :class:`Config` is the schema of ``conf/config.yaml``. Each rule, model and data set module
declares the schema of its own YAML options as a dataclass named in its module attribute ``SCHEMA``; it is
registered here as ``schema/<group>/<module>`` and a YAML option extends it with
``defaults: [/schema/<group>/<module>@_here_, _self_]``. Value checks live in ``__post_init__`` and run
in the launcher (:func:`validate`) before any process is started.
"""

from __future__ import annotations

import importlib
import pkgutil
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from runner.checks import one_of, require
from runner.slurm import register_launcher

#: Group name -> package whose modules carry the schemas of that group's options.
SCHEMA_PACKAGES = {"rule": "runner.rules", "model": "models", "data": "data"}


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


@dataclass
class HardwareConfig:
    """How ranks are started and placed: the mpirun command, binding, device and threads."""

    device: str = "cpu"
    mpirun: str | None = None
    flavor: str = "auto"
    bind: str = "core"
    threads_per_rank: int | None = None
    report_bindings: bool = True
    mca: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)
    multi_node: bool = False
    hosts: list[str] = field(default_factory=list)
    hostfile: str | None = None
    cuda_aware: bool | None = None
    gpus_per_node: int | None = None
    ranks_per_gpu: int = 1
    slurm: bool = False
    launcher: str = "mpirun"
    srun_mpi: str = "pmix"

    def __post_init__(self) -> None:
        require(
            not (self.hosts and self.hostfile),
            "hosts",
            self.hosts,
            "give hardware.hosts or hardware.hostfile",
        )
        require(
            not self.multi_node or bool(self.hosts or self.hostfile),
            "hosts",
            self.hosts,
            "hardware=cluster needs hardware.hosts=[host1:slots,host2:slots] or hardware.hostfile=FILE",
        )
        require(
            all(re.fullmatch(r"[\w.-]+(:\d+)?", h) for h in self.hosts),
            "hosts",
            self.hosts,
            "each entry is host or host:slots, e.g. node1:4",
        )
        require(
            self.hostfile is None or Path(self.hostfile).is_file(),
            "hostfile",
            self.hostfile,
            "no such file; an Open MPI hostfile has lines like `node1 slots=4`",
        )
        one_of("launcher", self.launcher, ("auto", "mpirun", "srun"))
        require(
            self.slurm or self.launcher == "mpirun",
            "launcher",
            self.launcher,
            "srun starts ranks inside a Slurm allocation: use hardware=slurm (or hardware.launcher=mpirun)",
        )
        require(
            not (self.slurm and (self.hosts or self.hostfile)),
            "hosts",
            self.hosts,
            "under Slurm the allocation gives the hosts; drop hardware.hosts/hostfile",
        )
        one_of("device", self.device, ("cpu", "cuda"))
        require(
            self.gpus_per_node is None or self.gpus_per_node >= 1,
            "gpus_per_node",
            self.gpus_per_node,
            "use null (every visible GPU) or a positive count",
        )
        require(self.ranks_per_gpu >= 1, "ranks_per_gpu", self.ranks_per_gpu, "at least one rank per GPU")
        one_of("flavor", self.flavor, ("auto", "openmpi", "mpich"))
        one_of("bind", self.bind, ("core", "socket", "numa", "none"))
        require(
            self.threads_per_rank is None or self.threads_per_rank >= 1,
            "threads_per_rank",
            self.threads_per_rank,
            "use null (cores / ranks) or a positive count",
        )


@dataclass
class SGDConfig:
    """Schema of ``conf/optim/sgd.yaml``: the arguments of ``torch.optim.SGD`` (params are passed in code)."""

    _target_: str = "torch.optim.SGD"
    lr: float = 0.05
    momentum: float = 0.0
    dampening: float = 0.0
    weight_decay: float = 0.0
    nesterov: bool = False

    def __post_init__(self) -> None:
        require(self.lr >= 0, "lr", self.lr, "the learning rate must be >= 0 (e.g. optim.lr=0.05)")
        require(0 <= self.momentum < 1, "momentum", self.momentum, "momentum must be in [0, 1)")
        require(self.weight_decay >= 0, "weight_decay", self.weight_decay, "must be >= 0")
        require(
            not self.nesterov or (self.momentum > 0 and self.dampening == 0),
            "nesterov",
            self.nesterov,
            "Nesterov momentum needs momentum > 0 and dampening = 0",
        )


@dataclass
class Config:
    """Schema of ``conf/config.yaml``."""

    devices: int = 2
    train: TrainConfig = field(default_factory=TrainConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    model: Any = MISSING
    data: Any = MISSING
    rule: Any = MISSING
    optim: Any = MISSING

    def __post_init__(self) -> None:
        require(
            isinstance(self.devices, int) and self.devices >= 1,
            "devices",
            self.devices,
            "the number of worker ranks must be >= 1 (e.g. devices=2)",
        )


def register_schemas() -> None:
    """Store every schema in Hydra's ConfigStore (idempotent)."""
    cs = ConfigStore.instance()
    cs.store(name="schema", node=Config)
    register_launcher()
    cs.store(group="schema/optim", name="sgd", node=SGDConfig)
    for group, package in SCHEMA_PACKAGES.items():
        pkg = importlib.import_module(package)
        for info in pkgutil.iter_modules(pkg.__path__):
            module = importlib.import_module(f"{package}.{info.name}")
            schema = getattr(module, "SCHEMA", None)
            if schema is not None:
                cs.store(group=f"schema/{group}", name=info.name, node=schema)


def validate(cfg: DictConfig) -> Config:
    """Check every value (the schemas' ``__post_init__``); a ValueError names the full key.

    Returns the config as schema objects (dataclass instances), interpolations resolved. A rule schema may
    define ``check_devices(devices)`` for checks that involve the number of workers.
    """
    missing = OmegaConf.missing_keys(cfg)
    if missing:
        keys = ", ".join(sorted(missing))
        raise ValueError(f"{keys}: no value given; set it on the command line, e.g. {sorted(missing)[0]}=...")
    for key in ("train", "hardware", "model", "data", "rule", "optim"):
        try:
            OmegaConf.to_object(cfg[key])
        except ValueError as err:
            raise ValueError(f"{key}.{err}") from None
    checked = OmegaConf.to_object(cfg)
    check_devices = getattr(checked.rule, "check_devices", None)
    if check_devices is not None:
        try:
            check_devices(checked.devices)
        except ValueError as err:
            raise ValueError(f"rule.{err}") from None
    return checked


register_schemas()
