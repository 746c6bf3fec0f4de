"""``model.pt`` (and ``model.rank<r>.pt``) with its size and CRC-32, so ``eval=`` notices a changed byte.

The record is the same as a checkpoint part's (``{"bytes", "crc32"}``, :func:`runner.run_folder.file_digest`),
written next to the model as ``<model>.crc`` (JSON) once the model is complete; the old record is removed
before the model is replaced, so a record never describes another model. A model saved before models were
checksummed has no record: it is checked only for being a whole ``torch.save`` file, with one warning.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from runner.folder_files import read_text
from runner.rank.checkpoint import load_checked, save_atomic
from runner.run_folder import dumps, write_atomic

#: Appended to a saved model's file name for its record.
RECORD_SUFFIX = ".crc"


def record_path(model: Path) -> Path:
    """``model.pt.crc``: where the size and CRC-32 of ``model`` are written."""
    return model.with_name(model.name + RECORD_SUFFIX)


def save_model(state: dict[str, Any], path: Path) -> dict[str, int]:
    """``torch.save`` the model ``state`` to ``path`` atomically, then its record; returns the record."""
    record_path(path).unlink(missing_ok=True)
    record = save_atomic(state, path)
    write_atomic(record_path(path), dumps(record) + "\n")
    return record


def _count(value: Any) -> bool:
    """Whether ``value`` is a whole number, 0 or more (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_record(model: Path) -> dict[str, int] | None:
    """The size and CRC-32 written with ``model``; None when it has none (saved before records were).

    Raises ValueError naming a record that cannot be read or is not one."""
    path = record_path(model)
    try:
        record = json.loads(read_text(path))  # (never through a link)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{path} is damaged ({type(err).__name__}: {err}): {model} cannot be checked"
        ) from None
    if not (isinstance(record, dict) and all(_count(record.get(k)) for k in ("bytes", "crc32"))):
        raise ValueError(f"{path} is damaged (not a size and CRC-32 record): {model} cannot be checked")
    return record


def load_model(path: Path, fix: str, map_location: Any = "cpu") -> dict[str, Any]:
    """The state dict saved at ``path``, checked against its record first.

    A failed check raises ValueError naming the file and ``fix``; without a record, one warning on stderr
    and only the whole-file check."""
    record = read_record(path)
    state = load_checked(path, record, fix, map_location=map_location)
    if record is None:
        print(
            f"warning: {path} has no size and CRC-32 record ({record_path(path).name}: saved before models "
            "were checksummed), so a changed byte cannot be noticed; evaluating it as it is",
            file=sys.stderr,
        )
    return state
