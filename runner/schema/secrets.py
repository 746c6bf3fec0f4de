"""``hardware.env``'s values are the job's secrets: they reach the ranks through mpirun's environment only.

Never through a file, a name or a command line.

A token given as ``hardware.env.WANDB_API_KEY=...`` (better: ``=${oc.env:WANDB_API_KEY}``) used to land in the
run folder's ``config.yaml``, Hydra's records, ``run.json``, the run's name (so the TensorBoard folder's name)
and the trackers' params, and in ``ps`` through mpirun's ``-x KEY=VALUE``. Now every such value is written as
:data:`HIDDEN`: :func:`hidden` masks a config tree or a record (and the ``hardware.env...=VALUE`` overrides in
its strings), :func:`hide_file` a YAML file Hydra wrote; mpirun gets ``-x KEY`` and the value in its own
environment. ``resume=`` takes a hidden value from the command line again, else from the launcher's
environment variable of the same name (:func:`fill_hidden`), else refuses naming the key.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: What a value of ``hardware.env`` is written as.
HIDDEN = "<hidden>"
#: A ``hardware.env`` override's value, in any string (``+hardware.env.TOKEN=abc``, Hydra's override dirname).
OVERRIDE = re.compile(r"((?:\+\+|\+|~)?hardware\.env(?:\.[A-Za-z0-9_]+)?=)([^,\s]+)")


def hidden(node: Any, path: tuple[str, ...] = ()) -> Any:
    """A copy of a config tree or record (dicts, lists, strings) with its ``hardware.env`` values hidden.

    Every value under ``hardware.env`` and every ``hardware.env...=VALUE`` in its strings is written as
    :data:`HIDDEN`."""
    if isinstance(node, Mapping):
        under_env = path[-2:] == ("hardware", "env")
        return {
            k: HIDDEN if under_env or str(k).startswith("hardware.env") else hidden(v, (*path, str(k)))
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [hidden(item, path) for item in node]
    if isinstance(node, str):
        return OVERRIDE.sub(lambda m: m.group(1) + HIDDEN, node)
    return node


def hide_file(path: Path) -> None:
    """Rewrite the YAML file ``path`` with its ``hardware.env`` values hidden, atomically.

    ``path``: Hydra's ``config.yaml``, ``hydra.yaml``, ``overrides.yaml``, ``multirun.yaml``. Nothing when it
    holds none."""
    import yaml

    from runner.run_folder import write_atomic

    try:
        text = path.read_text()
    except OSError:
        return
    if "env" not in text:
        return
    data = yaml.safe_load(text)
    masked = hidden(data)
    if masked != data:
        write_atomic(path, yaml.safe_dump(masked, sort_keys=False))


def fill_hidden(
    env: dict[str, Any], given: set[str], config: Path, environ: Mapping[str, str] = os.environ
) -> None:
    """``resume=``: give each hidden value of ``env`` (the run's ``hardware.env``) back.

    From the launcher's environment variable of the same name unless the command line gave it (``given``:
    those keys). Raises ValueError naming every key left without a value, and the fixes."""
    missing = []
    for key, value in env.items():
        if value != HIDDEN or key in given:
            continue
        if key in environ:
            env[key] = environ[key]
        else:
            missing.append(key)
    if missing:
        names = ", ".join(f"hardware.env.{k}" for k in missing)
        raise ValueError(
            f"{names}: {config} keeps no value of hardware.env (its values are secrets); give "
            f"{'them' if len(missing) > 1 else 'it'} again on the command line "
            f"(hardware.env.{missing[0]}=...) or export {' '.join(missing)} before resume="
        )


def restored_override(text: str, environ: Mapping[str, str] = os.environ) -> str:
    """A recorded override whose ``hardware.env`` value was hidden, given back; any other override as it is.

    Given back as an interpolation of the launcher's environment variable of the same name
    (``+hardware.env.TOKEN=${oc.env:TOKEN}``: the value still appears on no command line). Raises ValueError
    naming the key when that variable is not set (or the whole ``hardware.env`` map was given)."""
    found = OVERRIDE.fullmatch(text)
    if found is None or found.group(2) != HIDDEN:
        return text
    key = found.group(1).rstrip("=").lstrip("+~").removeprefix("hardware.env").lstrip(".")
    if key and key in environ:
        return f"{found.group(1)}${{oc.env:{key}}}"
    name = f"hardware.env.{key}" if key else "hardware.env"
    raise ValueError(
        f"{name}: the sweep's records keep no value of hardware.env (its values are secrets); export "
        f"{key or 'its variables'} before resume=, or give {name}=... again with it"
    )
