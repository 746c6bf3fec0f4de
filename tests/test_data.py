"""Data sets and sharding: disjoint shards that cover the set, equal step counts, common reshuffles."""

from __future__ import annotations

import pytest
import torch

from data.digits import Digits
from data.synthetic import Synthetic


def shard_labels(loader) -> list[int]:
    return [int(i) for _, y in loader for i in y]


def sample_ids(data, world, epoch, batch=16):
    """The training samples each rank sees in ``epoch``, identified by their index in data.train."""
    ids = {tuple(x.flatten().tolist()): i for i, x in enumerate(data.train.x)}
    out = []
    for rank in range(world):
        loader = data.train_loader(rank, world, batch, seed=3)
        loader.sampler.set_epoch(epoch)
        out.append([ids[tuple(x.flatten().tolist())] for xb, _ in loader for x in xb])
    return out


def test_digits_split_is_fixed_and_real():
    a, b = Digits(), Digits()
    assert len(a.train) == 1437 and len(a.val) == 360
    assert torch.equal(a.train.x, b.train.x) and a.shape == (1, 8, 8)
    assert set(a.train.y.tolist()) == set(range(10))


@pytest.mark.parametrize("world", [2, 3])
def test_train_shards_are_disjoint_cover_the_set_and_have_equal_length(world):
    data = Synthetic(shape=[4], train_size=101, val_size=10)
    shards = sample_ids(data, world, epoch=0)
    assert len({len(s) for s in shards}) == 1, "ranks would run different step counts"
    union = [i for s in shards for i in s]
    assert set(union) == set(range(101))
    assert len(union) - len(set(union)) == (-101) % world, "only the padding may repeat"
    lengths = {len(data.train_loader(r, world, 16, 3)) for r in range(world)}
    assert len(lengths) == 1


def test_reshuffled_each_epoch_with_a_common_seed():
    data = Synthetic(shape=[4], train_size=64, val_size=8)
    e0, e1 = sample_ids(data, 2, 0), sample_ids(data, 2, 1)
    assert e0 != e1 and sample_ids(data, 2, 0) == e0
    assert set(e0[0]) | set(e0[1]) == set(e1[0]) | set(e1[1]) == set(range(64))


def test_validation_shards_partition_the_validation_set():
    data = Digits()
    labels = [shard_labels(data.val_loader(r, 3, 50)) for r in range(3)]
    assert sum(map(len, labels)) == len(data.val)
    assert sorted(sum(labels, [])) == sorted(data.val.y.tolist())


def test_synthetic_shapes_and_learnable_labels():
    data = Synthetic(shape=[3, 5, 5], num_classes=4, train_size=32, val_size=8, seed=1)
    x, y = data.train[0]
    assert x.shape == (3, 5, 5) and 0 <= int(y) < 4
    assert torch.equal(
        Synthetic(shape=[3, 5, 5], num_classes=4, train_size=32, val_size=8, seed=1).train.x, data.train.x
    )
