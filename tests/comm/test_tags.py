"""The message-tag table: every tag in one module, no two equal, none a bare number elsewhere."""

import ast
import pathlib

from runner.comm import tags

RUNNER = pathlib.Path(__file__).resolve().parents[2] / "runner"


def test_no_two_tags_coincide():
    table = tags.table()
    assert len(table) >= 10, "the table lists the job's tags"
    by_value: dict[int, list[str]] = {}
    for name, value in table.items():
        by_value.setdefault(value, []).append(name)
    assert not {v: n for v, n in by_value.items() if len(n) > 1}, "two message tags coincide"


def test_tags_are_not_reserved_values():
    # MPI's wildcards are negative, and the standard guarantees tags up to 32767
    assert all(0 <= value <= 32767 for value in tags.table().values())


def test_no_tag_is_a_bare_number_outside_the_table():
    """A point-to-point call takes its tag from the table, not from a number written in place."""
    calls = {"send", "isend", "recv", "irecv", "probe", "iprobe"}
    bare = []
    for path in RUNNER.rglob("*.py"):
        if path.name == "tags.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) in calls):
                continue
            tag = next((k.value for k in node.keywords if k.arg == "tag"), None)
            if tag is None and getattr(node.func, "attr", "") in {"send", "isend", "recv", "irecv"}:
                tag = node.args[2] if len(node.args) > 2 else None
            if isinstance(tag, ast.Constant) and isinstance(tag.value, int):
                bare.append(f"{path.relative_to(RUNNER)}:{node.lineno}")
    assert not bare, f"tags written as numbers: {bare}"
