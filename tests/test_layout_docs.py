"""docs/layout.md stays true to the code: its tree names every module of the package (and no module that is
gone), and its hook table names every hook a rule can override. Read from the files; no process is started."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.test_layout import ROOT, SOURCES, modules

LAYOUT = ROOT / "docs" / "layout.md"
#: The top folders of the package as the tree writes them (``models/`` and ``data/`` install as runner.models,
#: runner.data); the tree's other folders (conf/, tests/, docs/...) hold no module of the package.
PACKAGE_TOPS = tuple(f"{folder.relative_to(ROOT).as_posix()}/" for folder in SOURCES.values())
#: A tree line names a file or folder when its first word ends in .py or / and it is indented by at most this
#: many spaces (deeper lines continue the description above them).
NAME_INDENT = 12


def section(text: str, heading: str) -> str:
    """The body of the Markdown ``## heading`` section of ``text`` (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/layout.md has no '## {heading}' section"
    return match.group(1)


def tree_names(text: str) -> set[str]:
    """The files and folders (relative to the repository, folders ending in /) named by the first code block
    of ``text``'s "The tree" section. A line at column 0 names a path from the repository's root (a folder
    opens a block); a line indented by 2k spaces names a path relative to the folder opened at indent
    2(k-1) above it (``records/`` opens a sub-block, ``records/meter.py`` names a file directly)."""
    block = re.search(r"^```[^\n]*\n(.*?)^```", section(text, "The tree"), re.M | re.S)
    assert block, "docs/layout.md's 'The tree' section has no code block"
    names: set[str] = set()
    folders: list[str] = []  # the folder opened at each depth (depth k at indent 2k)
    for line in block.group(1).splitlines():
        word = line.split(maxsplit=1)[0] if line.strip() else ""
        indent = len(line) - len(line.lstrip(" "))
        if not word.endswith((".py", "/")) or indent > NAME_INDENT or indent % 2:
            continue
        depth = indent // 2
        assert depth <= len(folders), f"docs/layout.md's tree: {line.strip()!r} is indented under no folder"
        path = (folders[depth - 1] if depth else "") + word
        names.add(path)
        if word.endswith("/"):
            folders[depth:] = [path]
    return names


def package_files() -> dict[str, str]:
    """``path in the repository -> dotted name`` of every module of the package (test_layout's scanner)."""
    return {path.relative_to(ROOT).as_posix(): name for name, path in modules().items()}


def tree_mismatches(names: set[str], files: dict[str, str]) -> tuple[list[str], list[str]]:
    """``(missing, stale)``: the package's modules the tree does not name (a package's ``__init__.py`` is
    named by its folder's line), and what the tree names under the package's folders that does not exist."""
    missing = [
        f"{path} ({name})"
        for path, name in sorted(files.items())
        if path not in names
        and not (path.endswith("/__init__.py") and path.removesuffix("__init__.py") in names)
    ]
    folders = {p.rsplit("/", 1)[0] + "/" for p in files}
    stale = sorted(n for n in names if n.startswith(PACKAGE_TOPS) and n not in files and n not in folders)
    return missing, stale


def mismatch_report(missing: list[str], stale: list[str]) -> str:
    """What to change in docs/layout.md, one module a line."""
    lines = []
    if missing:
        lines.append("docs/layout.md's tree ('## The tree') does not name these modules; add a line for each")
        lines.append("under its folder's block (its path relative to that folder, and one line of purpose):")
        lines += [f"  + {m}" for m in missing]
    if stale:
        lines.append("docs/layout.md's tree names modules or folders that are gone; remove or rename them:")
        lines += [f"  - {s}" for s in stale]
    return "\n".join(lines)


def test_the_tree_names_every_module_and_no_other():
    missing, stale = tree_mismatches(tree_names(LAYOUT.read_text(encoding="utf-8")), package_files())
    assert not missing and not stale, "\n" + mismatch_report(missing, stale)


def test_the_tree_check_sees_a_missing_and_a_stale_module():
    """A module left out of the doc and a module the doc names that was deleted are both reported (so the
    check above cannot pass by reading nothing)."""
    text = LAYOUT.read_text(encoding="utf-8")
    names, files = tree_names(text), package_files()
    assert {"runner/rank/worker.py", "runner/comm/", "models/cnn.py", "data/base.py"} <= names
    assert len(names & set(files)) > 80
    missing, stale = tree_mismatches(names, files)  # (empty unless the doc lags: the test above says so)
    left_out = re.sub(r"^  worker\.py .*\n", "", text, count=1, flags=re.M)
    worker = "runner/rank/worker.py (runner.rank.worker)"
    assert tree_mismatches(tree_names(left_out), files) == (sorted([*missing, worker]), stale)
    deleted = {p: n for p, n in files.items() if p != "models/cnn.py"}
    assert tree_mismatches(names, deleted) == (missing, sorted([*stale, "models/cnn.py"]))
    nested = "## The tree\n```\nrunner/rank/  r\n  records/  w\n    meter.py  m\n  worker.py  w\n```\n"
    expected = {
        "runner/rank/",
        "runner/rank/records/",
        "runner/rank/records/meter.py",
        "runner/rank/worker.py",
    }
    assert tree_names(nested) == expected


def hook_names() -> set[str]:
    """Every hook a rule's author can override: ``Rule``'s public methods, properties and class attributes,
    and ``RuleConfig``'s methods (its schema side)."""
    from runner.rules.base import Rule
    from runner.schema import RuleConfig

    rule = {f"Rule.{k}" for k in vars(Rule) if not k.startswith("_")}
    config = {f"RuleConfig.{k}" for k, v in vars(RuleConfig).items() if callable(v) and not k.startswith("_")}
    return rule | config


def test_the_hook_table_names_every_hook_and_no_other():
    table = section(LAYOUT.read_text(encoding="utf-8"), "Which hook for which feature")
    named = set(re.findall(r"`((?:Rule|RuleConfig)\.[a-z]\w*)", table))  # (Rule._helpers are not hooks)
    hooks = hook_names()
    assert {"Rule.after_backward", "Rule.serve", "RuleConfig.extra_ranks"} <= hooks
    assert not hooks - named, f"hooks missing from docs/layout.md's hook table: {sorted(hooks - named)}"
    assert not named - hooks, f"docs/layout.md's hook table names no such hook: {sorted(named - hooks)}"


def test_every_docstring_of_the_runner_opens_with_one_summary_line():
    """Ruff's D205 and D400 (one summary line ending with a period, a blank line, then the rest) hold for
    every module of runner/, as pyproject.toml asks of it and not of the tests (issue 47)."""
    argv = [sys.executable, "-m", "ruff", "check", "--select", "D205,D400", "--output-format", "concise"]
    proc = subprocess.run([*argv, "runner"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
