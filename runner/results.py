"""A run's validation results: what ``summary.json`` keeps of them, and early stopping's decision.

``history`` is the list of validation records (one dict per validation, ``val_acc``... for the model the run
reports, ``<name>_val_acc``... for a rule's other models); the reported model's keys start with ``prefix``
(empty for every rule so far).
"""

from __future__ import annotations

from typing import Any

from runner.tasks import maximized


def best(metric: str, values: list[float]) -> float:
    """The best of ``values`` of ``metric``: the largest accuracy, the smallest loss."""
    return (max if maximized(metric) else min)(values)


def final_and_best(history: list[dict[str, float]], prefix: str = "") -> dict[str, Any]:
    """``final_<metric>`` and ``best_<metric>`` for each validation metric of the reported model.

    The accuracy and loss keys are present (None) even before the first validation."""
    out: dict[str, Any] = dict.fromkeys(("final_val_acc", "final_val_loss", "best_val_acc", "best_val_loss"))
    for key in history[-1] if history else ():
        name = key[len(prefix) :]
        if key.startswith(prefix) and name.startswith("val_"):
            out[f"final_{name}"] = history[-1][key]
            out[f"best_{name}"] = best(name, [r[key] for r in history if key in r])
    return out


def no_improvement(history: list[dict[str, float]], key: str, patience: int | None) -> bool:
    """Whether the last ``patience`` validations have not improved on the best ``key`` before them.

    ``patience`` None: never. Every worker sees the same all-reduced values, so all decide alike."""
    values = [r[key] for r in history if key in r]
    if patience is None or len(values) <= patience:
        return False
    before = best(key, values[:-patience])
    return best(key, [before, *values[-patience:]]) == before
