"""The ranks' side by concern: the resilience wing (runner/rank/resilience/: recovery, growth, the survivor
protocol) is a door only the loop and the worker (with its assembly) open; read from the code with the
layout test's import walker. No process is started."""

from __future__ import annotations

import ast
import inspect

from tests.conftest import ROOT
from tests.test_layout import imports, modules

WING = "runner.rank.resilience"
#: The modules outside the wing that may import it.
DOORS = {"runner.rank.loop", "runner.rank.worker", "runner.rank.assembly"}


def importers(mods: dict) -> dict[str, list[str]]:
    """``module -> the wing's modules it imports`` (type hints too), for modules outside the wing."""
    known = set(mods)
    found = {}
    for name, path in mods.items():
        if name == WING or name.startswith(WING + "."):
            continue
        hits = sorted({t for t, _ in imports(path, name, known) if t == WING or t.startswith(WING + ".")})
        if hits:
            found[name] = hits
    return found


def test_only_the_loop_and_the_worker_import_the_resilience_wing():
    mods = modules()
    assert any(name.startswith(WING + ".") for name in mods), "the wing is where the walker looks"
    found = importers(mods)
    assert set(found) <= DOORS, {k: v for k, v in found.items() if k not in DOORS}
    assert found.keys() == DOORS, "the walker sees the loop's, the worker's and its assembly's imports"


def test_a_module_that_imports_the_wing_is_named(tmp_path):
    """A module beside the loop that imports the wing (here: a copy of the checkpoint module with one import
    more) is caught."""
    mods = modules()
    source = mods["runner.rank.checkpoint"].read_text()
    stray = tmp_path / "checkpoint.py"
    stray.write_text(source + "\nfrom runner.rank.resilience.recovery import Recovery  # noqa\n")
    found = importers({**mods, "runner.rank.checkpoint": stray})
    assert found.get("runner.rank.checkpoint") == ["runner.rank.resilience.recovery"]


def members(face: type) -> dict[str, list[str] | None]:
    """``name -> parameter names`` of a Protocol's methods (None for its attributes)."""
    out: dict[str, list[str] | None] = dict.fromkeys(face.__dict__.get("__annotations__", {}))
    for name, value in vars(face).items():
        if callable(value) and not name.startswith("_"):
            out[name] = list(inspect.signature(value).parameters)
    return out


def unmet(face: type, obj: object) -> list[str]:
    """The members of ``face`` that ``obj`` lacks, or has with other parameters."""
    wrong = []
    for name, params in members(face).items():
        if not hasattr(obj, name):
            wrong.append(f"{type(obj).__name__} has no {name}")
        elif params is not None and list(inspect.signature(getattr(type(obj), name)).parameters) != params:
            wrong.append(f"{type(obj).__name__}.{name} takes other parameters than {face.__name__}.{name}")
    return wrong


def test_both_paces_answer_every_call_alike():
    """The loop calls its pace with no branch on which it is: static shards and dynamic assignment have the
    same public methods, with the same parameters."""
    from runner.rank.pace import Dynamic, Static

    def methods(cls: type) -> dict[str, list[str]]:
        return {
            n: list(inspect.signature(f).parameters)
            for n, f in vars(cls).items()
            if callable(f) and not n.startswith("_")
        }

    static, dynamic = methods(Static), methods(Dynamic)
    static.pop("steps_per_epoch"), static.pop("agree"), dynamic.pop("meet"), dynamic.pop("agree")  # their own
    assert static == dynamic, {n for n in static.keys() | dynamic.keys() if static.get(n) != dynamic.get(n)}
    assert "begin_epoch" in static and "welcome" in static


def test_the_survivors_answer_what_recovery_asks(tmp_path):
    """Recovery's Survivor protocol, met by the loop's Survivors with the same parameters."""
    from runner.rank.resilience.recovery import Survivor
    from tests.helpers.fakecomm import FakeWorld
    from tests.rank.test_trainer_state import trainer

    def rank(comm) -> list[str]:
        return unmet(Survivor, trainer(comm, tmp_path / "s", False).survivors)

    assert FakeWorld(1).run(rank)[0] == []
    assert "rejoin" in members(Survivor)


#: The modules under runner/rank/ that hold or build the loop.
LOOP_HOLDERS = {"loop.py", "worker.py", "assembly.py"}


def reaches(source: str) -> list[int]:
    """The lines of ``source`` that name a ``loop``: a parameter, or an attribute read through one."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.arg) and node.arg == "loop":
            lines.append(node.lineno)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "loop":
            lines.append(node.lineno)
    return sorted(set(lines))


def test_no_part_of_the_rank_reaches_through_the_loop():
    """The pace, the training state, growth and the survivors are given what they use (issue 47): none is
    handed the loop to read its parts through."""
    found = {}
    for path in sorted((ROOT / "runner" / "rank").rglob("*.py")):
        if path.name not in LOOP_HOLDERS and (lines := reaches(path.read_text())):
            found[str(path.relative_to(ROOT))] = lines
    assert not found, found
    assert reaches("def f(loop):\n    return loop.meter\n") == [1, 2], "the finder sees both forms"
