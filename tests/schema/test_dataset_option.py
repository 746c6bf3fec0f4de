"""``data=dataset``: a plain torch Dataset (tests/helpers/plain_data.py) given by its class. The launcher
checks the paths without importing them; the rank wraps the data sets like the runner's own (disjoint shards,
a fixed held-out split) and refuses samples that are not (input, target) pairs. Also: loader processes by
cores."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from runner.data.base import ClassificationData, loader_workers
from runner.data.dataset import DatasetConfig
from tests.conftest import checked_config

BLOBS = "tests.helpers.plain_data.Blobs"
SUBSET = "torch.utils.data.Subset"
MLP = ["model=mlp", "data=dataset", "data.shape=[4]", "data.num_classes=3"]


def dataset(target: str = BLOBS, **kwargs) -> DatasetConfig:
    """The schema of ``data.train._target_=target`` with ``kwargs`` as its arguments, as a rank has it."""
    return DatasetConfig(train={"_target_": target, **kwargs}, workers=0)


def test_the_launcher_checks_the_paths_without_importing_them():
    sys.modules.pop("tests.helpers.plain_data", None)
    cfg = checked_config([*MLP, f"data.train._target_={BLOBS}", "+data.train.size=64"])
    assert cfg.data.train == {"_target_": BLOBS, "size": 64} and cfg.model.input_shape == [4]
    assert cfg.model.num_classes == 3 and cfg.data.workers is None
    assert "tests.helpers.plain_data" not in sys.modules, "the launcher must not import the user's module"


TRAIN = f"data.train._target_={BLOBS}"


@pytest.mark.parametrize(
    "overrides,message",
    [
        ([], r"data\.train\._target_: no value given.*data\.train\._target_="),
        (["data.train._target_=nowhere.data.Set"], r"_target_=.*no module 'nowhere\.data'.*PYTHONPATH"),
        (
            ["data.train._target_=tests.helpers.plain_datx.Blobs"],
            r"no module 'tests\.helpers\.plain_datx'.*project's folder",
        ),
        (
            ["data.train._target_=tests.helpers.plain_data"],
            r"tests\.helpers\.plain_data is a module: name a class",
        ),
        ([TRAIN, "data.val._target_=nowhere.Val"], r"data\.val\._target_=.*no module 'nowhere'"),
        ([TRAIN, "+data.val.size=3"], r"data\.val\._target_=null is invalid"),
        ([TRAIN, "+data.train.base={_target_: nowhere.Set}"], r"data\.train\.base\._target_=.*no module"),
        ([TRAIN, "+data.train._partial_=true"], r"data\.train\._partial_ is not supported.*~data\.train"),
        ([TRAIN, "data.val_fraction=1.5"], r"data\.val_fraction=1\.5.*\(0, 1\)"),
        ([TRAIN, "data.val_fraction=0"], r"data\.val_fraction=0"),
        ([TRAIN, "data.workers=-1"], r"data\.workers=-1.*null to decide by the cores"),
    ],
)
def test_the_launcher_refuses(overrides, message):
    with pytest.raises(ValueError, match=message):
        checked_config([*MLP, *overrides])


def test_a_model_that_reads_the_shape_needs_it_given():
    with pytest.raises(ValueError, match=r"data\.shape"):
        checked_config(["model=mlp", "data=dataset", f"data.train._target_={BLOBS}", "data.num_classes=3"])
    with pytest.raises(ValueError, match=r"data\.num_classes"):
        checked_config(["model=mlp", "data=dataset", f"data.train._target_={BLOBS}", "data.shape=[4]"])


def test_shards_are_disjoint_across_two_ranks_and_targets_pass_unchanged():
    data = dataset(size=101).build()
    assert isinstance(data, ClassificationData) and len(data.train) + len(data.val) == 101
    shards = []
    for rank in range(2):
        loader = data.train_loader(rank, 2, 8, seed=3)
        loader.sampler.set_epoch(1)
        shards.append(list(loader.sampler))
        x, y = next(iter(loader))
        assert x.shape == (8, 4) and y.dtype == torch.int64
    assert len(shards[0]) == len(shards[1]) and len(set(shards[0]) & set(shards[1])) <= len(data.train) % 2
    assert set(shards[0]) | set(shards[1]) == set(range(len(data.train)))
    val = [i for r in range(2) for i in data.val_loader(r, 2, 8).dataset.indices]
    assert sorted(val) == list(range(len(data.val))), "validation is split exactly"
    distances = dataset("tests.helpers.plain_data.Distances", size=20).build()
    x, y = next(iter(distances.train_loader(0, 1, 4, seed=0)))
    assert y.dtype == torch.float32 and y.shape == (4,), "regression targets stay floats"


def test_the_held_out_split_is_fixed_by_its_seed():
    a, b = dataset(size=50).build(), dataset(size=50).build()
    assert a.val.indices == b.val.indices and len(a.val) == 5
    assert sorted(a.train.indices + a.val.indices) == list(range(50))
    other = DatasetConfig(train={"_target_": BLOBS, "size": 50}, split_seed=1, val_fraction=0.2).build()
    assert len(other.val) == 10 and other.val.indices != a.val.indices[:10]


def test_what_the_built_data_set_tells():
    data = dataset().build()
    assert data.shape == (4,) and data.num_classes == 3 and data.classes == ["blob0", "blob1", "blob2"]
    pair = dataset("tests.helpers.plain_data.blobs_pair", val_size=30).build()
    assert len(pair.train) == 256 and len(pair.val) == 30 and pair.num_classes == 3
    given = DatasetConfig(train={"_target_": BLOBS}, val={"_target_": BLOBS, "seed": 1, "size": 7}).build()
    assert len(given.train) == 256 and len(given.val) == 7


def test_a_node_with_a_target_inside_the_arguments_is_built_first():
    """As with Hydra's instantiate: a torch Subset of the plain data set, both named by their class."""
    inner = {"_target_": BLOBS, "size": 40, "seed": 5}
    data = DatasetConfig(
        train={"_target_": SUBSET, "dataset": inner, "indices": list(range(30))}, workers=0
    ).build()
    assert len(data.train) + len(data.val) == 30 and data.num_classes == 3, "the classes seen through Subset"
    x, y = data.train[0]
    assert x.shape == (4,) and 0 <= y < 3


