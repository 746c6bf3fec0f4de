"""Hydra's registration, in the launcher.

It registers the schemas, the ``mpitrain://`` source of the groups' schemas, the Slurm launcher's defaults,
and the resolvers that name run folders."""

from __future__ import annotations

import importlib.util
import itertools
from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from runner.folder_files import dangling_link
from runner.run_folder import HYDRA_DIR
from runner.schema.config import Config
from runner.schema.source import register_source


def unique_dir(path: str, resume: str | None = None, evaluated: str | None = None) -> str:
    """``path`` if this call could create it, else the first of ``path-2``, ``path-3``... it could.

    The directories are made here with one atomic ``mkdir`` each, so two launchers started in the same second
    (two ``outputs/DATE/TIME``) never get the same folder. With ``resume`` or ``evaluated`` (``eval=``), that
    run's folder."""
    if resume or evaluated:
        return resume or evaluated
    base = Path(path)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        for n in itertools.count(1):
            candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                candidate.mkdir()
            except FileExistsError:
                continue
            return str(candidate)
    except OSError as err:
        raise OSError(
            err.errno,
            f"cannot make the run folder {base}: {err.strerror or err}; run from a folder you can write, or "
            "give one with hydra.run.dir=... (hydra.sweep.dir=... for a sweep)",
        ) from None
    raise AssertionError("unreachable")


#: The keys of a run's and a sweep's folder on the command line.
FOLDER_KEYS = ("hydra.run.dir", "hydra.sweep.dir")


def check_folders(argv: list[str]) -> None:
    """Make the run or sweep folder given on the command line (``hydra.run.dir=PATH``) before Hydra does.

    A folder it cannot make (unwritable, too long a name, under a file) is then named in one line with its key
    (Hydra would print a traceback); raises OSError."""
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if not sep or key not in FOLDER_KEYS or "${" in value or not value:
            continue
        try:
            Path(value).expanduser().mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise OSError(
                err.errno,
                dangling_link(key, value)
                or f"{key}={value}: cannot make this folder: {err.strerror or err}; give a folder you can "
                "write, with a shorter name",
            ) from None


#: Hydra's options that a plugin of an extra of pyproject.toml provides: group -> option -> (the plugin's
#: module, its distribution, the extra).
PLUGINS: dict[str, dict[str, tuple[str, str, str]]] = {
    "hydra/launcher": {
        "joblib": ("hydra_plugins.hydra_joblib_launcher", "hydra-joblib-launcher", "joblib"),
        **{
            name: ("hydra_plugins.hydra_submitit_launcher", "hydra-submitit-launcher", "slurm")
            for name in ("submitit_local", "submitit_slurm", "mpitrain_slurm")
        },
    },
    "hydra/sweeper": {"optuna": ("hydra_plugins.hydra_optuna_sweeper", "hydra-optuna-sweeper", "optuna")},
}


def missing_plugin(group: str, option: str) -> str | None:
    """The line for ``group=option`` (``hydra/launcher=joblib``) whose plugin, an extra, is not installed.

    Hydra says only that it cannot find the option. None otherwise."""
    if option not in PLUGINS.get(group, {}):
        return None
    module, distribution, extra = PLUGINS[group][option]
    try:
        if importlib.util.find_spec(module) is not None:
            return None
    except ImportError:  # no plugin at all: no hydra_plugins package
        pass
    return (
        f"{group}={option} needs Hydra's {distribution} plugin, which is not installed: "
        f'pip install -e ".[{extra}]" in a checkout of mpitrain, or pip install "mpitrain[{extra}]" where it '
        "was installed as a package"
    )


def check_plugins(argv: list[str]) -> None:
    """Refuse a command-line option (``hydra/launcher=joblib``) whose plugin, an extra, is not installed.

    It is refused before Hydra composes, naming the extra and its install command; raises ValueError."""
    for arg in argv:
        key, sep, value = arg.lstrip("+").partition("=")
        if sep and (line := missing_plugin(key, value.strip())):
            raise ValueError(line)


def register_sweep_launcher() -> None:
    """Make ``hydra/launcher=mpitrain_slurm``'s launcher known to Hydra (when the `slurm` extra is installed).

    It is made known by the name its config targets, as Hydra takes launchers only from its ``hydra_plugins``
    package."""
    try:
        from hydra.core.plugins import Plugins

        from runner.hardware.slurm import SLURM_LAUNCHER
        from runner.launcher.slurm_sweep import MpitrainSlurmLauncher
    except ImportError:  # hydra-submitit-launcher is not installed
        return
    Plugins.instance().class_name_to_class[SLURM_LAUNCHER] = MpitrainSlurmLauncher


def register() -> None:
    """Make the schemas known to Hydra (idempotent).

    The schemas are ``schema`` here and the groups' through ``mpitrain://``; also the resolver
    ``${mpitrain_unique:PATH}`` (:func:`unique_dir`) that ``hydra.run.dir`` and ``hydra.sweep.dir`` use. It is
    cached, so every read of one config (and of the sweep points' configs, which Hydra gives the cache of the
    sweep's config) sees the same folder."""
    from runner.hardware.slurm import register_launcher

    ConfigStore.instance().store(name="schema", node=Config)
    register_source()
    register_launcher()
    register_sweep_launcher()
    OmegaConf.register_new_resolver("mpitrain_unique", unique_dir, use_cache=True, replace=True)
    OmegaConf.register_new_resolver(
        "mpitrain_hydra_subdir",
        lambda resume, now, evaluated=None: (
            f"{HYDRA_DIR}/resumed-{now}" if resume else f"{HYDRA_DIR}/eval-{now}" if evaluated else HYDRA_DIR
        ),
        use_cache=True,
        replace=True,
    )
