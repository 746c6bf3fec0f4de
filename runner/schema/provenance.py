"""Whose run folder is this: the user's own, unchanged, or one from elsewhere.

The launcher marks each run folder it writes: ``provenance`` holds an HMAC-SHA256 of ``config.yaml`` under a
key of this user's, kept outside run folders (``$XDG_CONFIG_HOME/mpitrain/folder.key``, else
``~/.config/mpitrain/folder.key``, made on first use, readable by the user alone). A folder is the user's
own while its mark matches its ``config.yaml``: one copied from a colleague, a cluster or a download has no
mark this key made, and one whose ``config.yaml`` was edited since no longer matches.

From a folder that is not the user's own, ``resume=`` takes none of the values of :data:`FOREIGN_KEYS`
(keys that run a program, set the ranks' environment or name a destination for data or credentials) that
differ from the user's: each comes from the command line or the user's config, or the folder's value is taken
with ``trust_folder=true``. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from runner.run_folder import CONFIG, PROVENANCE

#: The mark's file in a run folder.
MARK = PROVENANCE
#: The file of this user's key, under the user's configuration folder.
KEY_FILE = Path("mpitrain") / "folder.key"
#: The opt-in that takes a foreign folder's values of :data:`FOREIGN_KEYS`.
TRUST = "trust_folder"

#: Keys a run folder that is not the user's own cannot set (a key ending in "." : everything under it),
#: with what each does. tests/schema/test_provenance.py holds every schema field whose name says it runs,
#: reaches or writes somewhere to be listed here or in :data:`NOT_FOREIGN`.
FOREIGN_KEYS = {
    "hardware.mpirun": "runs that program",
    "hardware.env.": "sets the ranks' environment (PYTHONPATH, LD_PRELOAD, a token)",
    "hardware.extra_args": "passes options to mpirun (-x sets the ranks' environment, --prefix and "
    "--launch-agent run programs)",
    "hardware.mca.": "sets Open MPI parameters (plm_rsh_agent and others run programs)",
    "logger.mlflow.tracking_uri": "names where metrics, the model and your MLflow credentials are sent",
    "logger.wandb.entity": "names the W&B team your metrics and model are uploaded to",
    "logger.wandb.dir": "names a folder outside the run folder to write to",
}
#: Schema fields whose names look like :data:`FOREIGN_KEYS`' but that are data, with why.
NOT_FOREIGN = {
    "data.root": "files read as data (never run); a data set's download writes only its own file names there",
    "data.file": "a text read as data",
    "data.train_file": "a text read as data",
    "data.val_file": "a text read as data",
    "hardware.hostfile": "hosts you can reach already; what runs there is your own code",
    "hardware.hosts": "hosts you can reach already; what runs there is your own code",
    "hardware.srun_mpi": "one of srun's MPI plug-ins, by name",
    "hardware.launcher": "mpirun or srun, by name",
    "hardware.env": "(its keys are listed as hardware.env.)",
}


def key_path(environ: Mapping[str, str] = os.environ) -> Path:
    """Where this user's key is kept."""
    base = environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / KEY_FILE


def user_key(create: bool = True) -> bytes | None:
    """This user's key (made on first use when ``create``); None where it cannot be read or made."""
    path = key_path()
    try:
        return path.read_bytes()
    except FileNotFoundError:
        if not create:
            return None
    except OSError:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:  # made by another launcher at the same moment
        return user_key(create=False)
    except OSError:
        return None
    with os.fdopen(fd, "wb") as out:
        out.write(secrets.token_bytes(32))
    return path.read_bytes()


def digest(key: bytes, config_text: bytes) -> str:
    return hmac.new(key, b"mpitrain run folder\0" + config_text, hashlib.sha256).hexdigest()


def mark(run_dir: Path, config_text: str) -> str | None:
    """The mark of ``config_text`` for ``run_dir``: the text to write as its :data:`MARK`.

    ``config_text``: the ``config.yaml`` just written, or a sweep's recorded overrides (:func:`sweep_text`).
    None where this user has no key (every folder is then foreign)."""
    key = user_key()
    return None if key is None else digest(key, config_text.encode()) + "\n"


def is_own(run_dir: Path, config: str = CONFIG, text: str | None = None) -> bool:
    """Whether ``run_dir`` was written by this user's runner and its ``config.yaml`` is unchanged since.

    With ``text`` (what a sweep folder's mark is of), that text is checked instead of the ``config.yaml``."""
    key = user_key(create=False)
    if key is None:
        return False
    try:
        given = (run_dir / MARK).read_text().strip()
        body = (run_dir / config).read_bytes() if text is None else text.encode()
    except (OSError, UnicodeDecodeError):
        return False
    return hmac.compare_digest(given, digest(key, body))


def sweep_text(overrides: Any) -> str:
    """What a sweep folder's mark is of: its recorded overrides, as canonical JSON.

    The overrides are ``multirun.yaml``'s ``hydra.overrides``, with ``hardware.env``'s values hidden."""
    from runner.schema.secrets import hidden

    plain = (
        OmegaConf.to_container(overrides) if isinstance(overrides, (DictConfig, ListConfig)) else overrides
    )
    return json.dumps(hidden(plain), sort_keys=True)


def foreign_overrides(overrides: list[str], given: set[str]) -> list[str]:
    """The recorded overrides of a foreign sweep folder that set :data:`FOREIGN_KEYS` or Hydra's launcher.

    A sweep folder is foreign when it is not the user's own. A setting of Hydra's launcher:
    ``hydra.launcher.*`` (submitit's ``setup`` lines run in the job script). The keys the command line gives
    (``given``) are left out; each override comes with what it does."""
    from runner.schema.identity import override_key

    found = []
    for override in overrides:
        key = override_key(override)
        why = listed(key) or (
            "configures the launcher (setup lines run)" if key.startswith("hydra.launcher.") else None
        )
        if why is not None and key not in given and not any(key.startswith(g + ".") for g in given):
            found.append(f"{override} ({why})")
    return found


def listed(key: str) -> str | None:
    """What ``key`` does, where it is one of :data:`FOREIGN_KEYS` (or under one ending in "."), else None."""
    for name, why in FOREIGN_KEYS.items():
        if key == name or (name.endswith(".") and key.startswith(name)):
            return why
    return None


def flat(node: Any, prefix: str = "") -> dict[str, Any]:
    """``dotted.key -> value`` of the leaves of a plain mapping (a mapping's keys one level down each)."""
    if not isinstance(node, Mapping):
        return {prefix: node}
    out: dict[str, Any] = {}
    for name, value in node.items():
        key = f"{prefix}.{name}" if prefix else str(name)
        if isinstance(value, Mapping) and value:
            out.update(flat(value, key))
        else:
            out[key] = value
    return out


def foreign_values(folder: Mapping[str, Any], own: Callable[[str], Any], given: set[str]) -> list[str]:
    """The values of :data:`FOREIGN_KEYS` that the folder's config holds and the user's does not.

    Each as ``key=value (what it does)``. ``folder``: the folder's config, plain; ``own(key)``: the value
    composed from the user's files and command line, ``"???"`` where it has none. The keys the command line
    gave (``given``) are left out."""
    found = []
    for key, value in flat(folder).items():
        why = listed(key)
        if why is None or key in given or any(key.startswith(g + ".") for g in given):
            continue
        mine = own(key)
        if isinstance(mine, (DictConfig, ListConfig)):
            mine = OmegaConf.to_container(mine)
        if mine == value or (mine == "???" and value in (None, [], {})):
            continue
        found.append(f"{key}={value!r} ({why})")
    return found
