"""Files from outside are data, never code: what a run folder's ``config.yaml`` may name.

A run folder travels (copied from a cluster, shared by a colleague, downloaded), and ``resume=RUN_DIR`` and
``eval=RUN_DIR`` build what its ``config.yaml`` names. Before anything is built:

- ``_schemas_`` may name only the runner's schemas (``runner.models.cnn.CNNConfig``: a module of the group's
  package) or a schema module of the user's project (a module found from the working folder, PYTHONPATH or
  an editable install, not the standard library nor an installed library) that defines the class; the class
  must then be a dataclass subclassing the group's base.
- every ``_target_`` must be the kind of object its key builds, checked without calling it: ``model`` a
  ``torch.nn.Module`` class, ``optim`` a ``torch.optim.Optimizer`` class, ``task.loss`` a ``torch.nn.Module``
  class or a function of ``torch.nn.functional``, ``data.train`` / ``data.val`` a ``torch.utils.data.Dataset``
  class or a class or function of the user's project; any other node (an argument given as a node,
  ``model.act: {_target_: torch.nn.GELU}``) a class of torch, a plain data type of the standard library, or a
  class or function of the user's project. Targets in the standard library (``os.system``, ``subprocess.run``,
  ``builtins.eval``) are refused before their module is imported.

:func:`check_schemas` and :func:`check_paths` import nothing (the launcher calls them); :func:`check_kinds`
imports the targets' modules and torch (``python -m runner.schema.trust CONFIG`` runs it for the launcher,
and the ranks' :func:`runner.schema.config.load` calls it). A refusal is a ValueError naming the key, the
target and the fix.
"""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.util
import inspect
import os
import site
import sys
import sysconfig
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from runner.schema.target import TARGET, find_module

#: Installed packages (top-level names, comma-separated) to treat as the user's project.
TRUSTED_ENV = "MPITRAIN_TRUSTED_PACKAGES"

#: The object each key with a ``_target_`` builds; any other key's node is an ``argument``.
KINDS = {
    "model": "model",
    "optim": "optimizer",
    "task.loss": "loss",
    "data.train": "dataset",
    "data.val": "dataset",
}
WANTED = {
    "model": "a torch.nn.Module class",
    "optimizer": "a torch.optim.Optimizer class",
    "loss": "a torch.nn.Module class or a function of torch.nn.functional",
    "dataset": "a torch.utils.data.Dataset class, or a class or function of your project",
    "argument": "a class of torch, a plain data type, or a class or function of your project",
}
#: Classes of the standard library an argument node may name: plain data, nothing that runs anything.
DATA_TYPES = frozenset(
    [f"builtins.{t}" for t in ("dict", "list", "tuple", "set", "frozenset", "int", "float", "complex", "str")]
    + [f"builtins.{t}" for t in ("bool", "bytes", "range", "slice")]
    + ["collections.OrderedDict", "collections.Counter", "collections.deque", "fractions.Fraction"]
    + ["decimal.Decimal", "datetime.date", "datetime.datetime", "datetime.timedelta"]
)
#: Top-level packages whose classes an argument node may name (layers, transforms).
TORCH_PACKAGES = ("torch", "torchvision", "torchaudio", "torchtext")
TRUST_FIX = (
    "a run folder's config.yaml is data, never code: if you trust this run folder and mean it, edit its "
    "config.yaml; else give the key a class of your project (run from your project's folder)"
)


def refused(where: str, key: str, path: str, why: str) -> ValueError:
    """The refusal of ``key: path`` in the file ``where``, with the fix."""
    return ValueError(f"{where}: {key}={path} is refused: {why}; {TRUST_FIX}")


def targets(node: Any, key: str = "") -> list[tuple[str, str, str]]:
    """``(key, kind, path)`` of every node with a ``_target_`` in a plain config container, at any depth.

    Arguments given as nodes too; outermost first."""
    found: list[tuple[str, str, str]] = []
    if isinstance(node, Mapping):
        if node.get(TARGET) is not None:
            found.append((f"{key}.{TARGET}", KINDS.get(key, "argument"), str(node[TARGET])))
        for name, value in node.items():
            if name != TARGET:
                found += targets(value, f"{key}.{name}" if key else str(name))
    elif isinstance(node, Sequence) and not isinstance(node, (str, bytes)):
        for i, value in enumerate(node):
            found += targets(value, f"{key}.{i}")
    return found


