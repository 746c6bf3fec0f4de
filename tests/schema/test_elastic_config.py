"""Elastic workers without a job: hardware.fault_tolerance=heal and hardware.max_workers are checked (and
refused) before launch, a new worker's static shard is chosen, and RUN_DIR/JOIN is read. Milliseconds each."""

from __future__ import annotations

import pytest

from runner.rank.agreement import Control
from runner.rank.assignment import lost_shard
from tests.conftest import checked_config


def test_heal_is_accepted_and_adds_ulfm_to_the_mpirun_command(tmp_path):
    cfg = checked_config(["hardware.fault_tolerance=heal", "hardware.oversubscribe=true"])
    assert cfg.hardware.fault_tolerance == "heal" and cfg.hardware.tolerant
    argv = cfg.hardware.plan_launch(cfg.world_size, tmp_path).argv
    assert argv[argv.index("--with-ft") + 1] == "ulfm"


def test_max_workers_without_fault_tolerance_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"hardware\.max_workers.*fault_tolerance=heal"):
        checked_config(["hardware.max_workers=4"])


def test_max_workers_below_devices_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"hardware\.max_workers=1 is invalid.*devices=2"):
        checked_config(["hardware.max_workers=1", "devices=2", "hardware.fault_tolerance=heal"])


def test_max_workers_at_or_above_devices_is_accepted():
    cfg = checked_config(["hardware.max_workers=4", "devices=2", "hardware.fault_tolerance=heal"])
    assert cfg.hardware.max_workers == 4


def test_a_bad_fault_tolerance_names_the_three_values():
    with pytest.raises(ValueError, match=r"hardware\.fault_tolerance.*none, continue, heal"):
        checked_config(["hardware.fault_tolerance=maybe"])


@pytest.mark.parametrize(
    "plans, shards",
    [
        # 4 workers, shard 2's worker lost: the survivors (renumbered 0-2) and its replacement, which takes it
        ([(0, 4), (1, 4), (3, 4), None], {3: (2, 4)}),
        # shards 1 and 3 lost, four new workers: the lost shards in order, then copies of the survivors'
        ([(0, 4), (2, 4), None, None, None, None], {2: (1, 4), 3: (3, 4), 4: (0, 4), 5: (2, 4)}),
        # nothing lost (a JOIN of 3): copies of the survivors' shards, in turn
        ([(0, 2), (1, 2), None, None, None], {2: (0, 2), 3: (1, 2), 4: (0, 2)}),
    ],
)
def test_new_workers_take_the_lost_shards_then_copies(plans, shards):
    assert {rank: lost_shard(plans, rank) for rank in shards} == shards


@pytest.mark.parametrize("text, asked", [("2", 2), ("", 1), ("\n", 1), ("+3\n", 3), ("abc", 0)])
def test_the_join_file_asks_for_workers_once(tmp_path, capsys, text, asked):
    control = Control(
        None, tmp_path, None, interval=1, split=False
    )  # only worker 0 reads the file: no communicator
    join = tmp_path / "JOIN"
    join.write_text(text)
    assert control.join_requested() == asked
    assert not join.exists(), "taken once"
    assert control.join_requested() == 0
    warned = capsys.readouterr().out
    assert (str(join) in warned and "abc" in warned) if asked == 0 else warned == ""


def test_no_join_file_asks_for_none(tmp_path):
    assert Control(None, tmp_path, None, interval=4, split=False).join_requested() == 0


def test_spares_without_heal_are_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"hardware\.spares=1 is invalid.*fault_tolerance=heal"):
        checked_config(["hardware.spares=1"])


def test_negative_spares_are_refused():
    with pytest.raises(ValueError, match=r"hardware\.spares=-1 is invalid.*0 \(none\) or more"):
        checked_config(["hardware.spares=-1", "hardware.fault_tolerance=heal"])


def test_spares_are_launched_beside_the_job_and_its_servers(tmp_path):
    """mpirun starts the workers, the servers and the spares; the job's own world has no spare in it."""
    cfg = checked_config(
        ["rule=asgd", "hardware.fault_tolerance=heal", "hardware.spares=2", "hardware.oversubscribe=true"]
    )
    assert (cfg.world_size, cfg.launched) == (cfg.devices + 1, cfg.devices + 3)
    argv = cfg.hardware.plan_launch(cfg.launched, tmp_path).argv
    assert argv[argv.index("-n") + 1] == str(cfg.devices + 3)
