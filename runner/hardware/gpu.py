"""``hardware=gpu``: one rank per GPU of this machine, on the cores of its GPU's NUMA node."""

from __future__ import annotations

from dataclasses import dataclass

from runner.hardware.base import HardwareConfig


@dataclass
class GPUConfig(HardwareConfig):
    device: str = "cuda"
    bind: str = "numa"
