"""Synchronization rules: small strategy classes over the communication layer (one module each)."""

from runner.rules.base import Rule

__all__ = ["Rule"]
