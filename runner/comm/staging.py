"""Device memory and MPI: whether the loaded MPI library is CUDA-aware and what MPI is given for a tensor.

That includes staging through host buffers: a tensor MPI cannot read in place (on a GPU without CUDA-aware
MPI, or not contiguous) goes through a contiguous host copy; CUDA tensors use pinned buffers kept from call to
call. It imports no MPI binding: the MPI library is found among the process's loaded libraries and asked
through ctypes.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np
import torch

#: Overrides the detection of :func:`cuda_aware_mpi`: ``1`` or ``0`` (``hardware.cuda_aware`` reaches a
#: rank's Comm directly; this is for jobs started by hand, such as the comm tests).
CUDA_AWARE_ENV = "MPITRAIN_CUDA_AWARE"


def _libmpi() -> ctypes.CDLL | None:
    """The MPI library this process has loaded (found in /proc/self/maps), to query its extensions."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({ln.split()[-1] for ln in maps if "/libmpi" in ln and ".so" in ln})
    except OSError:
        return None
    for path in paths:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def cuda_aware_mpi() -> bool:
    """Whether the loaded MPI library accepts CUDA device memory in its calls.

    ``MPITRAIN_CUDA_AWARE=0|1`` decides when set; otherwise Open MPI is asked through
    ``MPIX_Query_cuda_support()`` (built and available at run time) and MPICH through
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA)``. Any other library counts as not CUDA-aware, so CUDA
    tensors are staged through host memory, which is always correct.
    """
    forced = os.environ.get(CUDA_AWARE_ENV)
    if forced is not None:
        return forced == "1"
    lib = _libmpi()
    if lib is None:
        return False
    if hasattr(lib, "MPIX_Query_cuda_support"):
        return bool(lib.MPIX_Query_cuda_support())
    if hasattr(lib, "MPIX_GPU_query_support"):
        supported = ctypes.c_int(0)
        return lib.MPIX_GPU_query_support(0, ctypes.byref(supported)) == 0 and bool(supported.value)
    return False


class Staged:
    """A tensor MPI cannot read in place, staged through a contiguous host copy.

    MPI cannot read it in place on a GPU without CUDA-aware MPI, or when it is not contiguous. ``finish``
    copies the result back."""

    def __init__(self, t: torch.Tensor, host: torch.Tensor, copy_in: bool):
        self.tensor, self.host = t, host
        if copy_in:
            host.view(t.shape).copy_(t.detach(), non_blocking=t.is_cuda)
        if t.is_cuda:
            torch.cuda.current_stream(t.device).synchronize()

    def finish(self) -> None:
        self.tensor.copy_(self.host.view(self.tensor.shape))


class HostBuffers:
    """Pinned host buffers for staging CUDA tensors, one per device tensor, reused from call to call.

    Pinned (page-locked) memory makes the device-host copies direct DMA transfers; allocating it is slow,
    so the buffer of a tensor that is communicated every step (a BSP bucket, a flat parameter vector) is
    allocated once. At most ``capacity`` buffers are kept (least recently used dropped first); a buffer
    still in use by a pending request stays alive through that request.
    """

    def __init__(self, capacity: int = 64):
        self.capacity = capacity
        self._buffers: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self.allocated = 0

    def get(self, t: torch.Tensor) -> torch.Tensor:
        key = (t.data_ptr(), t.numel(), t.dtype)
        host = self._buffers.pop(key, None)
        if host is None:
            host = torch.empty(t.numel(), dtype=t.dtype, pin_memory=torch.cuda.is_available())
            self.allocated += 1
            if len(self._buffers) >= self.capacity:
                self._buffers.pop(next(iter(self._buffers)))
        self._buffers[key] = host
        return host

    def __len__(self) -> int:
        return len(self._buffers)


def view(t: torch.Tensor) -> np.ndarray:
    """A numpy array sharing memory with the contiguous CPU tensor ``t``."""
    assert t.is_contiguous() and t.device.type == "cpu", "comm buffers must be contiguous CPU tensors"
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: moved as 16-bit integers, never reduced
        t = t.view(torch.int16)
    return t.detach().numpy()


class Buffers:
    """What MPI is given for each tensor: a view of it, the device memory itself or a staged host copy.

    The device memory itself with CUDA-aware MPI (``cuda_aware``); long-lived buffers are prepared once
    (:meth:`keep`)."""

    def __init__(self, cuda_aware: bool):
        self.cuda_aware = cuda_aware
        self.host = HostBuffers()
        self._ready: dict[int, tuple[torch.Tensor, Any]] = {}

    def get(self, t: torch.Tensor, copy_in: bool = True) -> tuple[Any, Staged | None]:
        """What MPI is given for ``t``, and the staging to finish after the call (None: ``t`` itself).

        Work queued on the GPU is waited for first, since MPI reads and writes device memory outside
        CUDA's streams. A buffer given to :meth:`keep` is handed over as prepared then.
        """
        ready = self._ready.get(id(t))
        if ready is not None and ready[0] is t:
            return ready[1], None
        if t.is_contiguous() and t.device.type == "cpu":
            return view(t), None
        if t.is_cuda and t.is_contiguous() and self.cuda_aware:
            torch.cuda.current_stream(t.device).synchronize()
            return t.detach(), None
        if t.is_cuda:
            host = self.host.get(t)
        else:
            host = torch.empty(t.numel(), dtype=t.dtype)
        staged = Staged(t, host, copy_in)
        return view(host), staged

    def keep(self, t: torch.Tensor) -> None:
        """Prepare the long-lived contiguous CPU buffer ``t`` once, for every later call on it.

        It is kept alive here."""
        if t.is_contiguous() and t.device.type == "cpu":
            self._ready[id(t)] = (t, view(t))
