"""``mpitrain --help``: the parts of the help text that come from the config tree (``conf/hydra/help/``).

Two OmegaConf resolvers, used by ``hydra.help.template`` and so evaluated only when Hydra prints the help:

- ``${mpitrain_help_groups:}`` lists the config groups of ``conf/`` (every folder holding options, except
  Hydra's own ``hydra/``) with their options, read from the folder at run time, the selected ones marked.
- ``${mpitrain_help_keys:}`` lists the top-level keys of the composed config (every key that is not a
  group: ``devices``, ``train.*``, ``checkpoint.*``, ...) as ``KEY=VALUE`` with the command line's
  overrides applied, each explained by its trailing comment in ``conf/config.yaml``. Those comments are the
  one place a key is explained: the file is where its default is set and what a user reads next to it, and
  it ships in the wheel; the schemas in :mod:`runner.schema.sections` hold the types and checks.

Neither imports torch or a group's schema module, so ``--help`` answers as fast as ``--cfg job``.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

#: The config tree: ``runner/conf`` (a link to the repository's ``conf/``; a real folder in the wheel).
CONF = Path(__file__).resolve().parents[1] / "conf"
#: The primary config of the tree, ``conf/config.yaml`` (Hydra's ``config_name``).
PRIMARY = "config"
WIDTH = 110
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_]\w*):(?P<rest>.*)$")


def groups(conf: Path = CONF) -> dict[str, list[str]]:
    """``group -> options`` of the config tree.

    A group is each folder (nested ones as ``a/b``) holding ``*.yaml`` options, but Hydra's ``hydra/`` (its
    help, launchers...)."""
    found: dict[str, list[str]] = {}
    for folder in sorted(p for p in conf.rglob("*") if p.is_dir()):
        name = folder.relative_to(conf).as_posix()
        options = sorted(p.stem for p in folder.glob("*.yaml"))
        if options and name.split("/")[0] != "hydra":
            found[name] = options
    return found


def key_comments(path: Path = CONF / f"{PRIMARY}.yaml") -> dict[str, str]:
    """``dotted.key -> its trailing comment`` in a YAML config, up to its ``hydra:`` section."""
    comments: dict[str, str] = {}
    stack: list[tuple[int, str]] = []
    for line in path.read_text().splitlines():
        match = _KEY.match(line)
        if not match:
            continue
        indent, key = len(match["indent"]), match["key"]
        if indent == 0 and key in ("hydra", "defaults"):
            stack = [(0, key)]
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        stack.append((indent, key))
        if stack[0][1] in ("hydra", "defaults"):
            continue
        _, sep, comment = match["rest"].partition(" #")
        if sep and comment.strip():
            comments[".".join(k for _, k in stack)] = comment.strip()
    return comments


def _value(value: Any) -> str:
    """A value as it is written on the command line."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ",".join(_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _leaves(node: Any, prefix: str) -> list[tuple[str, str | None]]:
    """``(dotted key, value)`` of every leaf under ``node``; a section gives ``(key.*, None)`` first."""
    if isinstance(node, DictConfig) and not node._is_none() and not node._is_missing():
        rows: list[tuple[str, str | None]] = [(f"{prefix}.*", None)] if prefix else []
        for key in node.keys():
            rows += _leaves(node._get_node(key), f"{prefix}.{key}" if prefix else str(key))
        return rows
    if isinstance(node, (DictConfig, ListConfig)):
        return [(prefix, _value(OmegaConf.to_container(node, resolve=False)))]
    return [(prefix, _value(node._value()))]


def _escape(text: str) -> str:
    """Hydra passes the help through :class:`string.Template`: a literal ``$`` is ``$$`` there."""
    return text.replace("$", "$$")


def _rows(rows: list[tuple[str, str]]) -> str:
    """Two columns, the second wrapped to :data:`WIDTH` under itself."""
    left = min(max((len(a) for a, _ in rows), default=0), 36) + 4
    lines = []
    for first, second in rows:
        if not second:
            lines.append("  " + first)
            continue
        pad = " " * (left - len(first) - 2) if len(first) + 2 < left else "\n" + " " * left
        wrapped = textwrap.wrap(second, WIDTH - left) or [""]
        lines.append("  " + first + pad + ("\n" + " " * left).join(wrapped))
    return _escape("\n".join(lines))


def help_groups(*, _root_: DictConfig) -> str:
    """The groups and their options, the selected one starred (``${mpitrain_help_groups:}``)."""
    choices = OmegaConf.select(_root_, "hydra.runtime.choices", default=None) or {}

    def selected(group: str, option: str) -> bool:
        if group in choices:
            return choices[group] == option
        node = OmegaConf.select(_root_, group, default=None)  # several at once (logger): Hydra records none
        return isinstance(node, DictConfig) and option in node

    return _rows(
        [
            (group, ", ".join(o + "*" if selected(group, o) else o for o in options))
            for group, options in groups().items()
        ]
    )


def help_keys(*, _root_: DictConfig) -> str:
    """The top-level keys, their current values and their comments (``${mpitrain_help_keys:}``)."""
    comments = key_comments()
    skip = {"hydra", *groups()}
    rows = []
    for key in _root_.keys():
        if key in skip:
            continue
        for dotted, value in _leaves(_root_._get_node(key), str(key)):
            name = dotted if value is None else f"{dotted}={value}"
            rows.append((name, comments.get(dotted.removesuffix(".*"), "")))
    return _rows([row for row in rows if row[1] or not row[0].endswith(".*")])


def field_comments(cls: type) -> dict[str, str]:
    """``field -> its trailing comment`` in the source of a schema dataclass and its bases."""
    import inspect

    comments: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        for found in re.finditer(r"^    (\w+): [^\n#]+#\s*(.+)$", source, re.M):
            comments[found.group(1)] = found.group(2).strip()
    return comments


def help_hardware(*, _root_: DictConfig) -> str:
    """The selected hardware option's keys, their values and what they do (``${mpitrain_help_hardware:}``).

    They say where and how the ranks run: the keys a user sets most after the top-level ones."""
    node = _root_._get_node("hardware")
    cls = OmegaConf.get_type(node)
    comments = field_comments(cls) if isinstance(cls, type) else {}
    rows = []
    for dotted, value in _leaves(node, "hardware"):
        name = dotted.split(".")[1]
        if dotted.count(".") == 1 and value is not None:
            rows.append((f"{dotted}={value}", comments.get(name, "")))
        elif dotted.count(".") == 2 and dotted.endswith(".*"):  # a map: its entries are --cfg job's
            rows.append((f"hardware.{name}.KEY=VALUE", comments.get(name, "")))
    return _rows(rows)


def help_pages() -> str:
    """The documentation's pages (``${mpitrain_help_pages:}``), from ``docs/`` beside the package."""
    docs = Path(__file__).resolve().parents[2] / "docs"
    pages = sorted(p.stem for p in docs.glob("*.md") if p.stem != "index")
    return f"the pages: {', '.join(pages)}" if pages else "in the repository's docs/ folder"


def register_help() -> None:
    """Register the help's resolvers (idempotent); before ``hydra.main`` composes the help config."""
    OmegaConf.register_new_resolver("mpitrain_help_groups", help_groups, replace=True)
    OmegaConf.register_new_resolver("mpitrain_help_keys", help_keys, replace=True)
    OmegaConf.register_new_resolver("mpitrain_help_hardware", help_hardware, replace=True)
    OmegaConf.register_new_resolver("mpitrain_help_pages", help_pages, replace=True)
