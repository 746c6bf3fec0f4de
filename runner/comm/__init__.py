"""The communication layer: the transports that move tensors between ranks, behind one ``Comm`` interface.

- :mod:`runner.comm.mpi`: ``Comm`` over MPI (mpi4py's buffer API; the only module that imports mpi4py),
  ULFM failure detection, non-blocking and background all-reduces, accounting of bytes and seconds;
- :mod:`runner.comm.dist`: the collectives of device tensors on ``torch.distributed`` (NCCL; gloo on CPU),
  which a ``Comm`` hands them to once given the transport (``hardware.transport``);
- :mod:`runner.comm.wire`: the 16-bit exchange (``rule.comm_dtype``);
- :mod:`runner.comm.staging`: CUDA tensors through pinned host buffers when MPI is not CUDA-aware;
- :mod:`runner.comm.flat`: parameters and gradients as flat buffers (one message, not one per tensor).

The names below are this package's face; they are imported from :mod:`runner.comm.mpi` on first use, so
importing the package (or ``flat`` and ``wire``, which the rules' schemas import in the launcher) starts
neither MPI nor torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runner.comm.mpi import (
        ANY_SOURCE,
        ANY_TAG,
        BackgroundRequest,
        Comm,
        CommStats,
        Counter,
        DistRequest,
        PeerLost,
        Request,
    )

#: The face of the layer: what the ranks, the loop and the rules use.
__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "BackgroundRequest",
    "Comm",
    "CommStats",
    "Counter",
    "DistRequest",
    "PeerLost",
    "Request",
]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module("runner.comm.mpi"), name)
    raise AttributeError(f"module 'runner.comm' has no attribute {name!r}")
