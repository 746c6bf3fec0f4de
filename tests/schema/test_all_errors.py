"""A config with several independent bad keys is refused once, with every one of them (issue 38): each line
is the message that key alone gets, naming the key, its value and the fix."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runner.schema import collected, raise_problems, require
from runner.schema.config import validate
from tests.conftest import ROOT, compose_config

#: Independent bad keys, in three sections and at the top.
BAD = ["train.epochs=0", "train.batch_size=0", "optim.lr=-1", "checkpoint.keep=0", "devices=0"]


def alone(override: str) -> str:
    """The message ``override`` gets when it is the only bad key."""
    with pytest.raises(ValueError) as refused:
        validate(compose_config([override]))
    return str(refused.value)


def test_every_independent_bad_key_is_named_at_once():
    with pytest.raises(ValueError) as refused:
        validate(compose_config(BAD))
    lines = str(refused.value).splitlines()
    assert lines[0] == f"{len(BAD)} settings are invalid:", lines
    assert sorted(line.removeprefix("  - ") for line in lines[1:]) == sorted(alone(o) for o in BAD)
    assert all(line.startswith("  - ") for line in lines[1:]), lines


def test_one_bad_key_reads_as_before():
    assert alone("train.epochs=0") == (
        "train.epochs=0 is invalid: train for at least one epoch (train.epochs=10)"
    )


def test_a_key_is_named_once_though_its_later_checks_fail_too():
    """``train.val_every_s=-1`` with validations within epochs breaks two checks of one key: the first is
    the one to fix (the second assumes it)."""
    with pytest.raises(ValueError) as refused:
        validate(compose_config(["train.val_every=0.5", "train.val_every_s=-1", "train.log_every=0"]))
    lines = str(refused.value).splitlines()
    assert lines[0] == "2 settings are invalid:", lines
    assert "train.val_every_s=-1.0 is invalid: seconds of training between validations" in lines[1]
    assert "train.log_every=0 is invalid" in lines[2]


def test_a_check_that_needs_a_failed_one_does_not_hide_it():
    """Code after a failed check that relies on it (here: indexing an empty list) does not replace the
    check's own message with its crash."""

    def post_init(shape: list[int]) -> None:
        require(len(shape) == 3, "shape", shape, "[C, H, W]")
        require(shape[1] >= 8, "shape", shape, "at least 8 pixels high")

    problems: list[str] = []
    with collected("model.", problems):
        post_init([])
    assert problems == ["model.shape=[] is invalid: [C, H, W]"]
    with pytest.raises(IndexError):  # a crash without a failed check before it is a bug, raised as such
        with collected("model.", []):
            [].pop()


def test_outside_a_collection_the_first_check_raises():
    with pytest.raises(ValueError, match=r"^epochs=0 is invalid"):
        require(False, "epochs", 0, "fix")
    raise_problems([])  # nothing to raise


def test_the_error_is_pickled_whole():
    """A sweep point run in another process (joblib) hands its error back pickled."""
    import pickle

    with pytest.raises(ValueError) as refused:
        raise_problems(["a=1 is invalid: x", "b=2 is invalid: y"])
    again = pickle.loads(pickle.dumps(refused.value))
    assert str(again) == str(refused.value) and again.problems == refused.value.problems


@pytest.mark.slow  # a launcher process: about 3 s on a loaded machine
def test_the_command_line_names_them_all_and_starts_nothing(tmp_path):
    argv = [sys.executable, "-m", "runner", f"hydra.run.dir={tmp_path}", *BAD]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output
    for override in BAD:
        assert alone(override) in output, output
    assert not (tmp_path / "mpirun.txt").exists() and "Traceback" not in output, output


def test_a_sweep_point_run_elsewhere_names_them_all_too():
    """A point run in another process (joblib) raises its error to the sweep, whose line keeps every one."""
    from runner.launcher.explain import explain

    with pytest.raises(ValueError) as refused:
        validate(compose_config(BAD))
    assert explain(refused.value, BAD) == str(refused.value)


# -- composition errors (unknown keys, values of the wrong type) with value errors, at once ---------------


