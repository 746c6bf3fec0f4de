"""An MLP whose build fails unless the environment variable ``secret_name`` holds the value whose SHA-256 is
``secret_sha256``: a rank that did not get a secret ``hardware.env`` value through mpirun ends the job.

Selected with ``hydra.searchpath=[file://tests/conf]`` and ``model=needs_secret``.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import torch

from runner.models.mlp import MLPConfig


@dataclass
class NeedsSecretMLPConfig(MLPConfig):
    secret_name: str = "MPITRAIN_TEST_SECRET"
    secret_sha256: str = ""

    def build(self) -> torch.nn.Module:
        value = os.environ.get(self.secret_name)
        if value is None or hashlib.sha256(value.encode()).hexdigest() != self.secret_sha256:
            raise RuntimeError(
                f"this rank did not get {self.secret_name} (got {'none' if value is None else 'another'})"
            )
        return super().build()
