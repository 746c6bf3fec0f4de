"""Deferred imports, so that the modules the launcher reads for their schemas do not import torch."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class LazyModule(ModuleType):
    """Stands for module ``name`` and imports it on the first attribute access (then a dictionary look-up)."""

    def __init__(self, name: str):
        super().__init__(name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.__name__), attr)


def lazy_import(name: str) -> Any:
    """``torch = lazy_import("torch")``: import torch where it is first used, not where this line runs."""
    return LazyModule(name)


def no_grad(fn: F) -> F:
    """``torch.no_grad()`` as a decorator that imports torch when called, not when the module loads."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import torch

        with torch.no_grad():
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
