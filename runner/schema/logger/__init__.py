"""The ``logger`` group: where a run's records go besides ``metrics.jsonl``, several at once.

``logger`` is a list-valued group (Hydra 1.1+): ``logger=[tensorboard,mlflow]`` selects two options, and the
config holds one node per option under its name (``logger.mlflow.experiment``); ``logger=[]`` selects none.
Each option's schema is the one :class:`LoggerConfig` subclass of ``runner/schema/logger/<name>.py``,
selected by ``conf/logger/<name>.yaml``; the ranks' side (:mod:`runner.rank.records.tracking`) writes the
records.
Nothing here imports torch or a tracking package: :meth:`LoggerConfig.check_installed` only looks for it.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from runner.schema import option_modules, option_name, require, schema_of

#: The loggers of a run folder written before the group existed (``runner.schema.config.load_structured``).
DEFAULT_LOGGERS = ("tensorboard",)


@dataclass
class LoggerConfig:
    """Base of the loggers' schemas.

    ``package``: the module the logger imports on the writing rank, which the optional dependency of the same
    name installs (``pip install "mpitrain[mlflow]"``); None for a logger installed with mpitrain."""

    package: ClassVar[str | None] = None

    def require(self, ok: bool, key: str, value: Any, hint: str) -> None:
        """:func:`runner.schema.require` for a key of this logger: named ``<logger>.<key>`` in the group."""
        require(ok, f"{option_name(type(self))}.{key}", value, hint)

    def check_installed(self) -> None:
        """Raise ValueError naming the option and the install command when its package is missing.

        The launcher asks, before any process starts."""
        if self.package is None or importlib.util.find_spec(self.package) is not None:
            return
        name = option_name(type(self))
        raise ValueError(
            f"logger={name} needs the {self.package} package, which is not installed: "
            f'pip install -e ".[{name}]" in a checkout of mpitrain, or pip install "mpitrain[{name}]" where '
            f"it was installed as a package (or leave {name} out of logger=[...])"
        )


def logger_names() -> list[str]:
    """The loggers one may select (``conf/logger/*.yaml``, one module of this package each)."""
    return option_modules("logger")


def as_loggers(node: Mapping[str, Any]) -> dict[str, LoggerConfig]:
    """``name -> schema object`` of a config's ``logger`` node.

    A node read without its schema (a run folder's config.yaml on the ranks) is made one by its name. Raises
    ValueError for a name that is no logger."""
    out = {}
    for name, value in node.items():
        if isinstance(value, LoggerConfig):
            out[name] = value
            continue
        if name not in logger_names():
            raise ValueError(
                f"logger.{name}: no such logger; choose among {', '.join(logger_names())}, several at once "
                "as a list (e.g. logger=[tensorboard,mlflow])"
            )
        out[name] = schema_of("logger", name)(**dict(value or {}))
    return out
