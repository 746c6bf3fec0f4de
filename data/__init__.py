"""Data sets: one module each, with the schema of their YAML keys; see :mod:`runner.data.base` for sharding.

Importing this package (which importing any of its modules does) registers the OmegaConf resolver
``${mpitrain_data:KEY}``: the value of ``shape`` or ``num_classes`` that the data set's files hold, read by
its schema's ``files_outputs`` (:class:`runner.schema.DataConfig`). A data set whose files fix them makes it
their default (:func:`from_files`), so a model's ``input_shape: ${data.shape}`` gets the files' value without
the user typing it, and a value the user gives instead is checked against the files.
"""

from __future__ import annotations

from typing import Any

from omegaconf import OmegaConf

RESOLVER = "mpitrain_data"


def from_files(key: str) -> Any:
    """The default of ``shape`` or ``num_classes`` for a data set whose files fix it."""
    return "${" + RESOLVER + ":" + key + "}"


def _files_output(key: str, _parent_: Any) -> Any:
    from runner.schema import raising

    with raising():  # (what the files lack is said once, by the data set's own checks: not as model.root)
        return OmegaConf.get_type(_parent_).files_outputs(_parent_)[key]


OmegaConf.register_new_resolver(RESOLVER, _files_output, replace=True)
