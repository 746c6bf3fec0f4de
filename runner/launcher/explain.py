"""One line for a command line Hydra could not compose, in mpitrain's words where they help more.

Hydra's advice for a misspelt key is to add it with ``+key=value``, which mpitrain then refuses (its schemas
declare every key): the line names the closest declared key instead. An option that is not found gets the
options there are, and how to add a folder of one's own (``hydra.searchpath``, ``-cd``); an option of a Hydra
plugin that an extra installs (``hydra/launcher=joblib``) and is not installed, the install command.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from runner.launcher.help import CONF, PRIMARY, groups
from runner.schema import ConfigErrors

#: Hydra's messages this module rewords.
CANNOT_OVERRIDE = re.compile(r"Could not override '([^']+)'")
NOT_FOUND = re.compile(r"Could not find '([^']+)/([^'/]+)'")
APPENDED = re.compile(r"An item is already at '([^']+)'")
AMBIGUOUS = re.compile(r"Ambiguous value for argument '([^']+)'")
#: OmegaConf's type refusals, and what to give instead.
WANTED = {
    "could not be converted to Float": "a number",
    "could not be converted to Integer": "a whole number",
    "is not a valid bool": "true or false",
}
#: A key a config of the defaults list (a recipe) sets, which the option chosen instead does not have.
SETS_UNKNOWN = re.compile(r"In '([^'/]+)/([^']+)': ConfigKeyError.*full_key: (\S+)\s+object_type=(\w+)", re.S)


def explain(err: BaseException, argv: list[str]) -> str:
    """The line for ``err``, raised by Hydra for the command line ``argv`` (its arguments).

    Where the command line has more mistakes than the one Hydra stopped at, a line for each
    (:func:`every_mistake`)."""
    if isinstance(err, ConfigErrors):  # several problems of the config, a line each (a point run elsewhere)
        return str(err).strip()
    first = _explain_one(err, argv)
    try:
        every = every_mistake(argv)
    except Exception:  # (the one line is still right)
        every = []
    if AMBIGUOUS.search(str(err)):  # (the others compose a sweep's first value: this is not among them)
        every = [first, *every]
    return str(ConfigErrors(every)) if len(every) > 1 else first


def every_mistake(argv: list[str]) -> list[str]:
    """A line for each mistake of the command line ``argv``.

    Each override is composed in turn onto those that composed before it (the groups' choices first, so that
    their keys are known), each one Hydra refuses explained alone; then the value checks of the config the
    others compose to (gathered, a line each)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from runner.launcher.register import register
    from runner.schema import READING_RUN_FOLDER
    from runner.schema.config import validate
    from runner.schema.identity import override_key

    register()
    overrides = _composable(argv)
    good = [a for a in overrides if a.startswith("hydra.searchpath=")]
    given = [a for a in overrides if a not in good]
    choices = [a for a in given if "." not in a.lstrip("+~").split("=", 1)[0]]
    lines = []

    def composed(trial: list[str]) -> Any:
        GlobalHydra.instance().clear()
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            return compose(config_name=PRIMARY, overrides=trial)

    unchosen: set[str] = set()  # groups whose choice failed: their keys were meant for that option
    for override in choices + [a for a in given if a not in choices]:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.split(".", 1)[0] in unchosen and "." in key:
            continue
        try:
            composed([*good, override])
        except Exception as err:
            lines.append(_explain_one(err, [*good, override]))
            unchosen |= {key} if override in choices else set()
        else:
            good.append(override)
    mine = {k for a in given if (k := override_key(a)).split(".", 1)[0] not in unchosen}
    token = READING_RUN_FOLDER.set(True)  # (checks only: no data set fetches its files here)
    try:
        validate(composed(good))
    except ConfigErrors as err:
        lines += [p for p in err.problems if _names_one_of(p, mine)]
    except ValueError as err:
        lines += [str(err).strip()] if _names_one_of(str(err), mine) else []
    finally:
        READING_RUN_FOLDER.reset(token)
    return lines


def _names_one_of(problem: str, keys: set[str]) -> bool:
    """Whether a value check's ``problem`` is about one of the command line's ``keys``.

    Problems of other keys are the defaults', said once the command line's own mistakes are fixed."""
    return any(re.match(rf"{re.escape(k)}[=:. \[]", problem) for k in keys)


def _inner_key(cause: BaseException | None, key: str) -> str | None:
    """The line for a known ``key`` whose value has a node with a key its schema lacks; else None.

    The line names that key and the schema's keys; such a node is an item of ``simulate.link_events``."""
    import dataclasses

    kind = getattr(cause, "object_type", None)
    inner = re.match(r"Key '([^']+)' not in '([^']+)'", str(cause or ""))
    if inner is None or not dataclasses.is_dataclass(kind) or kind.__name__ != inner.group(2):
        return None
    if inner.group(1) in key.split("."):
        return None  # a key on the override's own path (trian.epochs): the caller's cases
    fields = ", ".join(f.name for f in dataclasses.fields(kind))
    return f"{key}: an item has the key {inner.group(1)!r}, which it does not take; its keys are {fields}"


