"""Lists that cannot go stale: every rule, option group and page is named where the docs list them (README,
docs/index.md, running.md, the code map, ``--help``, pyproject.toml), taken from discovery, so a new rule,
group or page left out of one fails here with the place to add it."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import tomllib

from runner.schema import option_modules
from tests.conftest import ROOT

#: Each rule's name in prose (a new rule file fails :func:`test_every_rule_has_its_name_in_prose` until it is
#: added here).
TITLES = {
    "asgd": "ASGD",
    "async_diloco": "async DiLoCo",
    "bsp": "BSP",
    "demo": "DeMo",
    "desloc": "DES-LOC",
    "diloco": "DiLoCo",
    "easgd": "EASGD",
    "gosgd": "GoSGD",
    "sparseloco": "SparseLoCo",
    "sparta": "SPARTA",
    "streaming_diloco": "Streaming DiLoCo",
}


def rules() -> list[str]:
    return [m for m in option_modules("rule") if m not in ("base", "fragments", "period")]


def text(path: str) -> str:
    return (ROOT / path).read_text()


def test_every_rule_has_its_name_in_prose():
    assert sorted(TITLES) == sorted(rules()), "add the new rule's name to TITLES"


@pytest.mark.parametrize("path", ["README.md", "docs/index.md", "docs/rules.md"])
def test_the_prose_lists_of_rules_name_every_rule(path):
    body = text(path)
    missing = [title for title in TITLES.values() if not re.search(rf"(?<![\w-]){re.escape(title)}\b", body)]
    assert missing == [], f"{path} does not name the rules {missing}"


def test_pyproject_describes_every_rule():
    description = tomllib.loads(text("pyproject.toml"))["project"]["description"]
    missing = [t for t in TITLES.values() if not re.search(rf"(?<![\w-]){re.escape(t)}\b", description)]
    assert missing == [], f"pyproject.toml's description does not name {missing}"


def _option_list(body: str, group: str) -> set[str]:
    """The options named in ``body``'s list of ``group`` (``group`` (`a`, `b`, ...))."""
    found = re.search(rf"`{group}`\s*\(((?:`[\w_]+`,?\s*(?:and\s+)?)+)", body)
    return set(re.findall(r"`([\w_]+)`", found.group(1))) if found else set()


def conf_groups() -> list[str]:
    """The config groups a user selects from (``conf/<group>/<option>.yaml``), Hydra's own left out."""
    return sorted(p.name for p in (ROOT / "conf").iterdir() if p.is_dir() and p.name != "hydra")


def options(group: str) -> set[str]:
    return {p.stem for p in (ROOT / "conf" / group).glob("*.yaml")}


@pytest.mark.parametrize("group", conf_groups())
def test_running_md_lists_every_option_of_every_group(group):
    listed = _option_list(text("docs/running.md"), group)
    missing = sorted(options(group) - listed)
    assert missing == [], f"docs/running.md's list of {group} lacks {missing}"


def test_the_completion_example_offers_every_rule():
    line = next(ln for ln in text("docs/running.md").splitlines() if "mpitrain rule=<TAB>" in ln)
    assert sorted(re.findall(r"rule=(\w+)", line.split("#", 1)[1])) == sorted(rules()), line


def test_the_code_map_names_every_rule():
    line = next(ln for ln in text("README.md").splitlines() if ln.startswith("runner/rules/"))
    named = set(re.findall(r"\b\w+\b", line.split(None, 1)[1]))
    assert set(rules()) - named == set(), f"README's code map lacks {sorted(set(rules()) - named)}"


def test_the_index_links_every_page():
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"index.md"}
    linked = set(re.findall(r"\]\(([\w-]+\.md)", text("docs/index.md")))
    assert pages - linked == set(), f"docs/index.md does not link {sorted(pages - linked)}"


@pytest.mark.slow
def test_help_names_every_rule_group_and_the_hardware_keys():
    done = subprocess.run(
        [sys.executable, "-m", "runner", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    for rule in rules():
        assert re.search(rf"\b{rule}\b", done.stdout), rule
    for group in conf_groups():
        assert re.search(rf"^  {group}\s", done.stdout, re.M), group
    for key in ("hardware.bind=core", "hardware.oversubscribe=false", "hardware.fault_tolerance=none"):
        line = next((ln for ln in done.stdout.splitlines() if ln.strip().startswith(key)), "")
        assert line.strip() != key, f"--help does not explain {key}: {line!r}"
    assert "See README.md" not in done.stdout and "docs/index.md" in done.stdout
    pages = sorted(p.stem for p in (ROOT / "docs").glob("*.md") if p.stem != "index")
    assert all(re.search(rf"\b{re.escape(p)}\b", done.stdout) for p in pages), "--help lists every page"


def test_the_configuration_page_lists_every_rule_with_every_key():
    """docs/configuration.md's rule table: a row per rule naming each key of its schema (the period
    schedule's keys, shared by the periodic rules, once above the table)."""
    from dataclasses import fields

    from runner.schema import schema_of

    body = text("docs/configuration.md").split("## `rule`", 1)[1].split("\n## ", 1)[0]
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(\w+)`.*$", body, re.MULTILINE)}
    shared = {"comm_dtype", "period_schedule", "qsr_alpha", "period_list"}
    assert all(f"`{key}`" in body for key in shared - {"comm_dtype"}), "the period schedule's keys"
    missing = {}
    for rule in rules():
        keys = {f.name for f in fields(schema_of("rule", rule))} - shared
        if rule == "streaming_diloco":  # (DiLoCo's keys, said so)
            keys -= {f.name for f in fields(schema_of("rule", "diloco"))}
        absent = sorted(k for k in keys if f"`{k}`" not in rows.get(rule, ""))
        if rule not in rows or absent:
            missing[rule] = absent or "no row"
    assert not missing, f"docs/configuration.md's rule table lacks {missing}"


def test_every_place_that_lists_the_compress_kinds_names_them_all():
    """``rule.compress``'s kinds (runner/comm/encodings' KINDS) in the rules' tables of rules.md and
    configuration.md (rules.md's BSP row named int8 and topk only, though BSP takes all four)."""
    from runner.comm.encodings import KINDS

    kinds = [k for k in KINDS if k != "none"]
    rows = [
        ln
        for path in ("docs/rules.md", "docs/configuration.md")
        for ln in text(path).splitlines()
        if ln.startswith("| `compress` | `none`") or ("`compress` none (" in ln)
    ]
    assert len(rows) >= 3, rows  # BSP's and DiLoCo's in rules.md, the configuration page's
    for row in rows:
        assert all(f"`{k}`" in row or re.search(rf"\b{k}\b", row) for k in kinds), row


def test_the_configuration_page_has_a_section_per_group():
    body = text("docs/configuration.md")
    missing = [g for g in conf_groups() if f"## `{g}`" not in body]
    assert missing == [], f"docs/configuration.md has no section for {missing}"
