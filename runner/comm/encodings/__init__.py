"""Encodings of a sum: a parameter of the communicator's all-reduces (``Comm.allreduce(t, encoding=e)``).

An all-reduce cannot sum int8 values that carry different scales, nor sparse vectors, so each encoding sums
over the communicator's all-to-all and all-gather, whose bytes are counted as they really travel
(:mod:`runner.comm.stats`). The communicator runs an encoding, blocking or on its background thread, and
prices it on emulated links once for the whole sum (torchft makes quantization a parameter of its
collective the same way); a rule only chooses one (``rule.compress``, Streaming DiLoCo's ``quantize``).

* **int8** (:mod:`~runner.comm.encodings.int8`), a reduce-scatter with re-quantization, as the 16-bit
  exchange does (:mod:`runner.comm.wire`): blocks of 256 values share one float32 scale; 2(N−1)/N·(1 +
  4/256) bytes per value per rank, 0.254 of a float32 all-reduce's.
* **top-k** (:mod:`~runner.comm.encodings.topk`): each rank's k = ⌈ratio·numel⌉ largest |values| with
  their int32 indices, by all-gather: (N−1)·k·(4 + 4) bytes per rank, N·ratio of a float32 all-reduce's.
* **top-k in 2 bits** (:mod:`~runner.comm.encodings.topk_2bit`): per chunk of 4,096 values its
  ⌈ratio·4096⌉ largest |values|, 2-byte offsets and 2-bit values (sign and one of two levels per chunk), by
  all-gather: (N−1)·ratio·(2 + 1/4) bytes per value plus 8 per chunk (SparseLoCo's code,
  :mod:`runner.comm.sparse`).
* **signs** (:mod:`~runner.comm.encodings.sign`): every value's sign in one bit, one float32 scale (the mean
  |value|) per 256 values, by all-gather: (N−1)·(1/8 + 4/256) bytes per value, 0.035·(N−1) of float32's
  (1-bit SGD, Seide et al. 2014, with its error feedback).

**Error feedback** (Seide et al. 2014; Karimireddy et al. 2019, arXiv 1901.09847): what a rank did not send
is added to its next tensor. Each encoding keeps its rank's residual e (the tensor's size): a = t + β·e is
encoded to c(a), c(a) is what the rank contributes, and e ← a − c(a) (β = 1 but in SparseLoCo). With int8
the rank that re-quantizes a chunk's sum keeps that rounding too (its ``owner`` state, 1/N of the tensor)
and adds it to the chunk's next sum (DoubleSqueeze, Tang et al. 2019, arXiv 1905.05957). So over any number
of exchanges, Σ (sums received) + Σ_ranks e + owner residuals = Σ (tensors given), up to float rounding
(tests/rules/test_compress.py). Without error feedback what is not sent is lost: int8 rounds to nearest,
nearly unbiased; top-k drops the small coordinates for good.

Adding an encoding is one module here, with its :class:`~runner.comm.encodings.base.Encoding` subclass,
and one line of :data:`ENCODINGS` (a test holds the two together).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from runner.comm.encodings.base import Encoding

#: Each encoding's name (``rule.compress``'s value) and class, imported when first built.
ENCODINGS: dict[str, str] = {
    "int8": "runner.comm.encodings.int8:Int8",
    "topk": "runner.comm.encodings.topk:TopK",
    "topk_2bit": "runner.comm.encodings.topk_2bit:TopK2Bit",
    "sign": "runner.comm.encodings.sign:Sign",
}

#: ``rule.compress``'s values: none (the plain sum) and every encoding.
KINDS = ("none", *ENCODINGS)


def encoding_class(name: str) -> type[Encoding]:
    """The class of encoding ``name``."""
    module, _, cls = ENCODINGS[name].partition(":")
    return getattr(importlib.import_module(module), cls)


def encoding(
    name: str, like: torch.Tensor, size: int, ratio: float = 0.01, feedback: bool = True
) -> Encoding:
    """Encoding ``name`` of a tensor like ``like`` over ``size`` ranks, with fresh error feedback."""
    return encoding_class(name)(like, size, ratio=ratio, feedback=feedback)


def compressors(cfg: Any, buffers: Iterable[torch.Tensor], workers: int) -> list[Encoding]:
    """One encoding per buffer for a rule's ``cfg`` (``compress``, ``topk_ratio``, ``error_feedback``).

    Each over ``workers``, with fresh error feedback; none for ``compress: none``."""
    if cfg.compress == "none":
        return []
    return [encoding(cfg.compress, b, workers, cfg.topk_ratio, cfg.error_feedback) for b in buffers]


def feedback_state(compressed: list[Encoding], workers: int) -> dict[str, Any]:
    """A rule's error feedback for its checkpoint.

    Every encoding's residuals and the number of ``workers`` they were made for (empty without error
    feedback)."""
    states = [c.state() for c in compressed]
    return {"residuals": states, "workers": workers} if any(states) else {}


def load_feedback(compressed: list[Encoding], state: dict[str, Any], workers: int) -> None:
    """Restore :func:`feedback_state`'s residuals where they fit.

    Where the encodings and the number of ``workers`` are the same; else the error feedback starts from
    zero, as after a change of workers."""
    saved = state.get("residuals")
    if saved is None or state.get("workers") != workers or len(saved) != len(compressed):
        return
    for c, tensors in zip(compressed, saved, strict=True):
        c.load(tensors)
