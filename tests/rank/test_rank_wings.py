"""The ranks' side by concern: the resilience wing (runner/rank/resilience/: recovery, growth, the survivor
protocol) is a door only the loop and the worker (with its assembly) open; read from the code with the
layout test's import walker. No process is started."""

from __future__ import annotations

import inspect

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


def test_the_loop_and_its_components_have_the_faces_they_are_seen_through(tmp_path):
    """runner/rank/face.py declares what the components use of the loop (so they need not import it): the
    Trainer, both paces, the training state and growth provide every member, with the same parameters."""
    from runner.rank import face
    from runner.rank.pace import Dynamic
    from tests.helpers.fakecomm import FakeWorld
    from tests.rank.test_trainer_state import trainer

    def rank(comm) -> list[str]:
        static, dynamic = trainer(comm, tmp_path / "s", False), trainer(comm, tmp_path / "d", True)
        assert isinstance(dynamic.pace, Dynamic)
        return [
            *unmet(face.Loop, static),
            *unmet(face.Pace, static.pace),
            *unmet(face.Pace, dynamic.pace),
            *unmet(face.State, static.state),
            *unmet(face.Grows, static.growth),
        ]

    assert FakeWorld(1).run(rank)[0] == []
    assert "begin_epoch" in members(face.Pace) and "validator" in members(face.Loop)
