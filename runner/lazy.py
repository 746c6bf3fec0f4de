"""Deferred imports, so that the modules the launcher reads for their schemas do not import torch."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any


class LazyModule(ModuleType):
    """Stands for module ``name`` and imports it on the first attribute access (then a dictionary look-up)."""

    def __init__(self, name: str):
        super().__init__(name)

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self.__name__), attr)


def lazy_import(name: str) -> Any:
    """``torch = lazy_import("torch")``: import torch where it is first used, not where this line runs."""
    return LazyModule(name)
