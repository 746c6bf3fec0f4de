"""What a ``_target_``'s source says before anything is imported.

Whether its module defines the name, and which keyword arguments it takes.

The launcher imports no user code (it would import torch, and run the user's module top-level code), so the
source file of the module :func:`runner.schema.target.find_module` found is read and parsed. An answer is
given only where the source is plain: a class or function defined at the module's top level, without
decorators, whose own ``__init__`` (or the function) takes no ``**kwargs``; anything else (a name imported
from elsewhere, a base class's ``__init__``, a dataclass) is left to the rank that builds it.
"""

from __future__ import annotations

import ast
import difflib
import importlib.machinery
import importlib.util
from importlib.machinery import ModuleSpec
from pathlib import Path

#: Not known from the source alone.
UNKNOWN = None


def longest_module(path: str) -> tuple[int, ModuleSpec | None]:
    """How many of the dotted ``path``'s first parts name a module, and its spec.

    Found on the search path without importing anything (no package's ``__init__`` runs)."""
    parts = path.split(".")
    try:
        spec = importlib.util.find_spec(parts[0])
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return 0, None
    found = 1
    while found < len(parts) and spec.submodule_search_locations is not None:
        name = ".".join(parts[: found + 1])
        sub = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
        if sub is None:
            break
        spec, found = sub, found + 1
    return found, spec


def _tree(module: str) -> ast.Module | None:
    """The parsed source of ``module`` (found without importing it), or None."""
    found, spec = longest_module(module)
    if found != len(module.split(".")):
        return None
    origin = getattr(spec, "origin", None)
    if not origin or not origin.endswith(".py"):
        return None
    try:
        return ast.parse(Path(origin).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return None


def _bound_names(tree: ast.Module) -> set[str] | None:
    """Every name the module's top level binds, or None when it cannot be told.

    It cannot be told with a star import or a module ``__getattr__``."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*":
                    return None
                names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            if "sys.modules" in ast.unparse(node.value):  # the module replaces itself
                return None
    return None if "__getattr__" in names else names  # (a module __getattr__, defined or assigned)


def _parameters(node: ast.FunctionDef, method: bool) -> list[str] | None:
    """The names a function takes by keyword, or None when it takes any (``**kwargs``)."""
    if node.decorator_list or node.args.kwarg is not None:
        return None
    positional = node.args.posonlyargs + node.args.args
    skip = len(node.args.posonlyargs) or int(method)  # positional-only ones (a method's own first of all)
    return [a.arg for a in positional[skip:]] + [a.arg for a in node.args.kwonlyargs]


def keyword_arguments(module: str, name: str) -> list[str] | None:
    """The keyword arguments ``module.name`` takes, as its source says; None where it cannot be told."""
    tree = _tree(module)
    if tree is None:
        return UNKNOWN
    for node in reversed(tree.body):  # (Python keeps the last definition)
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return _parameters(node, method=False)
        if isinstance(node, ast.ClassDef) and node.name == name:
            if node.decorator_list:
                return UNKNOWN  # a dataclass and the like: the decorator makes __init__
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    return _parameters(item, method=True)
            return UNKNOWN  # its bases' __init__
    return UNKNOWN


def missing_name(module: str, name: str) -> list[str] | None:
    """The classes and functions ``module`` defines at its top level, where its source surely lacks ``name``.

    None unless the source surely binds no ``name`` at any level. The closest to ``name`` first."""
    tree = _tree(module)
    names = None if tree is None else _bound_names(tree)
    if names is None or name in names:
        return None
    defined = [n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))]
    close = difflib.get_close_matches(name, defined, n=len(defined), cutoff=0.0)
    return [n for n in close if not n.startswith("_")]


def unknown_keys(module: str, name: str, given: list[str]) -> list[tuple[str, str]]:
    """``(key, hint)`` of each ``given`` keyword argument that ``module.name`` surely does not take."""
    taken = keyword_arguments(module, name)
    if taken is None:
        return []
    out = []
    for key in given:
        if key not in taken:
            close = difflib.get_close_matches(key, taken, n=1)
            hint = f"did you mean {close[0]}?" if close else f"it takes {', '.join(taken) or 'no arguments'}"
            out.append((key, hint))
    return out
