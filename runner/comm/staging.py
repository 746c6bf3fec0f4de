"""Device memory and MPI: whether the loaded MPI library is CUDA-aware, and staging through host buffers.

A tensor MPI cannot read in place (on a GPU without CUDA-aware MPI, or not contiguous) goes through a
contiguous host copy; CUDA tensors use pinned buffers kept from call to call. It imports no MPI binding:
the MPI library is found among the process's loaded libraries and asked through ctypes.
"""

from __future__ import annotations

import ctypes
import os

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
    """A tensor MPI cannot read in place (on a GPU without CUDA-aware MPI, or not contiguous), staged
    through a contiguous host copy; ``finish`` copies the result back."""

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