def _explain_one(err: BaseException, argv: list[str]) -> str:
    """The line for ``err`` alone."""
    text = str(err).strip()
    if missing := CANNOT_OVERRIDE.search(text):
        key = missing.group(1)
        if inner := _inner_key(err.__cause__, key):
            return inner
        return _swept(key, argv) or _misspelt(key, argv) or _unknown(key, argv) or text.splitlines()[0]
    if sets := SETS_UNKNOWN.search(text):
        group, option, key, schema = sets.groups()
        chosen = next((a for a in argv if a.split("=", 1)[0] == key.split(".", 1)[0]), None)
        instead = f"{chosen} ({schema})" if chosen else schema
        return (
            f"{group}={option} sets {key}, which {instead} does not have: keep the option {group}={option} "
            f"chooses for {key.split('.', 1)[0]} (python -m runner {group}={option} --cfg job shows it), or "
            f"leave out {group}={option}"
        )
    if missing := NOT_FOUND.search(text):
        group, option = missing.groups()
        from runner.launcher.register import missing_plugin

        if plugin := missing_plugin(group, option):  # an extra's (hydra/launcher=joblib), not installed
            return plugin
        if group.startswith("hydra/"):
            return f"{group}={option}: no such option of Hydra's (mpitrain --hydra-help lists them)"
        return _no_option(group, option, argv)
    if merging := re.match(r"Error merging override (\S+)", text):  # a value of the wrong type
        reason = str(err.__cause__ or "").strip().splitlines()[:1] or text.splitlines()[1:2]
        return f"{merging.group(1)}: {reason[0] if reason else 'cannot be merged'}" + _wanted(
            merging.group(1), reason[0] if reason else "", argv
        )
    if appended := APPENDED.search(text):
        key = appended.group(1)
        given = next((a for a in argv if a.lstrip("+").split("=", 1)[0] == key), f"{key}=VALUE")
        return (
            f"+{key}: {key} is a key already, so it takes no '+' (that adds a new key): {given.lstrip('+')}"
        )
    if ambiguous := AMBIGUOUS.search(text):
        given = ambiguous.group(1)
        key, values = given.split("=", 1)
        return (
            f"{given}: several values are a sweep: add -m (python -m runner -m {given}); one list value is "
            f"written {key}=[{values}], and text with a comma is quoted: {key}='{values}'"
        )
    lines = [line.strip() for line in text.splitlines() if line.strip()][:1]  # not OmegaConf's full_key...
    if err.__cause__ is not None and str(err.__cause__).strip():  # OmegaConf's reason, as Hydra shows it
        lines.append(str(err.__cause__).strip().splitlines()[0])
    return "; ".join(lines) if lines else type(err).__name__


def _wanted(override: str, reason: str, argv: list[str]) -> str:
    """After OmegaConf's type refusal of ``override``: what the key takes, with its default as the example.

    The text reads like ``; give a number, e.g. optim.lr=0.1``; nothing where the refusal is not a type's."""
    wanted = next((w for said, w in WANTED.items() if said in reason), None)
    if wanted is None:
        return ""
    key = override.lstrip("+~").split("=", 1)[0]
    example = _default_of(key, argv)
    return f"; give {wanted}" + (f", e.g. {key}={example}" if example is not None else "")


def _default_of(key: str, argv: list[str]) -> Any:
    """``key``'s value in the config the command line's other overrides compose to (None: none)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from runner.launcher.register import register

    register()
    rest = [a for a in _composable(argv) if a.lstrip("+~").split("=", 1)[0] != key]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            value = OmegaConf.select(compose(config_name=PRIMARY, overrides=rest), key)
    except Exception:
        return None
    return str(value).lower() if isinstance(value, bool) else value


def search_folders(argv: list[str]) -> list[Path]:
    """The folders of the command line's ``hydra.searchpath=[file://DIR,...]`` (and ``-cd DIR``)."""
    folders = []
    for i, arg in enumerate(argv):
        if arg.lstrip("+").startswith("hydra.searchpath="):
            for entry in re.findall(r"file://([^,\]\s'\"]+)", arg):
                folders.append(Path(entry).expanduser())
        elif arg in ("-cd", "--config-dir") and i + 1 < len(argv):
            folders.append(Path(argv[i + 1]).expanduser())
        elif arg.startswith(("--config-dir=", "-cd=")):
            folders.append(Path(arg.split("=", 1)[1]).expanduser())
    return folders