def top_module(path: str) -> str:
    return path.split(".", 1)[0]


def in_stdlib(path: str) -> bool:
    """Whether the dotted ``path`` is in the standard library (found by name, nothing imported)."""
    return top_module(path) in sys.stdlib_module_names or top_module(path) == "__main__"


def check_paths(found: list[tuple[str, str, str]], where: str) -> None:
    """Refuse targets of the standard library (but plain data types as arguments) without importing anything.

    Nothing there is a model, an optimizer, a loss or a data set."""
    for key, kind, path in found:
        if not all(part.isidentifier() for part in path.split(".")) or "." not in path:
            raise refused(where, key, path, "not a dotted path to a class, e.g. my_project.models.Net")
        if find_module(path)[0] == "":
            raise ValueError(
                f"{where}: {key}={path}: no module of it can be found from here; run from your project's "
                "folder or add it to PYTHONPATH"
            )
        if in_stdlib(path) and not (kind == "argument" and path in DATA_TYPES):
            raise refused(
                where,
                key,
                path,
                f"{key.removesuffix('.' + TARGET)} takes {WANTED[kind]}, and this is the standard library's",
            )


@cache
def library_roots() -> tuple[Path, ...]:
    """The folders of the standard library and of installed packages (site-packages)."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(site.getsitepackages() + [site.getusersitepackages()])
    return tuple(Path(r).resolve() for r in roots if r)


def in_project(file: str | None) -> bool:
    """Whether a source ``file`` is the user's.

    Found from the working folder, PYTHONPATH or an editable install; not the standard library's, an installed
    package's, nor the runner's own."""
    if not file:
        return False
    where = Path(file).resolve()
    runner = Path(__file__).resolve().parents[1]
    return not any(where.is_relative_to(root) for root in (*library_roots(), runner))


def trusted(module: str) -> bool:
    """Whether the dotted ``module`` is in a package the user named in ``MPITRAIN_TRUSTED_PACKAGES``."""
    names = {n.strip() for n in os.environ.get(TRUSTED_ENV, "").split(",") if n.strip()}
    return top_module(module) in names and not in_stdlib(module)


def defined_in_project(obj: Any) -> bool:
    """Whether ``obj`` (a class or a function) is defined in the user's project (or a trusted package)."""
    if trusted(getattr(obj, "__module__", None) or ""):
        return True
    try:
        return in_project(inspect.getsourcefile(obj) or inspect.getfile(obj))
    except (TypeError, OSError):
        return False


def kind_problem(kind: str, obj: Any) -> str | None:
    """What is wrong with ``obj`` as what ``kind`` builds (None: it is one), judged without calling it."""
    import torch

    cls = obj if inspect.isclass(obj) else None
    if kind == "model" and cls and issubclass(cls, torch.nn.Module):
        return None
    if kind == "optimizer" and cls and issubclass(cls, torch.optim.Optimizer):
        return None
    if kind == "loss" and (
        (cls and issubclass(cls, torch.nn.Module))
        or (inspect.isroutine(obj) and getattr(obj, "__module__", None) == "torch.nn.functional")
    ):
        return None
    if kind == "dataset" and (
        (cls and issubclass(cls, torch.utils.data.Dataset))
        or ((cls or inspect.isfunction(obj)) and defined_in_project(obj))
    ):
        return None
    if kind == "argument" and (
        (cls and top_module(cls.__module__) in TORCH_PACKAGES)
        or (cls and f"{cls.__module__}.{cls.__qualname__}" in DATA_TYPES)
        or ((cls or inspect.isfunction(obj)) and defined_in_project(obj))
    ):
        return None
    what = "class" if cls else type(obj).__name__
    module = getattr(obj, "__module__", None) or "?"
    return f"it is a {what} of {module}, not {WANTED[kind]}"


