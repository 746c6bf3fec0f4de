"""Options given by their class: ``{_target_: my_project.models.Net, width: 64}``.

``model=custom model._target_=my_project.models.Net`` (``conf/model/custom.yaml``) takes any importable
``torch.nn.Module``, ``optim=custom optim._target_=torch.optim.RMSprop`` any optimizer, and
``task.loss._target_=...`` any loss. Such a node has no schema: its other keys are the class's keyword
arguments (``+model.width=64`` on the command line, or a YAML file of the user's project). The launcher checks
that the module can be found without importing it (nor its packages: ``torch.nn.HuberLoss`` does not import
torch); the rank that builds the object names the key of an
argument the class does not take.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TARGET = "_target_"


@dataclass
class Target:
    """A class (or any callable) named by its dotted ``path``, with its keyword arguments ``args``; ``key``
    is where the config holds it (``model``, ``task.loss``), for messages."""

    key: str
    path: str
    args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, key: str, node: Any, group: str = "") -> Target:
        """Check the node at ``key`` (of ``group``, which the caller's error handling names) and make it a
        Target; ValueError names the key and the fix."""
        if not isinstance(node, Mapping) or TARGET not in node:
            raise ValueError(
                f"{key}={node!r} is invalid: give a class with its arguments, e.g. "
                f"{key}={{_target_: my_project.module.Class}}"
            )
        path, args = node[TARGET], {k: v for k, v in node.items() if k != TARGET}
        if not isinstance(path, str) or "." not in path or not all(path.split(".")):
            raise ValueError(
                f"{key}._target_={path!r} is invalid: a dotted path to a class, e.g. my_project.models.Net"
            )
        module, rest, package = find_module(path)
        if not module or (package and "." in rest):
            wanted = path.rpartition(".")[0] if not module else f"{module}.{rest.partition('.')[0]}"
            raise ValueError(
                f"{key}._target_={path}: no module {wanted!r} can be found from here; run from your "
                "project's folder or add it to PYTHONPATH"
            )
        if not rest:
            raise ValueError(f"{key}._target_={path} is a module: name a class in it")
        return cls(f"{group}.{key}" if group else key, path, args)

    def locate(self) -> Any:
        """The class: the longest prefix of the path that is a module, then its attributes
        (``mod.Outer.Inner``)."""
        module, rest, _ = find_module(self.path)
        found: Any = importlib.import_module(module)
        for name in rest.split("."):
            try:
                found = getattr(found, name)
            except AttributeError:
                raise ValueError(
                    f"{self.key}._target_={self.path}: {found.__name__} has no {name!r}"
                ) from None
        return found

    def build(self, *args: Any) -> Any:
        """Call the class with ``args`` (such as an optimizer's parameters) and the node's keyword arguments.
        An argument it does not take, or one it needs and was not given, is a ValueError naming the key."""
        target = self.locate()
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            signature = None
        if signature is not None:
            try:
                signature.bind(*args, **self.args)
            except TypeError as err:
                keys = ", ".join(f"{self.key}.{k}" for k in self.args) or "none"
                raise ValueError(
                    f"{self.key}._target_={self.path} cannot be called with the keys given ({keys}): {err}; "
                    f"add or remove arguments with +{self.key}.NAME=VALUE / ~{self.key}.NAME"
                ) from None
        return target(*args, **self.args)

    def __str__(self) -> str:
        return self.path


def find_module(path: str) -> tuple[str, str, bool]:
    """``(module, rest, package)`` of a dotted ``path``: its longest prefix that names a module, found on
    the search path without importing anything (no package's ``__init__`` runs), what follows it, and
    whether that module is a package. ``module`` is empty when not even the first part is one."""
    parts = path.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return "", path, False
    found = 1
    while found < len(parts) and spec.submodule_search_locations is not None:
        name = ".".join(parts[: found + 1])
        sub = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
        if sub is None:
            break
        spec, found = sub, found + 1
    return ".".join(parts[:found]), ".".join(parts[found:]), spec.submodule_search_locations is not None


def of_node(key: str, node: Any) -> Any:
    """``node`` as a :class:`Target` when it names its class (a mapping with ``_target_``), else as it is."""
    return Target.of(key, node) if isinstance(node, Mapping) and TARGET in node else node