@pytest.mark.slow  # (a composition per override: seconds)
def test_composition_and_value_mistakes_are_named_together_each_with_its_hint():
    """Hydra stops at the first override it cannot compose; every override is tried in turn, so each
    mistake gets the line it would get alone (its "did you mean", its keys, its ``+`` hint)."""
    from runner.launcher.explain import every_mistake

    argv = ["trian.epochs=3", "rule.alfa=0.3", "optim.lr=abc", "model.hiden=3", "checkpoint.keep=0"]
    lines = every_mistake(argv)
    assert len(lines) == 5, lines
    assert "(did you mean train?)" in lines[0]
    assert lines[1].startswith("rule.alfa: not an option of BSPConfig")
    assert lines[2].startswith("optim.lr=abc: ") and lines[2].endswith("; give a number, e.g. optim.lr=0.05")
    assert lines[3].startswith("model.hiden: not an option of CNNConfig")
    assert lines[4] == alone("checkpoint.keep=0")
    own = every_mistake(["model=custom", "model._target_=torch.nn.Linear", "model.hiden=3"])
    assert len(own) == 1 and "+model.hiden=VALUE" in own[0], own
    assert "model lists no keys yet;" in own[0], own  # (not "the keys of model are: ;")
    [plus, flag] = every_mistake(["+train.epochs=3", "hardware.oversubscribe=maybe"])
    assert plus.endswith(
        "train.epochs is a key already, so it takes no '+' (that adds a new key): train.epochs=3"
    )
    assert flag.endswith("give true or false, e.g. hardware.oversubscribe=false"), flag


@pytest.mark.slow
def test_a_group_choice_that_is_not_found_is_named_and_its_keys_not_blamed():
    from runner.launcher.explain import every_mistake

    lines = every_mistake(["data=licence", "optim.lr=0.1", "rule=easgd", "rule.alpha=0.3"])
    assert len(lines) == 1 and lines[0].startswith("data=licence: no such option"), lines
    lines = every_mistake(["rule=dilco", "rule.inner_step=5", "optim.lr=-1"])  # (not checked against BSP)
    assert [line.split(":")[0] for line in lines] == ["rule=dilco", "optim.lr=-1.0 is invalid"], lines


def test_a_key_the_chosen_rule_lacks_names_the_rules_that_have_it():
    from runner.schema.config import _other_options

    assert _other_options("rule", "alfa") == "; rule.alpha is a key of rule=easgd"
    assert _other_options("rule", "inner_step").startswith("; rule.inner_steps is a key of rule=async_diloco")
    assert _other_options("rule", "zzz") == "" and _other_options("train", "alfa") == ""


@pytest.mark.slow
def test_several_values_without_m_are_named_with_the_other_mistakes(tmp_path):
    """A single run given a sweep's values: Hydra's "Ambiguous value" alone hid the other mistakes."""
    argv = ["optim.lr=0.1,0.2", "trian.epochs=3", "devices=two", f"hydra.run.dir={tmp_path / 'run'}"]
    done = subprocess.run(
        [sys.executable, "-m", "runner", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "3 settings are invalid:" in done.stderr, done.stderr
    assert "optim.lr=0.1,0.2: several values are a sweep: add -m (python -m runner -m optim.lr=0.1,0.2)" in (
        done.stderr
    )
    assert "(did you mean train?)" in done.stderr and "give a whole number, e.g. devices=2" in done.stderr


@pytest.mark.slow
def test_the_command_line_names_composition_mistakes_all_at_once(tmp_path):
    argv = ["trian.epochs=3", "rule.alfa=0.3", "optim.lr=abc", f"hydra.run.dir={tmp_path / 'run'}"]
    done = subprocess.run(
        [sys.executable, "-m", "runner", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stderr
    assert "invalid input, nothing was started: 3 settings are invalid:" in done.stderr, done.stderr
    assert not (tmp_path / "run" / "config.yaml").exists() and "Traceback" not in done.stderr


def test_an_option_not_found_is_looked_for_in_the_projects_folders_too(tmp_path):
    """With ``hydra.searchpath`` given, "no such option" lists the project's own options, suggests the
    closest, and does not tell to add the search path that is already there."""
    from runner.launcher.explain import _no_option

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "licenses.yaml").write_text("{}\n")
    line = _no_option("data", "licence", [f"hydra.searchpath=[file://{tmp_path}]", "data=licence"])
    assert "did you mean data=licenses?" in line and "licenses, " in line, line
    assert f"looked in {tmp_path / 'data'}" in line and "hydra.searchpath=[file://DIR]" not in line
    bare = _no_option("data", "digit", ["data=digit"])
    assert "did you mean data=digits?" in bare and "hydra.searchpath=[file://DIR]" in bare
