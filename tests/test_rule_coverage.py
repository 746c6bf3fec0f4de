"""What CI's real jobs cover of every rule: the families that sample rules (tests/helpers/rules.py's
``SAMPLED``) rely on three that run every rule, so those must keep every rule; a sample names variants that
exist (a renamed rule fails here, not by silently leaving a family)."""

from __future__ import annotations

import pytest

from tests.helpers.kill_battery import MODES, cases
from tests.helpers.rules import SAMPLED, rules, variants
from tests.jobs.test_kill_battery import test_a_worker_killed_at_a_drawn_moment_is_survived as battery
from tests.jobs.test_lm_rules import test_rule_trains_the_gpt_on_shakespeare_chars_with_4_workers as on_gpt
from tests.rules.test_rules_train import test_rule_trains_the_cnn_on_digits_with_4_workers as on_digits


def parametrized(test) -> dict[str, list]:
    """The values each of ``test``'s parametrize marks gives, by argument names."""
    return {mark.args[0]: list(mark.args[1]) for mark in test.pytestmark if mark.name == "parametrize"}


def rule_of(value) -> str:
    return value.values[0] if hasattr(value, "values") else value


def test_every_rule_trains_on_digits_and_on_the_gpt_in_real_jobs():
    assert sorted(map(rule_of, parametrized(on_digits)["rule"])) == rules()
    assert sorted({rule_of(v) for v in parametrized(on_gpt)["rule, setting"]}) == rules()


def test_every_rule_is_killed_under_both_modes_in_real_jobs():
    marks = parametrized(battery)
    assert set(marks["mode"]) == set(MODES) == {"continue", "heal"}
    ran = {case.partition("-")[0] for case in marks["case"]}
    assert ran == set(rules()) and set(marks["case"]) == set(cases())


def test_the_sample_names_one_variant_of_each_kind_that_exists():
    table = {"easgd": {"sync": 1, "async": 2}}
    kept = [case.id for case in variants(table, default=0, only=SAMPLED)]
    assert sorted(kept) == sorted(SAMPLED) and set(SAMPLED) < {c.id for c in variants(table, default=0)}


@pytest.mark.parametrize("key", ["only", "leave_out"])
def test_a_sample_naming_no_variant_fails(key):
    with pytest.raises(AssertionError, match="no such variants: \\['easgd'\\]"):
        variants({"easgd": {"sync": 1, "async": 2}}, default=0, **{key: ("easgd",)})
