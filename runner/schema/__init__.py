"""Typed configuration: one dataclass per option holds its defaults and its checks, and builds its object.

A YAML option of group ``G`` (``conf/G/NAME.yaml``) extends the schema of one module with
``defaults: [/schema/G/MODULE@_here_, _self_]`` and may override some of its defaults (``resnet50.yaml``
sets ``depth: 50`` over ``models/resnet.py``); it declares no key of its own. The schema of
``schema/G/MODULE`` is the one dataclass in ``PACKAGES[G].MODULE`` that subclasses the group's base class
below. :class:`runner.schema.source.SchemaSource` gives Hydra these schemas on demand, so composing a
config imports only the modules of the options it selects, and every module imports torch only where it
builds its object: the launcher checks a config without importing torch, scikit-learn or MPI, and the
ranks, which read the schemas without composing, import no Hydra.

Checks live in ``__post_init__`` and raise ``ValueError`` through :func:`require`, naming the key
relative to the group (``validate`` adds the group) and the fix; ``validate`` runs them within
:func:`collected`, so that every independent problem of a config is told at once. Checks that involve
other groups are methods of the base classes (``RuleConfig.check_devices``).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import pkgutil
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch


#: The types a rule may exchange parameters and gradients in (``rule.comm_dtype``; runner/comm/wire.py).
WIRE_NAMES = ("fp32", "bf16", "fp16")
#: The most chunks a worker takes in one call on the dealer's counter (``data.chunks_per_draw``); the
#: dealer's published rows have room for as many (runner/rank/assignment.py, HELD_SLOTS).
MAX_CHUNKS_PER_DRAW = 8


#: Within :func:`collected`: the ("key=value", message) of each check failed so far, which :func:`require`
#: adds to instead of raising.
_FAILED: ContextVar[list[tuple[str, str]] | None] = ContextVar("mpitrain_failed_checks", default=None)


#: True while a run folder's ``config.yaml`` is read into schema objects (:func:`runner.schema.config.load`:
#: the ranks, ``eval=``, ``python -m runner.sample``): a data set then fetches and writes nothing where the
#: file says (a folder from elsewhere is data, and its paths no place to write).
READING_RUN_FOLDER: ContextVar[bool] = ContextVar("mpitrain_reading_run_folder", default=False)


def require(ok: bool, key: str, value: Any, hint: str) -> None:
    """Raise a ValueError naming ``key`` (relative to its group) unless ``ok``.

    Within :func:`collected`, record it and go on to the next check."""
    if ok:
        return
    shown = "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)
    setting = f"{key}={shown}"  # (as the command line writes it: null, true)
    failed = _FAILED.get()
    if failed is None:
        raise ValueError(f"{setting} is invalid: {hint}")
    failed.append((setting, f"{setting} is invalid: {hint}"))


class ConfigErrors(ValueError):
    """Several independent problems of one config, a line each (one problem reads as its line alone)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        text = (
            self.problems[0]
            if len(self.problems) == 1
            else f"{len(self.problems)} settings are invalid:\n{lines}"
        )
        super().__init__(text)

    def __reduce__(self) -> tuple[type, tuple[list[str]]]:
        return type(self), (self.problems,)


@contextmanager
def raising() -> Iterator[None]:
    """Within, :func:`require` raises, also inside :func:`collected`.

    For a check made on the way to another key's value, which it must not be counted against: a data set's
    files read for a model's shape."""
    token = _FAILED.set(None)
    try:
        yield
    finally:
        _FAILED.reset(token)


@contextmanager
def collected(prefix: str, problems: list[str]) -> Iterator[None]:
    """Run checks that may each fail without stopping the others.

    Every :func:`require` failed within is added to ``problems`` as ``prefix`` + its message, once per setting
    (a key's later checks of the same value assume its first passed). A ValueError raised within is added too;
    but once a check has failed, whatever is raised after it (a check or a computation that needed the failed
    one to pass) is dropped. Other exceptions are raised."""
    failed: list[tuple[str, str]] = []
    token = _FAILED.set(failed)
    try:
        yield
    except ValueError as err:
        if not failed:
            failed.append(("", str(err)))
    except Exception:
        if not failed:
            raise
    finally:
        _FAILED.reset(token)
    told: set[str] = set()
    for setting, message in failed:
        if not setting or setting not in told:
            problems.append(prefix + message)
        told.add(setting)


def raise_problems(problems: list[str]) -> None:
    """Raise the ``problems`` found (:func:`collected`) as one ValueError, a line each; none: nothing."""
    if problems:
        raise ConfigErrors(problems)


def option_name(schema: type) -> str:
    """The option a schema class belongs to, as users select it: ``BSPConfig`` of rules/bsp.py -> ``bsp``."""
    return schema.__module__.rsplit(".", 1)[-1]


def one_of(key: str, value: Any, choices: tuple[str, ...]) -> None:
    require(value in choices, key, value, "choose one of " + ", ".join(choices))


