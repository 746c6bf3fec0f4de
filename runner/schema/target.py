"""Options given by their class: ``{_target_: my_project.models.Net, width: 64}``.

``model=custom model._target_=my_project.models.Net`` (``conf/model/custom.yaml``) takes any importable
``torch.nn.Module``, ``optim=custom optim._target_=torch.optim.RMSprop`` any optimizer,
``task.loss._target_=...`` any loss, and ``data=dataset data.train._target_=...`` any data set. Such a node
has no schema: its other keys are the class's keyword arguments (``+model.width=64`` on the command line, or a
YAML file of the user's project); an argument that is itself a node with a ``_target_`` (``model.act:
{_target_: torch.nn.GELU}``) is built first and passed as the object, as Hydra's ``instantiate`` does. The
launcher checks that every module named can be found without importing it (nor its packages:
``torch.nn.HuberLoss`` does not import torch), and, where its source is plain, that it defines the class and
the class takes the keys given (:mod:`runner.schema.target_source`); the rank that builds the object names
the key of an argument the class does not take where the source could not tell.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from runner.schema.target_source import longest_module, missing_name, unknown_keys

TARGET = "_target_"
#: Hydra's other instantiation keys: not read here, so refused rather than passed to the class.
HYDRA_KEYS = ("_args_", "_partial_", "_recursive_", "_convert_")


@dataclass
class Target:
    """A class (or any callable) named by its dotted ``path``, with its keyword arguments ``args``.

    ``key`` is where the config holds it (``model``, ``task.loss``), for messages."""

    key: str
    path: str
    args: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, key: str, node: Any, group: str = "") -> Target:
        """Check the node at ``key`` and make it a Target; ValueError names the key and the fix.

        ``group``: the node's group, which the caller's error handling names."""
        full = f"{group}.{key}" if group else key
        if not isinstance(node, Mapping) or TARGET not in node:
            raise ValueError(
                f"{key}={node!r} is invalid: give a class with its arguments, e.g. "
                f"{full}={{_target_: my_project.module.Class}}"
            )
        path, args = node[TARGET], {k: v for k, v in node.items() if k != TARGET}
        if not isinstance(path, str) or "." not in path or not all(path.split(".")):
            raise ValueError(
                f"{key}._target_={'null' if path is None else repr(path)} is invalid: a dotted path to a "
                "class, e.g. my_project.models.Net"
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
        for name in HYDRA_KEYS:
            if name in args:
                raise ValueError(
                    f"{key}.{name} is not supported: the node's other keys are {path}'s keyword arguments; "
                    f"drop it (~{full}.{name}), or name a function of your project that returns the object"
                )
        for name, value in args.items():
            resolved(f"{key}.{name}", value, lambda at, node: Target.of(at, node, group))
        if "." not in rest and (defined := missing_name(module, rest)) is not None:
            offer = f"; it defines {', '.join(defined[:6])}" if defined else ""
            raise ValueError(
                f"{key}._target_={path}: {module} has no {rest!r} (read from its source){offer}: name a "
                f"class of it, e.g. {full}._target_={module}.{defined[0] if defined else 'Class'}"
            )
        if "." not in rest and (bad := unknown_keys(module, rest, list(args))):
            raise ValueError(
                "; ".join(f"{key}.{k}: {rest} takes no such argument ({hint})" for k, hint in bad)
                + f"; remove it with ~{full}.NAME, or give the right one with +{full}.NAME=VALUE"
            )
        return cls(full, path, args)

    def locate(self) -> Any:
        """The class: the longest prefix of the path that is a module, then its attributes.

        As in ``mod.Outer.Inner``."""
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
        return self.checked(*args)(*args, **self.kwargs())

    def build_named(self, *args: Any) -> Any:
        """:meth:`build`, with what the class raises re-raised as a ValueError naming the key.

        For data sets and nested arguments, whose traceback would not say which key made them."""
        call, kwargs = self.checked(*args), self.kwargs()
        try:
            return call(*args, **kwargs)
        except Exception as err:
            raise ValueError(f"{self.key}._target_={self.path} failed: {type(err).__name__}: {err}") from err

    def checked(self, *args: Any) -> Any:
        """The class, once known to take ``args`` and the node's keys (else a ValueError naming them)."""
        target = self.locate()
        try:
            signature = inspect.signature(target)
        except (TypeError, ValueError):
            return target
        try:
            signature.bind(*args, **self.args)
        except TypeError as err:
            keys = ", ".join(f"{self.key}.{k}" for k in self.args) or "none"
            raise ValueError(
                f"{self.key}._target_={self.path} cannot be called with the keys given ({keys}): {err}; "
                f"add or remove arguments with +{self.key}.NAME=VALUE / ~{self.key}.NAME"
            ) from None
        return target

    def kwargs(self) -> dict[str, Any]:
        """The node's keyword arguments as the class receives them (nested ``_target_`` nodes built)."""
        build = lambda at, node: Target.of(at, node).build_named()  # noqa: E731
        return {k: resolved(f"{self.key}.{k}", v, build) for k, v in self.args.items()}

    def __str__(self) -> str:
        return self.path


def find_module(path: str) -> tuple[str, str, bool]:
    """``(module, rest, package)`` of a dotted ``path``, found on the search path without importing anything.

    ``module``: its longest prefix that names a module (no package's ``__init__`` runs); ``rest``: what
    follows it; ``package``: whether that module is a package. ``module`` is empty when not even the first
    part is one."""
    found, spec = longest_module(path)
    if spec is None:
        return "", path, False
    parts = path.split(".")
    return ".".join(parts[:found]), ".".join(parts[found:]), spec.submodule_search_locations is not None


def resolved(key: str, value: Any, target: Callable[[str, Mapping[str, Any]], Any]) -> Any:
    """The argument ``value`` at ``key``, each ``_target_`` node replaced by ``target(its key, the node)``.

    A node that has a ``_target_``, at any depth of dicts and lists, not inside such a node. Config containers
    are made plain."""
    if isinstance(value, Mapping):
        if TARGET in value:
            return target(key, value)
        return {k: resolved(f"{key}.{k}", v, target) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [resolved(f"{key}.{i}", v, target) for i, v in enumerate(value)]
    return value


def of_node(key: str, node: Any) -> Any:
    """``node`` as a :class:`Target` when it names its class (a mapping with ``_target_``), else as it is."""
    return Target.of(key, node) if isinstance(node, Mapping) and TARGET in node else node
