"""Damaged checkpoints, in process: every part is checked against the size and CRC-32 written with it,
``resume=`` names a damaged newest checkpoint and falls back to the newest intact one (decided in the
launcher, so every rank takes the same), a damaged ``checkpoint.json`` is rebuilt exactly from the folders'
``entry.json``, checkpoints written before parts were checksummed still resume, and ``eval=`` of a damaged
``model.pt`` says so in one line."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from omegaconf import OmegaConf

from runner.launcher.resume import indexed_checkpoints, resume_checkpoint
from runner.rank.checkpoint import Checkpointer, latest_checkpoint, load_part, save_atomic
from runner.run_folder import (
    DamagedIndex,
    file_digest,
    part_damage,
    read_checkpoint_index,
    rebuild_checkpoint_index,
)
from runner.schema.sections import CheckpointConfig
from tests.conftest import compose_config
from tests.helpers.fakecomm import FakeWorld


def checkpoints(run_dir, steps=(2, 4, 6), resumed=None, keep=5) -> list[dict]:
    """Two ranks write a checkpoint after each of ``steps`` (continuing ``resumed``); the index after."""

    def main(comm):
        ckpt = Checkpointer(CheckpointConfig(every=2, keep=keep), run_dir, comm, resumed)
        for step in steps:
            part = {"w": torch.full((256,), float(step + comm.rank)), "step": step}
            ckpt.save(
                step, part, {"epoch": 0, "metrics_lines": step, "validation": {"val_loss": float("nan")}}
            )

    FakeWorld(2).run(main)
    return read_checkpoint_index(run_dir)


def part(run_dir, folder: str, rank: int = 0):
    return run_dir / "checkpoints" / folder / f"rank{rank}.pt"


def truncate(path, keep: int) -> int:
    """Cut ``path`` to its first ``keep`` bytes; returns the size it had."""
    data = path.read_bytes()
    path.write_bytes(data[:keep])
    return len(data)


@pytest.fixture
def warnings(caplog):
    """The launcher's warnings (``runner`` logger), as their messages."""
    caplog.set_level(logging.WARNING, logger="runner")
    return lambda: [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def test_save_records_the_size_and_crc_of_what_it_wrote(tmp_path):
    path = tmp_path / "model.pt"
    assert save_atomic({"w": torch.arange(1000.0), "n": [1, "a"]}, path) == file_digest(path)


def test_each_kind_of_damage_to_a_part_is_named(tmp_path):
    [entry] = checkpoints(tmp_path, steps=(2,))
    path, record = part(tmp_path, "00001-step2"), entry["parts"][0]
    data = path.read_bytes()
    assert part_damage(path, record) is None and part_damage(path, None) is None
    path.write_bytes(data[:100])
    assert part_damage(path, record) == f"truncated: 100 of {len(data)} bytes"
    assert part_damage(path, None) == "not a whole torch.save file: truncated or overwritten, 100 bytes"
    path.write_bytes(data + b"\0")
    assert part_damage(path, record) == f"wrong size: {len(data) + 1} of {len(data)} bytes"
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1  # inside the tensor's bytes: torch.load alone reads it without a word
    path.write_bytes(flipped)
    assert part_damage(path, record).startswith("checksum mismatch: CRC-32 ")
    assert torch.load(path, weights_only=True)["w"].shape == (256,)
    with pytest.raises(ValueError, match=r"00001-step2/rank0.pt is damaged \(checksum mismatch") as err:
        load_part(tmp_path, entry, 0)
    assert "\n" not in str(err.value)
    path.unlink()
    assert part_damage(path, record) == "missing"
    path.mkdir()
    assert part_damage(path, None).startswith("unreadable: ")


def test_resume_names_a_truncated_newest_checkpoint_and_every_rank_takes_the_previous(tmp_path, warnings):
    entries = checkpoints(tmp_path)
    size = truncate(part(tmp_path, "00003-step6"), 1234)
    chosen = resume_checkpoint(tmp_path, str(tmp_path))
    assert chosen == entries[1]
    assert warnings() == [
        f"checkpoint checkpoints/00003-step6/rank0.pt is damaged (truncated: 1234 of {size} bytes): "
        "resuming from 00002-step4 (set aside as 00003-step6.damaged)"
    ]
    assert read_checkpoint_index(tmp_path) == entries[:2] and latest_checkpoint(tmp_path, 2) == chosen
    assert (tmp_path / "checkpoints/00003-step6.damaged/rank0.pt").stat().st_size == 1234
    assert not (tmp_path / "checkpoints/00003-step6").exists()
    assert load_part(tmp_path, chosen, 1)["step"] == 4
    # the resumed run's next checkpoint takes the set-aside one's place in the sequence; a rebuild agrees
    after = checkpoints(tmp_path, steps=(5,), resumed=chosen)
    assert [e["dir"] for e in after] == ["00001-step2", "00002-step4", "00003-step5"]
    assert rebuild_checkpoint_index(tmp_path) == (after, [])


def test_several_damaged_checkpoints_are_named_in_one_line_and_none_left_is_an_error(tmp_path, warnings):
    checkpoints(tmp_path)
    part(tmp_path, "00003-step6", 1).unlink()
    truncate(part(tmp_path, "00002-step4"), 0)
    assert resume_checkpoint(tmp_path, "RUN")["dir"] == "00001-step2"
    [line] = warnings()
    assert line.startswith(
        "checkpoints checkpoints/00003-step6/rank1.pt (missing), checkpoints/00002-step4/rank0.pt "
        "(truncated: 0 of "
    )
    assert line.endswith(
        "are damaged: resuming from 00001-step2 (set aside as 00003-step6.damaged, 00002-step4.damaged)"
    )
    truncate(part(tmp_path, "00001-step2", 1), 10)
    with pytest.raises(ValueError) as err:
        resume_checkpoint(tmp_path, "RUN")
    assert str(err.value).startswith(
        "resume=RUN: no intact checkpoint is left: checkpoints/00001-step2/rank1.pt (truncated: 10 of "
    )
    assert "start the run again (without resume=)" in str(err.value)
    assert read_checkpoint_index(tmp_path)[-1]["dir"] == "00001-step2", "nothing is changed then"


BAD_INDEXES = {
    "torn": '{"checkpoints": [{"step": 2',
    "not text": b"\xff\xfe\x00",
    "not an index": "[]",
    "entry of another folder": "RENAME",
    "out of order": "REVERSE",
}


@pytest.mark.parametrize("damage", BAD_INDEXES)
def test_a_damaged_index_is_named_and_rebuilt_exactly_from_the_folders(tmp_path, warnings, damage):
    entries = checkpoints(tmp_path)
    index = tmp_path / "checkpoints/checkpoint.json"
    bad = BAD_INDEXES[damage]
    if bad in ("RENAME", "REVERSE"):
        wrong = [dict(e) for e in entries]
        wrong = wrong[::-1] if bad == "REVERSE" else [*wrong[:2], {**wrong[2], "dir": "00003-step7"}]
        bad = json.dumps({"checkpoints": wrong})
    index.write_bytes(bad if isinstance(bad, bytes) else bad.encode())
    with pytest.raises(DamagedIndex, match=f"{index} is damaged"):
        read_checkpoint_index(tmp_path)
    with pytest.raises(ValueError, match="is damaged .*: resume= again rebuilds it from the checkpoint"):
        latest_checkpoint(tmp_path, 2)
    assert indexed_checkpoints(tmp_path, "RUN") == entries
    assert read_checkpoint_index(tmp_path) == entries
    [line] = warnings()
    assert line.startswith("checkpoints/checkpoint.json is damaged (")
    assert line.endswith("): rebuilt from the checkpoint folders (00001-step2, 00002-step4, 00003-step6)")


def test_a_rebuild_leaves_out_what_is_no_complete_checkpoint_of_the_latest_attempt(tmp_path, warnings):
    """Folders without entry.json (older checkpoints, or parts of one never completed), set aside as
    damaged, or of an attempt that a resume went back from (its checkpoints never indexed)."""
    entries = checkpoints(tmp_path, steps=(2, 4, 6, 8))
    index = tmp_path / "checkpoints/checkpoint.json"
    index.write_text(json.dumps({"checkpoints": entries[:2]}))  # 00003 and 00004: indexing never happened
    resumed = checkpoints(tmp_path, steps=(5,), resumed=entries[1])
    (tmp_path / "checkpoints/00009-step20").mkdir()
    (tmp_path / "checkpoints/00002-step4.damaged").mkdir()
    index.write_text("")
    assert indexed_checkpoints(tmp_path, "RUN") == resumed
    [line] = warnings()
    assert line.endswith(
        "(00001-step2, 00002-step4, 00003-step5); left out: 00009-step20: no entry.json (written before "
        "checkpoints kept their entry); 00004-step8: left by an attempt that 00003-step5 replaced; "
        "00003-step6: left by an attempt that 00003-step5 replaced"
    )


def test_a_damaged_index_of_folders_without_entry_json_is_an_error_naming_it(tmp_path):
    checkpoints(tmp_path)
    for kept in (tmp_path / "checkpoints").glob("*/entry.json"):
        kept.unlink()
    (tmp_path / "checkpoints/checkpoint.json").write_text("{")
    with pytest.raises(ValueError, match="checkpoint.json is damaged") as err:
        indexed_checkpoints(tmp_path, "RUN")
    assert "00003-step6: no entry.json" in str(err.value) and "start the run again" in str(err.value)
    (tmp_path / "checkpoints/checkpoint.json").unlink()
    with pytest.raises(ValueError, match="checkpoint.json is missing"):
        indexed_checkpoints(tmp_path, "RUN")


def test_a_missing_index_is_rebuilt_from_folders_complete_before_it_was_written(tmp_path, warnings):
    entries = checkpoints(tmp_path)
    (tmp_path / "checkpoints/checkpoint.json").unlink()
    assert indexed_checkpoints(tmp_path, "RUN") == entries
    assert warnings()[0].startswith("checkpoints/checkpoint.json is missing: rebuilt from the checkpoint")


def test_a_rank_rebuilds_an_index_damaged_during_the_run(tmp_path, capsys):
    cfg = CheckpointConfig(every=2, keep=5)

    def main(comm):
        ckpt = Checkpointer(cfg, tmp_path, comm, None)
        ckpt.save(2, {"w": torch.zeros(3)})
        if comm.rank == 0:
            (tmp_path / "checkpoints/checkpoint.json").write_text("{")
        ckpt.save(4, {"w": torch.ones(3)})

    FakeWorld(2).run(main)
    assert [e["dir"] for e in read_checkpoint_index(tmp_path)] == ["00001-step2", "00002-step4"]
    assert "checkpoint.json is damaged (not JSON: " in capsys.readouterr().out


def test_checkpoints_written_before_parts_were_checksummed_still_resume(tmp_path, warnings):
    """No ``parts`` in the index, no entry.json: whether each part is a whole torch.save file is checked."""
    entries = [{k: v for k, v in e.items() if k != "parts"} for e in checkpoints(tmp_path)]
    (tmp_path / "checkpoints/checkpoint.json").write_text(json.dumps({"checkpoints": entries}))
    for kept in (tmp_path / "checkpoints").glob("*/entry.json"):
        kept.unlink()
    assert resume_checkpoint(tmp_path, "RUN") == entries[-1] and warnings() == []
    assert load_part(tmp_path, entries[-1], 1)["step"] == 6
    truncate(part(tmp_path, "00003-step6"), 500)
    assert resume_checkpoint(tmp_path, "RUN") == entries[1]
    assert warnings() == [
        "checkpoint checkpoints/00003-step6/rank0.pt is damaged (not a whole torch.save file: truncated or "
        "overwritten, 500 bytes): resuming from 00002-step4 (set aside as 00003-step6.damaged)"
    ]


def test_eval_of_a_truncated_model_says_so_in_one_line(tmp_path, capsys):
    from runner.rank import evaluate
    from runner.schema.config import load, schema_paths

    cfg = compose_config(["model=mlp"])
    saved = OmegaConf.to_container(cfg, resolve=True)
    saved["_schemas_"] = schema_paths(cfg)
    OmegaConf.save(saved, tmp_path / "config.yaml")
    save_atomic(load(tmp_path / "config.yaml").model.build().state_dict(), tmp_path / "model.pt")
    size = truncate(tmp_path / "model.pt", 2000)
    with pytest.raises(SystemExit) as done:
        evaluate.main([str(tmp_path)])
    assert done.value.code == 2
    assert capsys.readouterr().err == (
        f"cannot evaluate {tmp_path}: {tmp_path / 'model.pt'} is damaged (not a whole torch.save file: "
        f"truncated or overwritten, 2000 bytes): train the run again to evaluate it\n"
    )
    assert size > 2000


class _NotWeights:
    """An object torch.load(weights_only=True) refuses (a class of no allow-list)."""


def test_a_part_written_so_that_torch_refuses_it_gets_advice_that_works(tmp_path, warnings):
    """A checkpoint part whose size and CRC-32 are those recorded with it (written this way: crafted, or
    saved by other code) but which torch refuses to load as weights: ``resume=`` finds nothing damaged, so
    "resume= again passes over it" would fail again. The advice names the move that makes it pass over."""
    import shutil

    entries = checkpoints(tmp_path, steps=(2, 4))
    newest = entries[-1]
    path = part(tmp_path, newest["dir"])
    torch.save({"w": _NotWeights()}, path)
    record = file_digest(path)
    newest["parts"][0] = {"bytes": record["bytes"], "crc32": record["crc32"]}
    index = tmp_path / "checkpoints" / "checkpoint.json"
    index.write_text(json.dumps({"checkpoints": entries}))
    assert resume_checkpoint(tmp_path, str(tmp_path))["dir"] == newest["dir"]  # nothing damaged on disk
    with pytest.raises(ValueError, match="it was written this way, not damaged since") as err:
        load_part(tmp_path, newest, 0)
    folder = tmp_path / "checkpoints" / newest["dir"]
    assert f"mv {folder} {folder}.damaged" in str(err.value) and "passes over" not in str(err.value)
    shutil.move(folder, f"{folder}.damaged")  # the advice, followed
    assert resume_checkpoint(tmp_path, str(tmp_path))["dir"] == entries[0]["dir"]
