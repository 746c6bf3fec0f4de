"""The rules, as the tests that cover each rule take them: discovered, never listed by hand, so that adding
``runner/rules/<name>.py`` with ``conf/rule/<name>.yaml`` adds the rule to every such test.

A test that needs settings for some rules (a server rank, more epochs, a variant such as EASGD's async one)
keeps a small table of them, and :func:`per_rule` or :func:`variants` give every other rule the default.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pytest

RULE_CONF = Path(__file__).resolve().parents[2] / "conf" / "rule"
T = TypeVar("T")


#: What a rule needs beside the default job's settings to train it (a rule not named needs nothing): DeMo
#: holds the momentum itself, so plain SGD applies its sign steps, at a sign step's rate (docs/rules.md).
#: Every cross-rule table takes a rule's needs from here (:func:`needs`).
NEEDS: dict[str, tuple[str, ...]] = {"demo": ("optim.momentum=0", "optim.lr=0.001")}


#: One variant of each kind of exchange, for the real-job families that test a mechanism rather than a rule
#: (a loss at a fixed moment, a second node): BSP (the all-reduce in every step), EASGD's async variant (a
#: server, data dealt), GoSGD (gossip, point to point, its weights), async DiLoCo (a server, outer steps) and
#: Streaming DiLoCo (fragments in flight). Every rule still runs in CI's real jobs: it trains to its bar
#: (tests/rules/test_rules_train.py) and on the GPT (tests/jobs/test_lm_rules.py), and survives kills at
#: drawn moments under both modes (tests/jobs/test_kill_battery.py). Each job is about 4 torch imports,
#: most of its time: a family over every rule costs CI minutes, so one whose mechanism a rule does not
#: change runs these (``variants(..., only=SAMPLED)``).
SAMPLED = ("bsp", "easgd-async", "gosgd", "async_diloco", "streaming_diloco")


def needs(rule: str) -> list[str]:
    """The overrides ``rule`` needs beside the default job's (:data:`NEEDS`)."""
    return list(NEEDS.get(rule, ()))


def rules() -> list[str]:
    """The rules a user can select (``rule=NAME``): the options ``conf/rule/*.yaml``, sorted."""
    found = sorted(p.stem for p in RULE_CONF.glob("*.yaml"))
    assert found, f"no rule options in {RULE_CONF}"
    return found


def _known(table: Mapping[str, Any]) -> None:
    stale = set(table) - set(rules())
    assert not stale, f"settings for rules that do not exist: {sorted(stale)} (options: {rules()})"


def per_rule(table: Mapping[str, T], default: T) -> dict[str, T]:
    """Every rule's value: ``table``'s, or ``default`` for a rule it does not name (a rule it names that
    does not exist fails, so that a renamed rule does not silently lose its settings)."""
    _known(table)
    return {rule: table.get(rule, default) for rule in rules()}


def variants(
    table: Mapping[str, Mapping[str, T]],
    default: T,
    only: Collection[str] = (),
    leave_out: Collection[str] = (),
) -> list:
    """``pytest.param(rule, value)`` for every rule, with the rule's name as the id. A rule that ``table``
    names is run in each of its variants instead: ``{"easgd": {"sync": a, "async": b}}`` gives the ids
    ``easgd-sync`` and ``easgd-async`` (the variant ``""`` is the rule's name alone).

    ``only``: the ids to keep, for a family whose every rule is covered by another test (see
    :data:`SAMPLED`); ``leave_out``: ids to drop (a new rule still joins). An id that names no variant
    fails, so a renamed rule is not silently dropped."""
    _known(table)
    cases = []
    for rule in rules():
        for name, value in table.get(rule, {"": default}).items():
            cases.append(pytest.param(rule, value, id=f"{rule}-{name}" if name else rule))
    unknown = {*only, *leave_out} - {case.id for case in cases}
    assert not unknown, f"no such variants: {sorted(unknown)} (ids: {[case.id for case in cases]})"
    return [case for case in cases if (not only or case.id in only) and case.id not in leave_out]