def check_kinds(found: list[tuple[str, str, str]], where: str) -> None:
    """Refuse any target that is not the kind of object its key builds.

    Imports each target's module (and torch), calls nothing. :func:`check_paths` first, so no standard library
    module is imported."""
    from runner.schema.target import Target

    check_paths(found, where)
    for key, kind, path in found:
        name = key.removesuffix("." + TARGET)
        try:
            obj = Target(name, path).locate()
        except ImportError as err:
            raise ValueError(f"{where}: {key}={path} cannot be imported: {err}") from None
        problem = kind_problem(kind, obj)
        if problem is not None:
            raise refused(where, key, path, f"{name} takes {WANTED[kind]}, but {problem}")


def check_schemas(schemas: Mapping[str, Any], where: str, classless: dict[str, tuple[str, ...]]) -> None:
    """Refuse ``_schemas_`` entries that are neither the runner's schemas nor the user's classes.

    An entry is ``group: module.Class``, as this version names them: one of the runner's schemas of that
    group, or a class defined in a module of the user's project. Imports nothing. ``classless``: the entry of
    a group given by its class (``target``) and the groups that may be."""
    from runner.schema import GROUPS

    ((target_node, target_groups),) = classless.items()
    for group, path in schemas.items():
        key = f"_schemas_.{group}"
        if group not in GROUPS or group == "logger":
            known = ", ".join(g for g in GROUPS if g != "logger")
            raise refused(where, key, path, f"no such group (the groups are {known})")
        if path == target_node and group in target_groups:
            continue
        if not isinstance(path, str) or "." not in path:
            raise refused(where, key, path, "not a schema class's dotted path")
        module, _, name = path.rpartition(".")
        package = GROUPS[group][0]
        if module.startswith(package + ".") and "." not in module.removeprefix(package + "."):
            continue
        if not project_defines(module, name):
            raise refused(
                where,
                key,
                path,
                f"a schema of {group} is one of the runner's ({package}.MODULE.NameConfig) or a class "
                "defined in a module of your project",
            )


def project_defines(module: str, name: str) -> bool:
    """Whether ``module`` is of the user's project and its source defines the class ``name`` at its top level.

    Found and read without importing it (nor its packages)."""
    if in_stdlib(module) or top_module(module) == "runner":
        return False
    try:
        origin = module_origin(module)
    except (ImportError, ValueError):
        return False
    if not origin or not origin.endswith(".py") or not (in_project(origin) or trusted(module)):
        return False
    try:
        tree = ast.parse(Path(origin).read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    return any(isinstance(n, ast.ClassDef) and n.name == name for n in tree.body)


def module_origin(module: str) -> str | None:
    """The source file of the dotted ``module``, found without importing its packages."""
    parts = module.split(".")
    spec = importlib.util.find_spec(parts[0])
    for i in range(1, len(parts)):
        if spec is None or spec.submodule_search_locations is None:
            return None
        name = ".".join(parts[: i + 1])
        spec = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
    return spec.origin if spec is not None else None


def check_schema_class(group: str, path: str, cls: Any, where: str) -> None:
    """After import: the schema ``cls`` that ``_schemas_.<group>`` names is a subclass of the group's base.

    A dataclass subclassing the group's base (:func:`runner.schema.schema_of`'s rule)."""
    import dataclasses

    from runner.schema import GROUPS, locate

    base = locate(GROUPS[group][1])
    if not (inspect.isclass(cls) and dataclasses.is_dataclass(cls) and issubclass(cls, base)):
        why = f"not a schema (a dataclass subclassing {base.__name__})"
        raise refused(where, f"_schemas_.{group}", path, why)


def check_file(path: str | Path) -> None:
    """The targets of a run folder's ``config.yaml`` (:func:`check_kinds`; imports their modules and torch).

    Its ``_schemas_`` are :func:`check_schemas`'s, when the file is loaded."""
    from omegaconf import OmegaConf

    raw = OmegaConf.load(path)
    raw.pop("_schemas_", None)
    check_kinds(targets(OmegaConf.to_container(raw, resolve=True)), str(path))


def main(argv: list[str] | None = None) -> None:
    """``python -m runner.schema.trust CONFIG``: exit 2 with the refusal on stderr, 0 when it may be built."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m runner.schema.trust RUN_DIR/config.yaml")
    try:
        check_file(argv[0])
    except ValueError as err:
        print(err, file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
