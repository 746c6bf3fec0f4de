"""The house's contracts, read from the code: which side imports which, one home for the run folder's names,
and the top-level defaults declared alike in conf/config.yaml and the dataclasses. No process is started."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
#: The package's folders as installed: runner/models and runner/data are the repository's models/, data/.
SOURCES = {"runner": ROOT / "runner", "runner.models": ROOT / "models", "runner.data": ROOT / "data"}
#: Sides that must never import the ranks' side or the communication layer.
LAUNCHING = ("launcher", "schema", "hardware")
RANK_SIDE = ("rank", "comm")


def modules(sources: dict[str, Path] = SOURCES) -> dict[str, Path]:
    """``dotted name -> file`` of every module of the package (links followed once, not twice)."""
    found = {}
    for package, folder in sources.items():
        for path in folder.rglob("*.py"):
            rel = path.relative_to(folder).with_suffix("")
            if package == "runner" and rel.parts[0] in ("models", "data", "conf"):
                continue
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def _type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def parsed(path: Path) -> ast.Module:
    """``path``'s syntax tree, parsed once per version of the file (the layout tests walk every module
    several times)."""
    return _parsed(path, path.stat().st_mtime_ns)


@functools.cache
def _parsed(path: Path, mtime_ns: int) -> ast.Module:
    return ast.parse(path.read_text())


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, bool]]:
    """``(imported module, only for type hints)`` of every import statement in a file, at any depth;
    ``from a import b`` counts as ``a.b`` when that is a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[str, bool]] = []

    def visit(node: ast.AST, hints: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for stmt in child.body:
                    visit_stmt(stmt, True)
                for stmt in child.orelse:
                    visit_stmt(stmt, hints)
            else:
                visit_stmt(child, hints)

    def visit_stmt(node: ast.AST, hints: bool) -> None:
        if isinstance(node, ast.Import):
            out.extend((alias.name, hints) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            for alias in node.names:
                full = f"{base}.{alias.name}"
                out.append((full if full in known else base, hints))
        else:
            visit(node, hints)

    visit(parsed(path), False)
    return out


def side(module: str) -> str:
    """The folder (``rank``, ``launcher``...) of a module of the package, or the module for top-level ones."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def graph(hints: bool = False, sources: dict[str, Path] = SOURCES) -> dict[str, set[str]]:
    """``module -> modules of the package it imports`` (with ``hints``: type-hint-only imports too)."""
    mods = modules(sources)
    known = set(mods)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        for target, only_hints in imports(path, name, known):
            if target in known and target != name and (hints or not only_hints):
                edges[name].add(target)
    return edges


def cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle of ``edges`` (a list of nodes, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def walk(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := walk(nxt)):
                return found
        state[node] = 2
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state and (found := walk(node)):
            return found
    return None


def test_the_import_walker_sees_what_it_must():
    """The walker finds plain, nested, type-hint-only and module-from-package imports (so the checks below
    cannot pass by seeing nothing)."""
    edges, hinted = graph(), graph(hints=True)
    assert "runner.comm.mpi" in edges["runner.rank.worker"]  # from runner.comm import mpi
    assert "runner.report.write" in edges["runner.launcher.callbacks"]  # inside a method
    assert "runner.rank.loop" in edges["runner.rank.worker"]
    assert (
        "runner.comm.face" not in edges["runner.comm.wire"]
        and "runner.comm.face" in hinted["runner.comm.wire"]
    )
    assert len(edges) > 80


@pytest.mark.parametrize("launching", LAUNCHING)
def test_the_launcher_schema_and_hardware_never_import_the_ranks_or_the_comm_layer(launching):
    """Not even for type hints: these sides run in the launcher, which imports no torch and no MPI."""
    bad = [
        f"{module} imports {target}"
        for module, targets in graph(hints=True).items()
        if side(module) == launching
        for target in targets
        if side(target) in RANK_SIDE
    ]
    assert not bad, bad


def test_the_comm_layer_imports_neither_the_schema_nor_the_hardware():
    """The communication layer is given values, not configs (issue 47): not even a type hint reaches the
    schema or the hardware side; the names both sides use are held alike here."""
    from runner.comm.wire import NAMES
    from runner.schema import WIRE_NAMES

    bad = [
        f"{module} imports {target}"
        for module, targets in graph(hints=True).items()
        if side(module) == "comm"
        for target in targets
        if side(target) in ("schema", "hardware")
    ]
    assert not bad, bad
    assert NAMES == WIRE_NAMES


def test_only_the_binding_module_imports_mpi4py():
    """mpi4py is imported in one module of the communication layer, which sets it not to start MPI; the rest
    of the layer takes ``MPI`` from there, and no other side imports the layer's MPI modules (above)."""
    mods = modules()
    importers = sorted(
        name
        for name, path in mods.items()
        if any(t.split(".")[0] == "mpi4py" for t, _ in imports(path, name, set(mods)))
    )
    assert importers == ["runner.comm.binding"]
    users = {name for name, targets in graph(hints=True).items() if "runner.comm.binding" in targets}
    assert users and {side(name) for name in users} == {"comm"}, users


def test_no_import_circle_between_folders():
    folders: dict[str, set[str]] = {}
    for module, targets in graph().items():
        folders.setdefault(side(module), set()).update(side(t) for t in targets if side(t) != side(module))
    assert cycle(folders) is None, " -> ".join(cycle(folders))


def circles(edges: dict[str, set[str]]) -> list[str]:
    """Every circle of ``edges``, one line each (each circle's last edge is dropped to find the next)."""
    edges = {node: set(targets) for node, targets in edges.items()}
    found, out = cycle(edges), []
    while found is not None:
        out.append(" -> ".join(found))
        edges[found[-2]].discard(found[-1])
        found = cycle(edges)
    return out


def test_no_import_circle_between_modules():
    """None anywhere in runner/ (models/, data/), counting every import of a file: at its top, inside a
    function, and those for type hints only (``if TYPE_CHECKING:``), since a circle of hints is still two
    modules that each need the other to be read. A module that needs another's type without importing it
    names a ``typing.Protocol`` of what it uses (runner/comm/face.py, runner/hardware/mpirun.py's
    Settings)."""
    assert circles(graph(hints=True)) == []


def test_the_circle_check_sees_a_circle(tmp_path):
    """A circle of two modules through a type-hint-only import, and one of three through a function's."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
    )
    (pkg / "b.py").write_text("from pkg import a\nclass B: ...\n")
    (pkg / "c.py").write_text("def f():\n    from . import d\n")
    (pkg / "d.py").write_text("import pkg.e\n")
    (pkg / "e.py").write_text("from pkg.c import f\n")
    sources = {"pkg": pkg}
    assert circles(graph(hints=True, sources=sources)) == [
        "pkg.a -> pkg.b -> pkg.a",
        "pkg.c -> pkg.d -> pkg.e -> pkg.c",
    ]
    assert circles(graph(sources=sources)) == ["pkg.c -> pkg.d -> pkg.e -> pkg.c"]


def test_run_folder_names_are_written_in_one_module():
    """A grep for "summary.json", "config.yaml", "mpirun.log"... as string literals finds runner/run_folder.py
    alone: every other module names them through it."""
    from runner import run_folder

    names = {v for k, v in vars(run_folder).items() if k.isupper() and isinstance(v, str) and "." in v}
    assert {"summary.json", "config.yaml", "mpirun.log", "metrics.jsonl", "checkpoint.json"} <= names
    where = {}
    for name, path in modules().items():
        for node in ast.walk(parsed(path)):
            if isinstance(node, ast.Constant) and node.value in names:
                where.setdefault(node.value, set()).add(name)
    elsewhere = {value: sorted(found - {"runner.run_folder"}) for value, found in where.items()}
    assert not {k: v for k, v in elsewhere.items() if v}


def default_mismatches(yaml: dict) -> list[str]:
    """The top-level keys whose value in ``yaml`` (conf/config.yaml as a dict) differs from the schema's
    default, or that only one of them declares (the groups, ``defaults`` and ``hydra`` aside)."""
    from runner.schema import GROUPS
    from runner.schema.config import Config

    schema = OmegaConf.to_container(OmegaConf.structured(Config))
    declared = {k: v for k, v in schema.items() if k not in GROUPS}
    given = {k: v for k, v in yaml.items() if k not in ("defaults", "hydra")}
    out = []
    for key in sorted(set(declared) | set(given)):
        a, b = declared.get(key, "<absent>"), given.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            out += [
                f"{key}.{k}" for k in sorted(set(a) | set(b)) if a.get(k, "<absent>") != b.get(k, "<absent>")
            ]
        elif a != b:
            out.append(key)
    return out


def test_conf_config_yaml_holds_the_dataclasses_defaults():
    """The top-level keys' defaults are declared twice, in the schema (with the checks) and in
    conf/config.yaml (explained by their comments, which --help shows): they must agree, key for key."""
    yaml = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "config.yaml"))
    assert default_mismatches(yaml) == []


def test_the_defaults_check_sees_a_changed_a_missing_and_an_extra_key():
    yaml = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "config.yaml"))
    yaml["train"]["epochs"] = 11
    del yaml["checkpoint"]["keep"]
    yaml["simulate"]["new_key"] = 1
    yaml["devices"] = 3
    assert default_mismatches(yaml) == ["checkpoint.keep", "devices", "simulate.new_key", "train.epochs"]


#: The most lines a module of runner/ may have, and the launcher's supervisor class (issue 47).
MODULE_LINES, SUPERVISOR_LINES, SUPERVISOR_ATTRIBUTES = 450, 160, 14


def test_no_module_of_the_runner_is_over_450_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in sorted((ROOT / "runner").rglob("*.py"))
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MODULE_LINES
    }
    assert not long, f"split these modules (one concept each): {long}"


def test_the_supervisor_stays_small():
    """Its watches are objects of their own (runner/launcher/watches.py); it starts, ticks and ends."""
    tree = ast.parse((ROOT / "runner/launcher/supervise.py").read_text(encoding="utf-8"))
    [cls] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Supervisor"]
    attributes = {
        t.attr
        for n in ast.walk(cls)
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in ast.walk(n.targets[0] if isinstance(n, ast.Assign) else n.target)
        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"
    }
    assert cls.end_lineno - cls.lineno + 1 <= SUPERVISOR_LINES
    assert len(attributes) <= SUPERVISOR_ATTRIBUTES, sorted(attributes)
