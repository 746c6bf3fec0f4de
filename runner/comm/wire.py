"""Half-precision exchange (``rule.comm_dtype: bf16|fp16``): half the bytes on the wire, sums in float32.

The seeds' ``asa16`` (Theano-MPI): an all-reduce of a float32 buffer x of N ranks' contributions as

1. every rank casts its x to 16 bits and splits it into N chunks; an all-to-all gives rank r the r-th chunk
   of every rank (a reduce-scatter's traffic, (N−1)/N of the 16-bit buffer sent per rank);
2. rank r sums its N chunks in float32 and casts the sum to 16 bits once;
3. an all-gather of the summed chunks gives every rank the whole sum ((N−1)/N again).

Each rank sends 2(N−1)/N · 2 bytes per value, half of a float32 all-reduce, and every rank ends with the
same bits. Rounding: each contribution is rounded to 16 bits once, and the sum once (an all-reduce in 16-bit
arithmetic would round at every partial sum). bf16 keeps float32's range with 8 significant bits; fp16 has
11 bits but overflows above 65504, so it suits values known to be small (BSP's gradients, divided by N).

Point-to-point messages (GoSGD's pushes, EASGD's exchanges) are sent as a 16-bit copy and widened on receipt.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from runner.lazy import lazy_import

if TYPE_CHECKING:
    import torch

    from runner.comm.face import CommLike as Comm
else:
    torch = lazy_import("torch")


#: The types on the wire by name (``rule.comm_dtype``; the schema's WIRE_NAMES, held alike by a test).
NAMES = ("fp32", "bf16", "fp16")


def wire_dtype(name: str) -> torch.dtype | None:
    """The 16-bit type on the wire for ``rule.comm_dtype`` ``name``; None for fp32 (no conversion)."""
    assert name in NAMES, name
    return {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def allreduce(
    comm: Comm, t: torch.Tensor, dtype: torch.dtype, kept: dict[Any, Any] | None = None
) -> torch.Tensor:
    """In-place sum of the floating-point tensor ``t`` over ``comm`` with 16-bit ``dtype`` traffic.

    See the module's docstring. Accumulated in float32 (float64 for a float64 ``t``); ``kept``: the buffers of
    earlier calls, by size (the route's own; a model's buckets or tensors have few sizes)."""
    n = comm.size
    if n == 1:
        return t
    assert t.is_contiguous() and t.is_floating_point(), "a contiguous floating-point tensor is reduced"
    flat = t.view(-1)
    numel = flat.numel()
    chunk = -(-numel // n)
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    device = t.device if comm.routes(t) else torch.device("cpu")  # NCCL: on the GPU; MPI: staged
    send, recv, part = _buffers({} if kept is None else kept, n * chunk, chunk, dtype, acc, device)
    send[:numel].copy_(flat)
    send[numel:].zero_()
    comm.alltoall(send, recv)
    narrow, total, widened = part
    rows = recv.view(n, chunk)
    total.copy_(rows[0])
    for row in rows[1:]:  # widened first: faster than adding a 16-bit tensor to a float32 one
        widened.copy_(row)
        total.add_(widened)
    narrow.copy_(total)
    comm.allgather(narrow, send)
    flat.copy_(send[:numel])
    return t


def _buffers(
    kept: dict[Any, Any], total: int, chunk: int, dtype: torch.dtype, acc: torch.dtype, device: torch.device
) -> Any:
    """Buffers for one size on ``device``, made once into ``kept``.

    On the host for MPI, on the GPU for the NCCL transport (:meth:`Comm.routes`)."""
    key = (total, dtype, acc, device)
    if key not in kept:
        new = functools.partial(torch.empty, device=device)
        kept[key] = (
            new(total, dtype=dtype),
            new(total, dtype=dtype),
            (new(chunk, dtype=dtype), new(chunk, dtype=acc), new(chunk, dtype=acc)),
        )
    return kept[key]
