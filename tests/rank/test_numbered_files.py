"""The numbers in a run folder's names and files have one parser: ASCII digits, a few of them. A name that
is no number of the runner's (``generation.²``, ``rank².beat``) is not one of its files; a generation no
membership change of the job claimed does not stop it."""

from __future__ import annotations

import pytest

from runner.launcher.failures import failure_report
from runner.launcher.watchdog import spawned_ids
from runner.rank.fence import Fence, Partitioned
from runner.report.runs import run_folders
from runner.run_folder import rebuild_checkpoint_index


@pytest.mark.parametrize(
    ("text", "number"),
    [("5", 5), ("00003", 3), ("123456789", 123456789), ("1234567890", None), ("²", None), ("٣", None)]
    + [("", None), ("+5", None), ("-1", None), (" 5", None), ("5\n", None), ("1_000", None), ("0x1", None)],
)
def test_one_parser_takes_ascii_digits_and_few_of_them(text, number):
    from runner.run_folder import parse_number

    assert parse_number(text) == number


@pytest.fixture
def logs(tmp_path):
    (tmp_path / "logs").mkdir()
    return tmp_path / "logs"


def test_a_generation_named_by_no_number_neither_ends_nor_fences_the_job(tmp_path, logs, capsys):
    """Before: ``logs/generation.²`` ended a fault-tolerant job with ValueError (isdigit, then int)."""
    (logs / "generation.²").write_text("x\n")
    fence = Fence(tmp_path, True)
    assert fence.current() == 0
    fence.check("the summary")
    assert f"{logs / 'generation.²'} was not written by this job" in capsys.readouterr().out


def test_a_generation_no_membership_change_claimed_is_named_once_and_ignored(tmp_path, logs, capsys):
    """Before: a planted ``logs/generation.5`` stopped a healthy job as partitioned ("the job exited 0 but
    wrote no summary.json"). Claims follow one another from the job's start: 5 without 1 to 4 is none."""
    (logs / "generation.5").write_text("0@a\n")
    fence = Fence(tmp_path, True)
    for _ in range(3):
        fence.check("checkpoint 00001-step5")
    out = capsys.readouterr().out
    assert out == (
        f"warning: {logs / 'generation.5'} was not written by this job (no worker was lost, so it claimed no "
        "generation): ignored; remove it\n"
    )
    assert fence.claim("0@a") and (logs / "generation.1").read_text() == "0@a\n"
    fence.advance()
    fence.check("the summary")  # at generation 1: generation.5 is still no claim (2 to 4 are missing)
    (logs / "generation.2").write_text("1@b\n")  # a later membership's claim: this side is fenced out
    with pytest.raises(
        Partitioned, match=r"generation 2, this side is at generation 1; .*generation.2 claims"
    ):
        fence.check("the summary")


def test_a_link_in_place_of_the_next_claim_is_no_claim(tmp_path, logs, capsys):
    """Before: a link there made the side that should go on stop, as if another side had claimed first."""
    (logs / "generation.1").symlink_to(tmp_path / "nowhere")
    fence = Fence(tmp_path, True)
    assert fence.current() == 0
    assert fence.claim("0@a") and (logs / "generation.1").read_text() == "0@a\n"
    assert not (tmp_path / "nowhere").exists()
    assert "generation.1 is a symbolic link" in capsys.readouterr().out


def test_a_heartbeat_named_by_no_number_is_no_spawned_worker(logs):
    """Before: ``rank².beat`` ended the stall watchdog with ValueError (isdigit, then int)."""
    for name in ("rank0.beat", "rank1.beat", "rank5.beat", "rank².beat", "rank12345678901.beat"):
        (logs / name).write_text("{}")
    assert spawned_ids(logs, 2) == [5]


def test_an_error_file_named_by_no_number_hides_no_rank_s_cause(tmp_path, logs):
    """Before: ``rank².error`` made the causes of every rank be dropped."""
    (logs / "rank1.error").write_text("ValueError: the real cause (x.py:1)\n")
    (logs / "rank².error").write_text("planted\n")
    (logs / "rank0.error").symlink_to(tmp_path / "elsewhere")
    failure = failure_report(tmp_path, 1)
    assert failure.rank == 1 and failure.cause == "ValueError: the real cause (x.py:1)"


def test_checkpoint_folders_are_named_by_numbers_of_ascii_digits(tmp_path):
    (tmp_path / "checkpoints" / "00001-step²").mkdir(parents=True)
    (tmp_path / "checkpoints" / "0000²-step5").mkdir()
    (tmp_path / "checkpoints" / "00002-step10").mkdir()
    entries, skipped = rebuild_checkpoint_index(tmp_path)
    assert entries == [] and skipped == [
        "00002-step10: no entry.json (written before checkpoints kept their entry)"
    ]


def test_a_sweep_folder_named_by_no_number_is_sorted_after_the_points(tmp_path):
    """Before: a sweep's subfolder ``²`` ended the report with ValueError (isdigit, then int)."""
    for name in ("10", "2", "²", "notes"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text("{}")
    assert [p.name for p in run_folders(tmp_path)] == ["2", "10", "notes", "²"]
