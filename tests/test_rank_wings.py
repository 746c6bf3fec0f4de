"""The ranks' side by concern: the resilience wing (runner/rank/resilience/: recovery, growth, the survivor
protocol) is a door only the loop and the worker open; read from the code with the layout test's import
walker. No process is started."""

from __future__ import annotations

from tests.test_layout import imports, modules

WING = "runner.rank.resilience"
#: The modules outside the wing that may import it.
DOORS = {"runner.rank.loop", "runner.rank.worker"}


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
    assert found.keys() == DOORS, "the walker sees the loop's and the worker's imports"


def test_a_module_that_imports_the_wing_is_named(tmp_path):
    """A module beside the loop that imports the wing (here: a copy of the checkpoint module with one import
    more) is caught."""
    mods = modules()
    source = mods["runner.rank.checkpoint"].read_text()
    stray = tmp_path / "checkpoint.py"
    stray.write_text(source + "\nfrom runner.rank.resilience.recovery import Recovery  # noqa\n")
    found = importers({**mods, "runner.rank.checkpoint": stray})
    assert found.get("runner.rank.checkpoint") == ["runner.rank.resilience.recovery"]