def _no_option(group: str, option: str, argv: list[str]) -> str:
    """``group=option`` found nowhere: the options there are, and the closest of them.

    The options include the project's own (its search path); where none is given, the line says how to add a
    folder of one's own."""
    import difflib

    folders = search_folders(argv)
    known = set(groups().get(group, []))
    for folder in folders:
        known |= {p.stem for p in (folder / group).glob("*.yaml")}
    if not known:
        return f"{group}={option}: no such option ({group} is not a group)"
    close = difflib.get_close_matches(option, sorted(known), n=1, cutoff=0.6)
    hint = f"did you mean {group}={close[0]}? " if close else ""
    where = (
        f"{', '.join(str(f / group) for f in folders)} and the runner's conf/{group}"
        if folders
        else f"the runner's conf/{group}; an option of your own is found with hydra.searchpath=[file://DIR] "
        f"(or -cd DIR), DIR holding {group}/{option}.yaml"
    )
    return (
        f"{group}={option}: no such option ({hint}the options of {group} are: {', '.join(sorted(known))}; "
        f"looked in {where})"
    )


def _swept(key: str, argv: list[str]) -> str | None:
    """For a sweep, the group to give with ``key`` when only a swept group's option has it; None otherwise.

    ``key`` is then a key of the config its first point composes, but not of the config Hydra composes once
    before applying the swept values (a key of an option that only a swept group, such as ``recipe=a,b``,
    selects)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from runner.launcher.register import register

    swept = [
        a.split("=", 1)[0]
        for a in argv
        if "=" in a and "," in a.split("=", 1)[1] and "." not in a.split("=", 1)[0]
    ]
    parent = key.rpartition(".")[0].split(".", 1)[0]
    if not swept or not parent:
        return None
    register()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            cfg = compose(config_name=PRIMARY, overrides=_composable(argv), return_hydra_config=True)
    except Exception:
        return None
    choice = OmegaConf.select(cfg, f"hydra.runtime.choices.{parent}")
    if choice is None or OmegaConf.select(cfg, key, default="__missing__") == "__missing__":
        return None
    return (
        f"{key}: not a key of the config before the sweep's values are applied: Hydra composes a sweep's "
        f"config once without them, and {', '.join(f'{g}=...' for g in swept)} selects the option that has "
        f"it; give that option's group on the command line too ({parent}={choice} {key}=...)"
    )


def _misspelt(key: str, argv: list[str]) -> str | None:
    """mpitrain's own refusal of ``key`` (with the closest declared key); None when that cannot be had.

    It comes from the config composed with ``key`` added."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from runner.launcher.register import register
    from runner.schema.config import check_keys

    register()  # idempotent: the schemas, as the command line had them

    added = ["+" + a if a.split("=", 1)[0] == key else a for a in _composable(argv)]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            check_keys(compose(config_name=PRIMARY, overrides=added))
    except ValueError as refused:
        return str(refused)
    except Exception:  # another problem of the command line: Hydra's own line says it
        return None
    return None


def _composable(argv: list[str]) -> list[str]:
    """The overrides of ``argv`` that compose takes.

    Each sweep's first value, no Hydra key but the search path (a project's own options are found there)."""
    from runner.schema.identity import command_line_overrides

    keep = [
        a
        for a in command_line_overrides(argv)
        if not a.lstrip("+").startswith("hydra.") or a.startswith("hydra.searchpath=")
    ]
    return [a if a.startswith("hydra.searchpath=") else first_value(a) for a in keep]


def first_value(override: str) -> str:
    """``override`` with a sweep's first value (``a=1,2``: ``a=1``).

    A comma inside brackets, braces or quotes is part of a value (``a=[1,2]``, ``a={x:1,y:2}``)."""
    depth, quote = 0, ""
    for i, c in enumerate(override):
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "[{(":
            depth += 1
        elif c in "]})":
            depth -= 1
        elif c == "," and depth == 0:
            return override[:i]
    return override


def _unknown(key: str, argv: list[str]) -> str | None:
    """For a key no schema declares: the keys its node has and the closest of them.

    Such a key is of a node of an option given by its class (``_target_``). The line also says how to give an
    argument of one's own (``+key=VALUE``); None when the config does not compose without it."""
    import difflib

    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from runner.launcher.register import register

    register()  # idempotent: the schemas, as the command line had them
    parent, _, name = key.rpartition(".")
    rest = [a for a in _composable(argv) if a.lstrip("+").split("=", 1)[0] != key]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
            node = OmegaConf.select(compose(config_name=PRIMARY, overrides=rest), parent) if parent else None
    except Exception:
        return None
    if not OmegaConf.is_dict(node):
        return None
    keys = [k for k in node if k != "_target_"]
    close = difflib.get_close_matches(name, keys, n=1)
    hint = f" (did you mean {parent}.{close[0]}?)" if close else ""
    listed = f"the keys of {parent} are: {', '.join(keys)}" if keys else f"{parent} lists no keys yet"
    return (
        f"{key}: no such key{hint}; {listed}; an argument of your own that the option does not list yet "
        f"is added with +{key}=VALUE"
    )
