"""The documentation: the site in ``docs/`` builds with ``mkdocs build --strict`` (no broken link, anchor or
page left out of the nav), every page is in ``mkdocs.yml``'s nav, and the README stays a short tour whose
first code block is the set-up command and the test command."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README_LIMIT = 15360  # bytes
SETUP = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e ."
    " && python -m runner"
)
#: The README's test command: the test extra (all the suite needs), then the two tiers; what .ci/run runs.
TESTS = (
    'pip install -e ".[test]" && python -m pytest -q -m "not slow" -n 2 --durations=10'
    " && python -m pytest -q -m slow --durations=25"
)


def _nav_pages(nav) -> list[str]:
    """Every page file named in a MkDocs nav (strings, ``{title: page}`` and nested sections)."""
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [page for item in nav for page in _nav_pages(item)]
    if isinstance(nav, dict):
        return [page for value in nav.values() for page in _nav_pages(value)]
    return []


def test_site_builds_strict(tmp_path):
    missing = [name for name in ("mkdocs", "material") if importlib.util.find_spec(name) is None]
    if missing:
        pytest.skip(f'{" and ".join(missing)} not installed: pip install -e ".[docs]" (in ".[test]" too)')
    argv = [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")]
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=180, env=env)
    if proc.returncode != 0:
        print(proc.stdout)
        print(proc.stderr)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_readme_is_short_and_starts_with_the_two_commands():
    readme = ROOT / "README.md"
    size = readme.stat().st_size
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move a topic to docs/"
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", readme.read_text(encoding="utf-8"), re.M | re.S)
    assert blocks, "README.md has no code block"
    first = blocks[0]
    assert SETUP in first, f"README.md's first code block lacks the set-up command:\n{first}"
    assert TESTS in first, f"README.md's first code block lacks the test command:\n{first}"
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert '-e ".[test]"' in ci and TESTS.split(" && ", 1)[1] in ci, ".ci/run runs another test command"


def test_every_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    docs_dir = ROOT / config.get("docs_dir", "docs")
    listed = set(_nav_pages(config.get("nav", [])))
    pages = {p.relative_to(docs_dir).as_posix() for p in docs_dir.rglob("*.md")}
    assert pages, f"no pages in {docs_dir}"
    assert not pages - listed, f"pages missing from mkdocs.yml's nav: {sorted(pages - listed)}"
    assert not listed - pages, f"nav entries without a page: {sorted(listed - pages)}"


def test_the_exit_status_table_is_run_folder_exit():
    """docs/running.md's exit-status table gives every status of ``runner.run_folder.EXIT`` its number, and
    the sweep's exit status is said as the launcher sets it (the first point not ok's)."""
    import re

    from runner.run_folder import EXIT

    text = (ROOT / "docs" / "running.md").read_text()
    table = {}
    for code, status in re.findall(r"^\| (\d+) \| (`\w+`|—) \|", text, re.MULTILINE):
        table[status.strip("`") if status != "—" else "invalid"] = int(code)
    assert table == EXIT, table
    assert "exits with the status of the first point that did not end ok" in text
