"""Value checks for config schemas: a ValueError that names the key and says how to fix it."""

from __future__ import annotations

from typing import Any


def require(ok: bool, key: str, value: Any, hint: str) -> None:
    """Raise a ValueError naming ``key`` (relative to its group) unless ``ok``."""
    if not ok:
        raise ValueError(f"{key}={value!r} is invalid: {hint}")


def one_of(key: str, value: Any, choices: tuple[str, ...]) -> None:
    require(value in choices, key, value, "choose one of " + ", ".join(choices))
