"""``hardware=cpu``: ranks on this machine's cores, started by mpirun."""

from __future__ import annotations

from dataclasses import dataclass

from runner.hardware.base import HardwareConfig


@dataclass
class CPU(HardwareConfig):
    """This machine, CPU only (the defaults of :class:`HardwareConfig`)."""
