"""Defer ``torch._dynamo``'s import (about a second of every rank's start) until something compiles.

Every ``torch.optim`` optimizer imports ``torch._dynamo`` on its first call, only to wrap its methods in
``torch._dynamo.disable`` and to call ``torch._dynamo.graph_break()`` around each ``step``: both do nothing
in eager mode, which is how a rank trains. :func:`defer` puts :class:`Deferred` in its place: it answers
those two calls with eager mode's behaviour and imports the real package, in its place, as soon as
anything else is asked of it (``torch.compile``, an attribute, a submodule). Functions ``disable`` wrapped
before then call the real ``disable`` once it is loaded, so compiling later behaves as usual.
"""

from __future__ import annotations

import functools
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Callable
from typing import Any

NAME = "torch._dynamo"


def real() -> types.ModuleType | None:
    """The real ``torch._dynamo`` if it is imported, else None."""
    module = sys.modules.get(NAME)
    return None if module is None or isinstance(module, Deferred) else module


def load() -> types.ModuleType:
    """Import the real ``torch._dynamo`` in the deferred one's place (``sys.modules`` and ``torch``)."""
    module = real()
    if module is not None:
        return module
    sys.modules.pop(NAME, None)
    import torch

    torch.__dict__.pop("_dynamo", None)
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _Submodules)]
    return importlib.import_module(NAME)


class Deferred(types.ModuleType):
    """``torch._dynamo`` before its import: eager mode's ``graph_break`` and ``disable``.

    Anything else imports the real package and is answered by it."""

    def __init__(self, spec: importlib.machinery.ModuleSpec):
        super().__init__(NAME)
        self.__spec__ = spec
        self.__file__ = spec.origin
        self.__package__ = NAME
        self.__path__ = list(spec.submodule_search_locations or [])

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") and attr.endswith("__"):  # tools that scan sys.modules: no import
            raise AttributeError(attr)
        return getattr(load(), attr)

    def graph_break(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to break outside a compiled region; the real one once it is loaded."""
        module = real()
        if module is not None:
            module.graph_break(*args, **kwargs)

    def disable(self, fn: Callable | None = None, recursive: bool = True, **kwargs: Any) -> Any:
        """``fn`` as it is while nothing compiles, else through the real ``disable(fn)``.

        The real one is used from the first call after the real package is loaded."""
        if fn is None:
            return functools.partial(self.disable, recursive=recursive, **kwargs)
        disabled: Callable | None = None

        def call(*args: Any, **kw: Any) -> Any:
            nonlocal disabled
            module = real()
            if module is None:
                return fn(*args, **kw)
            if disabled is None:
                disabled = module.disable(fn, recursive, **kwargs)
            return disabled(*args, **kw)

        return functools.wraps(fn)(call) if kwargs.get("wrapping", True) else call


class _Existing(importlib.abc.Loader):
    """Loads a module that is already imported: the one in ``sys.modules``, left as it is."""

    def __init__(self, module: types.ModuleType):
        self.module, self.spec = module, module.__spec__

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return self.module

    def exec_module(self, module: types.ModuleType) -> None:
        module.__spec__ = self.spec  # the import system set ours on it


class _Submodules(importlib.abc.MetaPathFinder):
    """Imports the real package before any of its submodules (``import torch._dynamo.config``).

    This way no submodule is executed twice."""

    def find_spec(
        self, fullname: str, path: Any, target: Any = None
    ) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith(NAME + ".") or real() is not None:
            return None
        load()
        module = importlib.import_module(fullname)
        return importlib.util.spec_from_loader(fullname, _Existing(module))


def defer() -> bool:
    """Put :class:`Deferred` in the place of ``torch._dynamo`` unless it is imported already.

    Returns whether it did."""
    if NAME in sys.modules:
        return False
    import torch

    spec = importlib.util.find_spec(NAME)
    if spec is None:  # a torch without dynamo: nothing to defer
        return False
    deferred = Deferred(spec)
    sys.modules[NAME] = deferred
    torch._dynamo = deferred  # type: ignore[attr-defined]
    sys.meta_path.insert(0, _Submodules())
    return True