@dataclass
class RuleConfig:
    """Base of the synchronization rules' schemas (``runner/rules/``).

    ``comm_dtype``: the type parameters and gradients travel in, fp32 or a 16-bit bf16|fp16 with float32 sums
    (runner/comm/wire.py)."""

    comm_dtype: str = "fp32"

    def __post_init__(self) -> None:
        one_of("comm_dtype", self.comm_dtype, WIRE_NAMES)

    def extra_ranks(self) -> int:
        """Ranks the rule needs besides the ``devices`` workers (parameter or center servers)."""
        return 0

    def check_devices(self, devices: int) -> None:
        """Checks that involve the number of workers; raise ValueError through :func:`require`."""

    def check_model(self, model: ModelConfig) -> None:
        """Checks that involve the model; raise ValueError naming the key and the fix."""

    def check_optim(self, optim: Any) -> None:
        """Checks that involve the optimizer; raise ValueError naming the key and the fix.

        ``optim``: its schema object (e.g. a rule that needs Adam's moments)."""

    def asynchronous(self) -> bool:
        """Whether the workers train without stepping together (then they may take the data dynamically)."""
        return False

    def build(self, ctx: Any) -> Any:
        """The rule (a :class:`runner.rules.base.Rule`) for ``ctx`` (a ``RuleContext``)."""
        raise NotImplementedError


@dataclass
class ModelConfig:
    """Base of the models' schemas (``models/``): the input shape and class count.

    Both are interpolated from the data set's outputs by the YAML (``input_shape: ${data.shape}``)."""

    input_shape: list[int] = field(default_factory=lambda: [1, 8, 8])
    num_classes: int = 10

    def __post_init__(self) -> None:
        require(
            self.input_shape is not None
            and len(self.input_shape) >= 1
            and all(s >= 1 for s in self.input_shape),
            "input_shape",
            self.input_shape,
            "a list of positive sizes, e.g. [3, 32, 32]: it comes from data.shape, which data=dataset needs "
            "given (one input's shape, e.g. data.shape=[3,32,32])",
        )
        require(self.num_classes >= 1, "num_classes", self.num_classes, "must be >= 1")

    def require_image(self, min_size: int = 1) -> None:
        """For image models: ``input_shape`` is [C, H, W] with H and W at least ``min_size``.

        Smaller images leave an empty feature map inside the network. Checked before any rank starts."""
        name = type(self).__name__.removesuffix("Config")
        require(
            len(self.input_shape) == 3,
            "input_shape",
            self.input_shape,
            f"{name} expects [C, H, W] images (it comes from data.shape; token sequences need model=gpt or "
            "model=lstm)",
        )
        c, size = self.input_shape[0], max(8, 1 << (min_size - 1).bit_length())
        require(
            min(self.input_shape[1:]) >= min_size,
            "input_shape",
            self.input_shape,
            f"{name} needs height and width >= {min_size}: use larger images (e.g. data=synthetic "
            f"data.shape=[{c},{size},{size}], or data=imagefolder data.image_size={size}) or a model for "
            "small images (model=cnn, model=mlp, model=resnet18)",
        )

    def build(self) -> torch.nn.Module:
        raise NotImplementedError