def plain(name: str, **kwargs) -> dict:
    return {"_target_": f"tests.helpers.plain_data.{name}", **kwargs}


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"train": plain("Records")}, r"data\.train\._target_=.*Records: .*sample 0 is a dict with keys"),
        ({"train": plain("Points")}, r"data\.train\._target_=.*Points: .*sample 0 is a Tensor of shape"),
        ({"train": plain("nothing")}, r"data\.train\._target_=.*nothing returned a builtins\.int"),
        ({"train": plain("Blobs", colour=1)}, r"train\.colour: Blobs takes no such.*~data\.train\.NAME"),
        ({"train": plain("Blobs", size=-1)}, r"data\.train\._target_=.*Blobs failed: RuntimeError"),
        (
            {
                "train": {
                    "_target_": "torch.utils.data.Subset",
                    "dataset": plain("Blobs", size=-1),
                    "indices": [0],
                }
            },
            r"data\.train\.dataset\._target_=tests\.helpers\.plain_data\.Blobs failed: RuntimeError",
        ),
        ({"train": plain("Blobs"), "shape": [5]}, r"data\.shape=\[5\] .*inputs of shape \[4\].*=\[4\]"),
        ({"train": plain("Blobs"), "num_classes": 5}, r"data\.num_classes=5 .*has 3 classes"),
        (
            {"train": plain("blobs_pair"), "val": plain("Blobs")},
            r"data\.val\._target_=.*returns a \(train, val\) pair already",
        ),
        ({"train": plain("Blobs"), "val": plain("Points")}, r"data\.val\._target_=.*Points: .*a Tensor"),
        ({"train": plain("Blobs", size=0)}, r"data\.train\._target_=.*Blobs returned an empty data set"),
        (
            {"train": plain("Blobs"), "val": plain("Blobs", size=0)},
            r"data\.val\._target_=.*Blobs returned an empty",
        ),
    ],
)
def test_the_rank_refuses_what_it_cannot_train_on(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DatasetConfig(**kwargs, workers=0).build()


@pytest.mark.parametrize("cores,expected", [(1, 0), (2, 1), (3, 2), (16, 4)])
def test_loader_workers_default_by_the_cores_a_rank_is_bound_to(monkeypatch, cores, expected):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert loader_workers(None) == expected and loader_workers(3) == 3 and loader_workers(0) == 0
    data = DatasetConfig(train={"_target_": BLOBS, "size": 40}).build()
    assert data.workers == expected
    assert data.train_loader(0, 1, 8, seed=0).num_workers == expected


@pytest.mark.slow
@pytest.mark.mpi
def test_a_plain_dataset_trains_under_mpirun(cli):
    """Two ranks, a background loader process each (which imports the user's module), a held-out split."""
    run = cli(
        *MLP,
        f"data.train._target_={BLOBS}",
        "+data.train.size=400",
        "data.workers=1",
        "devices=2",
        "train.epochs=4",
        "train.batch_size=16",
        "optim.lr=0.1",
        timeout=240,
    )
    assert run.returncode == 0, run.output
    assert run.summary["data"] == "tests.helpers.plain_data.Blobs" and run.summary["steps"] == 4 * 12
    assert run.summary["best_val_acc"] >= 0.95, "the blobs are well apart"
