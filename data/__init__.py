"""Data sets: one module each, with the schema of their YAML keys; see :mod:`data.base` for sharding."""