@dataclass
class DataConfig:
    """Base of the data sets' schemas (``data/``).

    ``shape`` and ``num_classes`` describe what the data set yields; models read them. Where a data set fixes
    them, they are outputs and a different value is an error: fixed in its code (``digits``), or read from its
    files when the config is checked, through the default ``${mpitrain_data:KEY}`` (:meth:`files_outputs`).
    Where it takes them as settings (``synthetic``), they are inputs."""

    #: The keys that name files or folders: the launcher writes them absolute into the run folder's
    #: config.yaml (read from the folder the command ran in), so eval=, resume= and sample read the same
    #: files from anywhere.
    PATHS: ClassVar[tuple[str, ...]] = ()

    shape: list[int] = field(default_factory=lambda: [1, 8, 8])
    num_classes: int = 10
    assignment: str = "auto"  # static, dynamic, or auto: dynamic for asynchronous rules (rank/assignment.py)
    chunks_per_draw: int | None = None  # dynamic: chunks taken in one call on the counter (null: workers / 8)

    def absolute_paths(self) -> dict[str, str]:
        """Those of :data:`PATHS` given relative, made absolute from the current folder."""
        out = {}
        for key in self.PATHS:
            value = getattr(self, key)
            if isinstance(value, str) and value and not os.path.isabs(os.path.expanduser(value)):
                out[key] = os.path.abspath(value)
        return out

    def dynamic(self, asynchronous: bool) -> bool:
        """Whether the workers take chunks from a shared counter (``dynamic``) rather than fixed shards.

        Raises ValueError for a setting that cannot work. ``asynchronous``: the rule's workers do not step
        together."""
        one_of("assignment", self.assignment, ("auto", "static", "dynamic"))
        block = self.chunks_per_draw
        if block is not None and not (isinstance(block, int) and 1 <= block <= MAX_CHUNKS_PER_DRAW):
            raise ValueError(
                f"data.chunks_per_draw={block!r} is invalid: use 1 to {MAX_CHUNKS_PER_DRAW} chunks a call on "
                "the dealer's counter, or null (one per 8 workers)"
            )
        if self.assignment == "dynamic" and not asynchronous:
            raise ValueError(
                "assignment='dynamic' is invalid with this rule: its workers step together, so they take "
                "equal shares; use data.assignment=static (or auto), or an asynchronous rule (rule=gosgd, "
                "rule=asgd, rule=easgd rule.variant=async)"
            )
        return asynchronous and self.assignment != "static"

    def draw_block(self, workers: int) -> int:
        """Chunks a worker takes in one call on the dealer's counter (``chunks_per_draw``) among ``workers``.

        Null: one per 8 workers, so that the counter's host serves about as many calls a second at any size
        (up to :data:`MAX_CHUNKS_PER_DRAW`, at 57 workers and more)."""
        if self.chunks_per_draw is not None:
            return self.chunks_per_draw
        return min(MAX_CHUNKS_PER_DRAW, -(-workers // 8))

    @classmethod
    def files_outputs(cls, settings: Any) -> dict[str, Any]:
        """``shape`` and ``num_classes`` read from the files ``settings`` names, cheaply and without torch.

        For data sets whose files fix them; ``settings``: the option's config node, or the schema object. The
        resolver ``${mpitrain_data:KEY}`` (``runner.data``) gives them as the keys' values. Where the files
        cannot be read (no path yet, a wrong one), stand-ins that let the other groups be checked:
        ``__post_init__`` then says what is wrong."""
        raise NotImplementedError(f"{cls.__name__} reads no shape or class count from files")

    def fill_outputs(self) -> None:
        """Keys still ``${mpitrain_data:KEY}`` get the value the files hold.

        Such keys remain in a schema made in Python, without OmegaConf."""
        for key in ("shape", "num_classes"):
            if isinstance(getattr(self, key), str):
                setattr(self, key, type(self).files_outputs(self)[key])

    @staticmethod
    def require_workers(workers: int | None) -> None:
        """Check ``workers``: background loader processes per rank, or None to decide on each rank.

        None decides from the cores the rank is bound to (``runner.data.base.loader_workers``)."""
        require(
            workers is None or workers >= 0,
            "workers",
            workers,
            "background loader processes per rank, >= 0 (0: load in the training process), or null to "
            "decide by the cores each rank is bound to",
        )

    def name(self) -> str:
        """What ``summary.json`` calls the data set (``runner.data.digits.Digits``)."""
        return f"{type(self).__module__}.{type(self).__qualname__.removesuffix('Config')}"

    def require_outputs(self, shape: list[int], num_classes: int) -> None:
        """For data sets whose shape and class count are fixed: refuse any other value."""
        name = type(self).__name__
        require(
            list(self.shape) == list(shape), "shape", self.shape, f"{name} yields {shape}; leave it unset"
        )
        require(
            self.num_classes == num_classes,
            "num_classes",
            self.num_classes,
            f"{name} has {num_classes} classes; leave it unset",
        )

    def build(self) -> Any:
        """The data set (a :class:`runner.data.base.ClassificationData`)."""
        raise NotImplementedError


#: Group -> (package of its option modules, base class of its schemas).
GROUPS: dict[str, tuple[str, str]] = {
    "rule": ("runner.rules", "runner.schema.RuleConfig"),
    "model": ("runner.models", "runner.schema.ModelConfig"),
    "data": ("runner.data", "runner.schema.DataConfig"),
    "optim": ("runner.optim", "runner.optim.OptimConfig"),
    "schedule": ("runner.schedule", "runner.schedule.ScheduleConfig"),
    "task": ("runner.tasks", "runner.tasks.TaskConfig"),
    "hardware": ("runner.hardware", "runner.hardware.base.HardwareConfig"),
    "logger": ("runner.schema.logger", "runner.schema.logger.LoggerConfig"),  # several: logger=[a,b]
}


def locate(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def schema_of(group: str, module_name: str) -> type:
    """The schema dataclass of ``schema/<group>/<module_name>``.

    The one subclass of the group's base class defined in that module (of the group's package, or any
    importable module given by its dotted path, such as ``my_project.nets``)."""
    package, base_path = GROUPS[group]
    module = importlib.import_module(module_name if "." in module_name else f"{package}.{module_name}")
    base = locate(base_path)
    found = [
        obj
        for obj in vars(module).values()
        if inspect.isclass(obj) and issubclass(obj, base) and obj.__module__ == module.__name__
    ]
    if len(found) != 1:
        raise ValueError(
            f"{module.__file__}: expected exactly one subclass of {base.__name__} (the option's schema), "
            f"found {len(found)}"
        )
    return found[0]


def option_modules(group: str) -> list[str]:
    """Names of the modules of a group's package, without importing them."""
    package = importlib.import_module(GROUPS[group][0])
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__) if not m.name.startswith("_"))
