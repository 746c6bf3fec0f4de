"""Cheaper composition for the tests: Hydra's loaded configs kept across composes, composed configs memoized.

Hydra reads, parses and splits every config of the defaults list anew for each compose (its own cache lives
for one compose), and deep-copies its repository, the ConfigStore's every schema included, for each: about
half of a compose's time; the fast tier composes some 600 times. Here a process-wide cache keeps each loaded
config, keyed by what it was loaded from (a file's path and contents, a stored structured config, a schema
class), and hands each compose a copy of its own (unpickled: several times faster than a deep copy), so that
what a compose does to its configs never reaches the next one. Configs of other sources are loaded as Hydra
loads them. Each compose's repository is a shallow copy with a list of sources of its own (all that
``initialize_sources`` changes).

:func:`compose_memo` memoizes whole compositions of the project's own configs (no ``hydra.`` override, no
option given by a dotted module path) and hands each caller a copy of its own.

tests/test_hydra_cache.py checks that compositions with and without the cache agree node for node.
"""

from __future__ import annotations

import copy
import os
import pickle
from collections.abc import Callable, Hashable, Sequence
from typing import Any


class Frozen:
    """An object kept as its pickle (its deep copy where it does not pickle); :meth:`copy` gives a new one."""

    def __init__(self, obj: Any) -> None:
        try:
            self._pickled: bytes | None = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # (nothing of the runner's configs so far)
            self._pickled = None
        self._kept = None if self._pickled is not None else copy.deepcopy(obj)

    def copy(self) -> Any:
        """A copy of the object as it was frozen, shared with no other caller."""
        if self._pickled is not None:
            return pickle.loads(self._pickled)
        return copy.deepcopy(self._kept)


#: ``key -> (guard, loaded config)``: the guard is what the config was loaded from, compared on each use.
_LOADED: dict[Hashable, tuple[Any, Frozen]] = {}
#: ``overrides -> frozen composed config``, of :func:`compose_memo`.
_COMPOSED: dict[tuple[str, ...], Frozen] = {}
#: Hydra's own methods that :func:`install` replaced, by name.
_ORIGINAL: dict[str, Callable] = {}


def _file_key(source: Any, config_path: str) -> tuple[Hashable, Any] | None:
    """A yaml file's key (its real path) and guard (its bytes); None when it cannot be read."""
    full = os.path.realpath(os.path.join(source.path, source._normalize_file_name(config_path)))
    try:
        with open(full, "rb") as f:
            return full, f.read()
    except OSError:
        return None


def _key(source: Any, config_path: str) -> tuple[Hashable, Any] | None:
    """``(key, guard)`` of the config ``config_path`` of ``source``; None where it is loaded anew each time.

    The key names the source and the path; the guard is what the config was built from: a file's bytes, the
    structured config stored under the path, a schema class (an option of the runner's own, not one given by
    a dotted module path, whose module a test may write anew)."""
    from hydra._internal.core_plugins.file_config_source import FileConfigSource
    from hydra._internal.core_plugins.importlib_resources_config_source import (
        ImportlibResourcesConfigSource,
    )
    from hydra._internal.core_plugins.structured_config_source import StructuredConfigSource

    from runner.schema import GROUPS, schema_of
    from runner.schema.source import SchemaSource

    where = (type(source), source.provider, source.path, config_path)
    if type(source) is FileConfigSource:
        found = _file_key(source, config_path)
        return None if found is None else ((*where, found[0]), found[1])
    if type(source) is ImportlibResourcesConfigSource:  # an installed package's configs (Hydra's own)
        return where, None
    if type(source) is StructuredConfigSource:
        return where, source.store._load(source._normalize_file_name(config_path))
    if type(source) is SchemaSource:
        parts = source._split(config_path)
        if len(parts) == 3 and parts[0] == "schema" and parts[1] in GROUPS and "." not in parts[2]:
            return where, schema_of(parts[1], parts[2])
    return None


def _load_config(self: Any, config_path: str) -> Any:
    """``ConfigRepository.load_config``, from the cache where the config's source allows (a copy)."""
    from hydra.core.object_type import ObjectType

    load = _ORIGINAL["ConfigRepository.load_config"]
    source = self._find_object_source(config_path=config_path, object_type=ObjectType.CONFIG)
    try:
        found = None if source is None else _key(source, config_path)
    except Exception:  # (Hydra's own load says what is wrong)
        found = None
    if found is None:
        return load(self, config_path)
    key, guard = found
    cached = _LOADED.get(key)
    if cached is None or cached[0] is not guard and cached[0] != guard:
        cached = _LOADED[key] = (guard, Frozen(load(self, config_path)))
    return cached[1].copy()


def _caching_repository_init(self: Any, delegate: Any) -> None:
    """``CachingConfigRepository.__init__`` without the deep copy of ``delegate`` and the ConfigStore.

    Hydra copies the repository so that ``initialize_sources`` (a ``hydra.searchpath``) leaves it as it was;
    that method only rebinds ``sources``, so a shallow copy with its own list of the (stateless) sources
    does the same."""
    self.delegate = copy.copy(delegate)
    self.delegate.sources = list(delegate.sources)
    self.cache = {}


def _patched() -> list[tuple[type, str, Callable]]:
    """``(Hydra's class, method name, replacement)`` of each method :func:`install` replaces."""
    from hydra._internal.config_repository import CachingConfigRepository, ConfigRepository

    return [
        (ConfigRepository, "load_config", _load_config),
        (CachingConfigRepository, "__init__", _caching_repository_init),
    ]


def install() -> None:
    """Put the cache of loaded configs under every compose of this process (idempotent)."""
    for cls, name, replacement in _patched():
        key = f"{cls.__name__}.{name}"
        if key not in _ORIGINAL:
            _ORIGINAL[key] = getattr(cls, name)
            setattr(cls, name, replacement)


def uninstall() -> None:
    """Hydra's own loading again (for the check that the cache changes no composition)."""
    for cls, name, _ in _patched():
        if (original := _ORIGINAL.pop(f"{cls.__name__}.{name}", None)) is not None:
            setattr(cls, name, original)


def memoizable(overrides: Sequence[str]) -> bool:
    """Whether a composition of ``overrides`` depends on nothing a test may change.

    Not with a ``hydra.`` override (a search path: a test's own folder, whose files it may rewrite), nor with
    an option given by a dotted module path (a test's own module)."""
    for override in overrides:
        key, _, value = override.lstrip("+~").partition("=")
        if key.startswith("hydra") or ("." not in key and "." in value):
            return False
    return True


def compose_memo(overrides: Sequence[str], compose: Callable[[list[str]], Any]) -> Any:
    """``compose(overrides)``, composed once per process where :func:`memoizable` (a copy for each call)."""
    if not memoizable(overrides):
        return compose(list(overrides))
    key = tuple(overrides)
    if key not in _COMPOSED:
        _COMPOSED[key] = Frozen(compose(list(overrides)))
    return _COMPOSED[key].copy()
