"""Hydra's view of the schemas: the config source ``mpitrain://`` and the search path that holds it.

Only the launcher composes (and imports Hydra); the ranks read the schemas of :mod:`runner.schema` alone.
"""

from __future__ import annotations

import importlib.util

from hydra.core.config_search_path import ConfigSearchPath
from hydra.core.object_type import ObjectType
from hydra.plugins.config_source import ConfigLoadError, ConfigResult, ConfigSource
from hydra.plugins.search_path_plugin import SearchPathPlugin
from omegaconf import OmegaConf

from runner.schema import GROUPS, option_modules, schema_of


class SchemaSource(ConfigSource):
    """Hydra config source ``mpitrain://``: ``schema/<group>/<module>`` is that module's schema dataclass.

    It is imported when a config asks for it (Hydra's ConfigStore would need them all imported first)."""

    @staticmethod
    def scheme() -> str:
        return "mpitrain"

    def _split(self, config_path: str) -> list[str]:
        return [p for p in self._normalize_file_name(config_path).removesuffix(".yaml").split("/") if p]

    def load_config(self, config_path: str) -> ConfigResult:
        parts = self._split(config_path)
        if len(parts) != 3 or parts[0] != "schema" or parts[1] not in GROUPS:
            raise ConfigLoadError(f"no schema {config_path}")
        cls = schema_of(parts[1], parts[2])
        return ConfigResult(
            config=OmegaConf.structured(cls),
            path=f"{self.scheme()}://{self.path}",
            provider=self.provider,
            header={"package": None},
        )

    def available(self) -> bool:
        return True

    def is_group(self, config_path: str) -> bool:
        parts = self._split(config_path)
        return parts == ["schema"] or (len(parts) == 2 and parts[0] == "schema" and parts[1] in GROUPS)

    def is_config(self, config_path: str) -> bool:
        parts = self._split(config_path)
        if len(parts) != 3 or parts[0] != "schema" or parts[1] not in GROUPS:
            return False
        if "." in parts[2]:
            try:
                return importlib.util.find_spec(parts[2]) is not None
            except ModuleNotFoundError:  # its package is not importable from here: Hydra names the config
                return False
        return parts[2] in option_modules(parts[1])

    def list(self, config_path: str, results_filter: ObjectType | None) -> list[str]:
        parts = self._split(config_path)
        if parts == ["schema"]:
            return sorted(GROUPS) if results_filter in (None, ObjectType.GROUP) else []
        if len(parts) == 2 and parts[1] in GROUPS and results_filter in (None, ObjectType.CONFIG):
            return option_modules(parts[1])
        return []


class SchemaSearchPath(SearchPathPlugin):
    """Puts ``mpitrain://`` on every search path, whatever ``hydra.searchpath`` a user sets."""

    def manipulate_search_path(self, search_path: ConfigSearchPath) -> None:
        search_path.append("mpitrain", "mpitrain://schemas")


def register_source() -> None:
    """Make the schemas known to Hydra (idempotent), through its public plugin registration."""
    from hydra.core.plugins import Plugins

    Plugins.instance().register(SchemaSource)
    Plugins.instance().register(SchemaSearchPath)
