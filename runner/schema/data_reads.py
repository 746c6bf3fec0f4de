"""Interpolations that read the data set's keys (``${data.shape}``), checked before launch."""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

#: How to give a data key a data set leaves unset (``data=dataset``), for :func:`check_data_read`.
DATA_KEY_EXAMPLES = {
    "shape": "data.shape=[3,32,32] (one input's shape)",
    "num_classes": "data.num_classes=10 (the class count)",
}
DATA_READ = re.compile(r"\$\{data\.(\w+)")


def check_data_read(cfg: DictConfig) -> None:
    """Refuse a config whose groups read a data key that the data set leaves null, naming the keys to give.

    ``data=dataset`` cannot know its shape or classes before a rank builds it, yet ``model=mlp`` reads them
    (``input_shape: ${data.shape}``): resolving that would fail with OmegaConf's own message (``Incompatible
    value 'None'``), or pass None to the model."""
    data = cfg._get_node("data")
    if not isinstance(data, DictConfig) or data._is_missing() or data._is_none():
        return
    unset: dict[str, list[str]] = {}
    for where, name, text in data_reads(cfg):
        value = cfg.data._get_node(name) if name in cfg.data else None
        if value is not None and not OmegaConf.is_interpolation(cfg.data, name) and value._is_none():
            unset.setdefault(f"data.{name}", []).append(f"{where}: {text}")
    if not unset:
        return
    train = cfg.data._get_node("train")
    option = "data=dataset" if isinstance(train, DictConfig) and "_target_" in train else "the data set"
    readers = [r for rs in unset.values() for r in rs]
    is_, them = ("is", "it") if len(unset) == 1 else ("are", "them")
    examples = " ".join(DATA_KEY_EXAMPLES.get(k.removeprefix("data."), f"{k}=...") for k in unset)
    raise ValueError(
        f"{' and '.join(unset)} {is_} not given, but {' and '.join(readers)} "
        f"{'reads' if len(readers) == 1 else 'read'} {them}, and {option} cannot know {them} before a rank "
        f"builds the data set: give {them}, e.g. {examples}"
    )


def data_reads(node: Any, path: str = "") -> list[tuple[str, str, str]]:
    """``(key, data key, expression)`` of each interpolation outside ``data`` and ``hydra`` that reads one."""
    from omegaconf import ListConfig

    reads = []
    for name in node.keys() if isinstance(node, DictConfig) else range(len(node)):
        where = f"{path}.{name}" if path else str(name)
        if where in ("data", "hydra"):
            continue
        child = node._get_node(name)
        if OmegaConf.is_interpolation(node, name):
            text = str(child._value())
            reads += [(where, key, text) for key in DATA_READ.findall(text)]
        elif isinstance(child, (DictConfig, ListConfig)) and not child._is_none() and not child._is_missing():
            reads += data_reads(child, where)
    return reads
