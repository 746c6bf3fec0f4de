"""The communication layer: the transports that move tensors between ranks, behind one ``Comm`` interface.

- :mod:`runner.comm.mpi`: ``Comm`` over one MPI communicator: its collectives walk the routes, its calls are
  timed, accounted and their failures mapped; MPI's start and end (``init``, ``join``, ``finalize``);
- :mod:`runner.comm.routes`: the ordered routes a tensor collective may take (the 16-bit exchange, the
  ``torch.distributed`` transport, the background thread, MPI directly or staged), one file each;
- :mod:`runner.comm.face`: the declared face (``CommLike``) that ``Comm`` and the tests' fake both satisfy;
- :mod:`runner.comm.binding`: the only module that imports mpi4py (without starting MPI);
- :mod:`runner.comm.errors`: ULFM's failure errors as :class:`PeerLost`;
- :mod:`runner.comm.stats`: bytes sent and seconds spent, each counted once;
- :mod:`runner.comm.requests`: pending operations (MPI's, the background thread's, the transport's);
- :mod:`runner.comm.background`: the thread that runs queued all-reduces beside the computation;
- :mod:`runner.comm.membership`: ULFM's recovery (revoke, agree, shrink) and the job's growth (spawn, merge);
- :mod:`runner.comm.counter`: the one-sided counter (MPI's atomics in a window);
- :mod:`runner.comm.dist`: the collectives of device tensors on ``torch.distributed`` (NCCL; gloo on CPU),
  which a ``Comm`` hands them to once given the transport (``hardware.transport``);
- :mod:`runner.comm.wire`: the 16-bit exchange (``rule.comm_dtype``);
- :mod:`runner.comm.encodings`: a sum's encodings (``rule.compress``: int8 with per-block scales, top-k,
  2-bit top-k, signs), with error feedback: a parameter of the all-reduces (``encoding=``);
- :mod:`runner.comm.staging`: what MPI is given for a tensor; CUDA tensors through pinned host buffers when
  MPI is not CUDA-aware;
- :mod:`runner.comm.flat`: parameters and gradients as flat buffers (one message, not one per tensor);
- :mod:`runner.comm.tags`: every point-to-point message's tag, in one table.

The names below are this package's face; each is imported from its module on first use, so importing the
package (or ``flat`` and ``wire``, which the rules' schemas import in the launcher) starts neither MPI nor
torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runner.comm.binding import ANY_SOURCE, ANY_TAG
    from runner.comm.counter import Counter
    from runner.comm.errors import PeerLost
    from runner.comm.face import CommLike, CounterLike, RequestLike
    from runner.comm.mpi import Comm
    from runner.comm.requests import BackgroundRequest, DistRequest, Request
    from runner.comm.stats import CommStats

#: The face of the layer: what the ranks, the loop and the rules use, and the module each name lives in.
HOMES = {
    "ANY_SOURCE": "binding",
    "ANY_TAG": "binding",
    "BackgroundRequest": "requests",
    "Comm": "mpi",
    "CommLike": "face",
    "CommStats": "stats",
    "Counter": "counter",
    "CounterLike": "face",
    "DistRequest": "requests",
    "PeerLost": "errors",
    "Request": "requests",
    "RequestLike": "face",
}
__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "BackgroundRequest",
    "Comm",
    "CommLike",
    "CommStats",
    "Counter",
    "CounterLike",
    "DistRequest",
    "PeerLost",
    "Request",
    "RequestLike",
]
assert sorted(__all__) == sorted(HOMES)


def __getattr__(name: str) -> Any:
    if name in HOMES:
        return getattr(importlib.import_module(f"runner.comm.{HOMES[name]}"), name)
    raise AttributeError(f"module 'runner.comm' has no attribute {name!r}")
