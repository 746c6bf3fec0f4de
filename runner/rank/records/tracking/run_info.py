"""What every tracker records of a run: its folder, name, config, and the compared keys."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from runner.folder_files import open_in_folder
from runner.run_folder import CONFIG, IDENTITY, SWEEP_CONFIG, read_json
from runner.schema import GROUPS, option_modules, schema_of
from runner.schema.config import TARGET_NODE, Config

#: The longest folder name TensorBoard's run gets (file systems allow 255 bytes).
NAME_BYTES = 200

#: The longest param value MLflow takes everywhere (newer servers take 6000 characters).
PARAM_CHARS = 500

#: The groups a run is compared by, as the option chosen (``rule=easgd``): hparams, params and MLflow tags.
NAMED = ("rule", "model", "data", "optim")

#: The keys every run records for comparison, varied or not, after the named groups and the rule's own keys
#: (``rule.alpha``); a group's keys (``simulate``) all of them.
COMPARED = ("optim.lr", "devices", "hardware.transport", "train.batch_size", "train.seed", "simulate")

#: What a compared key reads on a run it does not apply to: another rule's key (``rule.alpha`` of a BSP run).
NOT_APPLICABLE = "n/a"


@dataclass
class RunInfo:
    """What every tracker knows of the run.

    Its folder, name and swept values (``run.json``), its config (``config.yaml``, resolved), its sweep folder
    (None for a single run), and ``resume_step``: the checkpoint's step a resumed run continues after
    (None when it starts); ``continued``: earlier records of this run exist (a resume, or a survivor
    taking the records over); ``schemas``: the config's ``_schemas_`` (``group -> module.Class``), which
    name the options chosen."""

    dir: Path
    name: str
    swept: dict[str, Any]
    config: dict[str, Any]
    sweep: Path | None
    resume_step: int | None
    continued: bool
    schemas: dict[str, str] = field(default_factory=dict)
    started: float | None = None  # when the launcher wrote config.yaml: the job's start, start-up included

    @classmethod
    def read(cls, run_dir: Path, resume_step: int | None = None, continued: bool = False) -> RunInfo:
        """The run of ``run_dir``, from what the launcher wrote there (without it: the folder's name)."""
        from omegaconf import OmegaConf

        ident = read_json(run_dir / IDENTITY)
        config = {}
        if (run_dir / CONFIG).is_file():
            with open_in_folder(run_dir / CONFIG) as file:  # (never through a link)
                config = OmegaConf.to_container(OmegaConf.load(file))
        schemas = config.pop("_schemas_", None) or {}
        sweep = run_dir.parent if (run_dir.parent / SWEEP_CONFIG).is_file() else None
        name = str(ident.get("name") or run_dir.name)
        swept = dict(ident.get("swept") or {})
        continued = continued or resume_step is not None
        try:
            started = (run_dir / CONFIG).stat().st_mtime
        except OSError:
            started = None
        return cls(run_dir, name, swept, config, sweep, resume_step, continued, dict(schemas), started)

    @property
    def key(self) -> str:
        """The run folder's absolute path: what identifies the run to MLflow and W&B across jobs."""
        return str(self.dir.resolve())


def option(run: RunInfo, group: str) -> str:
    """The option ``group`` is set to, as users select it (``easgd``.

    A class of the user's: its ``_target_``); from the swept value, else ``_schemas_``; ``?`` when neither
    says."""
    path = run.schemas.get(group)
    if path == TARGET_NODE:
        return str((run.config.get(group) or {}).get("_target_", "?"))
    if group in run.swept:
        return str(run.swept[group])
    return path.rsplit(".", 2)[-2] if path and path.count(".") >= 2 else "?"


def leaves(node: Any, prefix: str) -> dict[str, Any]:
    """``dotted.key -> value`` of a config node's leaves (a value that is no mapping: ``{prefix: node}``)."""
    if not isinstance(node, dict) or not node:
        return {prefix: node}
    out = {}
    for key, value in node.items():
        out.update(leaves(value, f"{prefix}.{key}"))
    return out


def compared(run: RunInfo) -> dict[str, Any]:
    """The keys every run records for comparison, varied or not, in order.

    The named groups' options (:data:`NAMED`), the rule's keys, :data:`COMPARED`, every other swept key, then
    every other rule's keys as :data:`NOT_APPLICABLE` (so a table over runs of several rules has no
    blank). A key the config lacks is None."""
    out: dict[str, Any] = {group: option(run, group) for group in NAMED}
    rule = run.config.get("rule")
    if isinstance(rule, dict):
        out.update({k: v for k, v in leaves(rule, "rule").items() if k != "rule._target_"})
    for key in COMPARED:
        head, _, rest = key.partition(".")
        node = run.config.get(head)
        if rest:
            node = node.get(rest) if isinstance(node, dict) else None
        out.update(leaves(node, key))
    out.update({k: v for k, v in run.swept.items() if k not in out})
    out.update({k: NOT_APPLICABLE for k in hparam_kinds() if k.startswith("rule.") and k not in out})
    return out


def kind(hint: Any) -> str:
    """How a field of this type is recorded as an hparam.

    ``bool``, ``number`` (int or float), else ``text`` (a string, a list, or a type that admits None: one
    run's None would make the column text anyway)."""
    return "bool" if hint is bool else "number" if hint in (int, float) else "text"


def schema_kinds(classes: list[type], prefix: str) -> dict[str, str]:
    """``prefix.key -> kind`` over the fields of the schema dataclasses ``classes`` (a group's options).

    A key that every one declares as a bool, or every one as a number, keeps that kind; any other is text (a
    key some option lacks reads :data:`NOT_APPLICABLE` there, which is text)."""
    seen: dict[str, list[str]] = {}
    for cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            seen.setdefault(f"{prefix}.{f.name}", []).append(kind(hints[f.name]))
    whole = len(classes)
    return {k: v[0] if len(v) == whole and len(set(v)) == 1 else "text" for k, v in seen.items()}


@functools.cache
def option_schemas(group: str) -> tuple[type, ...]:
    """The schema dataclasses of a group's options (its package's modules that define one.

    One that cannot be imported here, for want of a package it needs, is left out rather than fail the run's
    records)."""
    found = []
    for name in option_modules(group):
        try:
            cls = schema_of(group, name)
        except (ValueError, ImportError):  # a helper module (rules/base.py), or an option not usable here
            continue
        if cls not in found:
            found.append(cls)
    return tuple(found)


@functools.cache
def hparam_kinds() -> dict[str, str]:
    """``compared key -> kind`` (:func:`kind`) of every compared key a schema declares.

    The named groups' options (text), every rule's keys, and :data:`COMPARED`. TensorBoard types an hparam
    from all the runs it finds and, over two types, makes it text while each run keeps its own: a filter
    of that column then drops the runs whose value is a number, and sorting by it fails. So each key is
    recorded with one type in every run, whichever rule, hardware or optimizer the run chose:
    ``rule.alpha`` (``float | None``, EASGD's alone) as text (``0.5``, ``n/a``), ``optim.lr`` as a number."""
    kinds = {group: "text" for group in NAMED}
    kinds.update(schema_kinds(list(option_schemas("rule")), "rule"))
    hints = typing.get_type_hints(Config)
    for key in COMPARED:
        head, _, rest = key.partition(".")
        if head in GROUPS:
            classes = list(option_schemas(head))
        elif dataclasses.is_dataclass(hints[head]):
            classes = [hints[head]]
        else:
            kinds[key] = kind(hints[head])
            continue
        found = schema_kinds(classes, head)
        kinds.update({k: v for k, v in found.items() if k == key or k.startswith(f"{key}.")})
    return kinds


def trial_name(run: RunInfo) -> str:
    """The run as TensorBoard's HParams table names its trial.

    What it is first (its name, after the rule when the sweep did not vary it: ``rule=easgd,rule.alpha=0.5``),
    then where it is (the sweep folder's date, time and point: ``2026-01-01/11-00-00/0``), so runs of two
    sweeps never merge."""
    label = [] if run.name == "defaults" else [run.name]
    if "rule" not in run.swept:
        label.insert(0, f"rule={option(run, 'rule')}")
    where = "/".join(run.dir.resolve().parts[-3 if run.sweep is not None else -2 :])
    return f"{','.join(label)} ({where})"


def folder_name(name: str) -> str:
    """``name`` as one folder name.

    No ``/``, at most :data:`NAME_BYTES` bytes (a longer one is cut and ends with a hash of the whole, so
    names stay distinct)."""
    safe = name.replace("/", "_").replace("\0", "_").lstrip(".") or "run"
    if len(safe.encode()) <= NAME_BYTES:
        return safe
    digest = hashlib.sha1(name.encode()).hexdigest()[:10]
    return safe.encode()[: NAME_BYTES - 12].decode(errors="ignore") + f"~{digest}"


def scalars(values: dict[str, Any], prefix: str = "") -> list[tuple[str, float]]:
    """The finite numbers among ``values``; nested dicts (histograms) become ``key/subkey``."""
    out = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += scalars(value, f"{prefix}{key}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            out.append((f"{prefix}{key}", float(value)))
    return out


def summary_numbers(summary: dict[str, Any]) -> dict[str, float]:
    """The top-level finite numbers of ``summary.json`` (``final_val_acc``, ``steps``)."""
    return dict(scalars({k: v for k, v in summary.items() if not isinstance(v, dict)}))


def text(value: Any) -> str:
    """A value as a param's text: a string as it is, the rest as JSON (``null``, ``true``, ``[1, 8]``)."""
    return value if isinstance(value, str) else json.dumps(value, default=str)


def flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``dotted.key -> value as text`` of a nested config."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = text(value)
    return out
