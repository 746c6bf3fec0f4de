"""Chunked sparse codes (runner/comm/sparse.py): what a code keeps, its bits, its bytes, and the exchange.

In process: the code of one tensor checked value by value against the largest |values| of each chunk, the
2-bit and 1-bit levels against their definitions, and :func:`sparse_allgather` over
tests/helpers/fakecomm.py's ranks (every rank the same sum, the bytes counted as they travel)."""

from __future__ import annotations

import pytest
import torch

from runner.comm.sparse import SparseCode, _pack_bits, _unpack_bits, sparse_allgather
from tests.helpers.fakecomm import FakeWorld

DT = torch.float64


def tensor(numel: int, seed: int = 0, dtype: torch.dtype = DT) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=g, dtype=DT) * (1 + torch.arange(numel, dtype=DT) / 97)).to(dtype)


def decoded(code: SparseCode, x: torch.Tensor) -> torch.Tensor:
    """What a receiver makes of ``x``'s code (decoding into zeros)."""
    payload, mine = code.encode(x)
    assert payload.dtype == torch.uint8 and payload.numel() == code.nbytes(x.numel(), x.element_size())
    total = torch.zeros_like(x)
    code.decode_into(payload, total)
    assert torch.equal(total, mine), "the receiver decodes what the sender kept as sent"
    return total


@pytest.mark.parametrize("bits", [1, 2])
def test_bits_pack_and_unpack_back(bits):
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 1 << bits, (1001,), dtype=torch.uint8, generator=g)
    packed = _pack_bits(codes, bits)
    assert packed.numel() == -(-1001 * bits // 8)
    assert torch.equal(_unpack_bits(packed, bits, 1001), codes)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_every_value_kept_in_32_bits_is_the_tensor_itself(dtype):
    """k = chunk, full width: the code is the tensor, bit for bit (float64 stays float64), no offsets sent."""
    x = tensor(1000, dtype=dtype)
    code = SparseCode(chunk=64, k=64, bits=32)
    assert torch.equal(decoded(code, x), x)
    assert code.nbytes(1000, x.element_size()) == 16 * 64 * x.element_size()  # 16 chunks, the last padded


def test_top_k_keeps_exactly_each_chunks_k_largest_magnitudes():
    x = tensor(1000)
    code = SparseCode(chunk=100, k=7, bits=32)
    back = decoded(code, x)
    for row, kept in zip(x.view(10, 100), back.view(10, 100), strict=True):
        largest = row.abs().topk(7).indices
        expected = torch.zeros_like(row)
        expected[largest] = row[largest]
        assert torch.equal(kept, expected)
    assert code.index_bytes() == 1 and SparseCode(4096, 64, 2).index_bytes() == 2


def test_two_bits_keep_the_sign_and_one_of_two_levels_per_chunk():
    """Each kept value comes back with its sign and the nearer of the chunk's two levels, the means of the
    smaller and the larger half of its k magnitudes."""
    x = tensor(4096 * 3 + 100)
    code = SparseCode(chunk=4096, k=64, bits=2)
    exact = decoded(SparseCode(4096, 64, 32), x)
    back = decoded(code, x)
    assert torch.equal(back != 0, exact != 0) and torch.equal(back.sign(), exact.sign())
    padded = torch.cat([exact, exact.new_zeros(4096 * 4 - exact.numel())]).view(4, -1)
    padded_back = torch.cat([back, back.new_zeros(4096 * 4 - back.numel())]).view(4, -1)
    for row, row_back in zip(padded, padded_back, strict=True):
        size = row[row != 0].abs().float().sort().values
        low, high = size[:32].mean(), size[32:].mean()
        levels = row_back[row_back != 0].abs().float()
        assert set(levels.unique().tolist()) <= {low.item(), high.item()}
        nearer = torch.where((size - low).abs() <= (size - high).abs(), low, high)
        assert torch.allclose(levels.sort().values, nearer.sort().values)
    # SparseLoCo's default: 64 two-byte offsets, 64 two-bit values and two scales per 16,384 float32 bytes
    assert code.nbytes(4096) == 64 * 2 + 16 + 8 and 4096 * 4 / code.nbytes(4096) > 100


def test_one_bit_keeps_signs_and_the_mean_magnitude():
    x = tensor(640)
    back = decoded(SparseCode(chunk=64, k=64, bits=1), x)
    assert torch.equal(back.sign(), x.sign())
    scales = x.view(10, 64).abs().float().mean(dim=1, keepdim=True).to(DT)
    assert torch.equal(back.view(10, 64).abs(), scales.expand(10, 64))
    assert SparseCode(64, 64, 1).nbytes(640) == 10 * (8 + 4)


@pytest.mark.parametrize("code", [SparseCode(256, 16, 2), SparseCode(64, 64, 1), SparseCode(128, 8, 32)])
def test_the_exchange_gives_every_rank_the_sum_of_the_codes_and_counts_its_bytes(code):
    """The sum of every rank's decoded code, the same bits on every rank; (N−1) codes sent per rank."""
    n, numel = 3, 1000
    xs = [tensor(numel, seed=r) for r in range(n)]

    def main(comm):
        total, mine = sparse_allgather(comm, xs[comm.rank], code)
        return total, mine, comm.stats.bytes_sent

    ranks = FakeWorld(n).run(main)
    expected = sum(decoded(code, x) for x in xs)
    for r, (total, mine, sent) in enumerate(ranks):
        assert torch.equal(total, ranks[0][0]) and torch.allclose(total, expected, rtol=0, atol=1e-12)
        assert torch.equal(mine, decoded(code, xs[r]))
        assert sent == (n - 1) * code.nbytes(numel, 8)


@pytest.mark.parametrize("bits", [1, 2])
def test_narrow_values_are_packed_across_chunks_and_counted_exactly(bits):
    """k·bits not a multiple of 8 (3 values of 2 bits a chunk): the packed values run on across chunks, and
    ``nbytes`` is what is sent."""
    code = SparseCode(chunk=16, k=3, bits=bits)
    decoded(code, tensor(100))  # (asserts the payload's size is nbytes)
    assert code.nbytes(100) == 7 * 3 + -(-7 * 3 * bits // 8) + 4 * 7 * (2 if bits == 2 else 1)


def test_one_rank_alone_keeps_its_tensor_and_sends_nothing():
    x = tensor(300)
    total, mine = FakeWorld(1).run(lambda comm: (*sparse_allgather(comm, x, SparseCode(64, 4, 2)),))[0]
    assert torch.equal(total, x) and torch.equal(mine, x)
