"""Data sets and sharding: disjoint shards that cover the set, equal step counts, common reshuffles; the
schemas (one per module, the YAML only selects it), and a launcher that reads them without torch."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import fields

import pytest
import torch
from omegaconf import OmegaConf

from runner.data.digits import DigitsConfig
from runner.data.synthetic import SyntheticConfig
from runner.schema import DataConfig, schema_of
from tests.conftest import CONF, ROOT, checked_config


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
    a, b = DigitsConfig().build(), DigitsConfig().build()
    assert len(a.train) == 1437 and len(a.val) == 360
    assert torch.equal(a.train.x, b.train.x) and a.shape == (1, 8, 8) and a.num_classes == 10
    assert set(a.train.y.tolist()) == set(range(10))
    other = DigitsConfig(split_seed=1, val_fraction=0.1).build()
    assert len(other.val) == 180 and not torch.equal(other.train.x[:10], a.train.x[:10])


def test_default_job_reads_digits_and_the_model_follows():
    cfg = checked_config()
    assert isinstance(cfg.data, DigitsConfig)
    assert cfg.data.shape == cfg.model.input_shape == [1, 8, 8] and cfg.model.num_classes == 10


def test_digits_refuse_another_shape_or_class_count():
    with pytest.raises(ValueError, match=r"data\.shape=\[3, 8, 8\].*\[1, 8, 8\]; leave it unset"):
        checked_config(["data.shape=[3,8,8]"])
    with pytest.raises(ValueError, match="num_classes=5.*10 classes"):
        DigitsConfig(num_classes=5)
    with pytest.raises(ValueError, match=r"val_fraction=1\.5.*\(0, 1\)"):
        DigitsConfig(val_fraction=1.5)


@pytest.mark.parametrize("world", [2, 3])
def test_train_shards_are_disjoint_cover_the_set_and_have_equal_length(world):
    data = SyntheticConfig(shape=[4], train_size=101, val_size=10).build()
    shards = sample_ids(data, world, epoch=0)
    assert len({len(s) for s in shards}) == 1, "ranks would run different step counts"
    union = [i for s in shards for i in s]
    assert set(union) == set(range(101))
    assert len(union) - len(set(union)) == (-101) % world, "only the padding may repeat"
    lengths = {len(data.train_loader(r, world, 16, 3)) for r in range(world)}
    assert len(lengths) == 1


def test_reshuffled_each_epoch_with_a_common_seed():
    data = SyntheticConfig(shape=[4], train_size=64, val_size=8).build()
    e0, e1 = sample_ids(data, 2, 0), sample_ids(data, 2, 1)
    assert e0 != e1 and sample_ids(data, 2, 0) == e0
    assert set(e0[0]) | set(e0[1]) == set(e1[0]) | set(e1[1]) == set(range(64))


def test_validation_shards_partition_the_validation_set():
    data = DigitsConfig().build()
    labels = [shard_labels(data.val_loader(r, 3, 50)) for r in range(3)]
    assert sum(map(len, labels)) == len(data.val)
    assert sorted(sum(labels, [])) == sorted(data.val.y.tolist())


def test_synthetic_shapes_and_learnable_labels():
    schema = SyntheticConfig(shape=[3, 5, 5], num_classes=4, train_size=32, val_size=8, seed=1)
    data = schema.build()
    x, y = data.train[0]
    assert x.shape == (3, 5, 5) and 0 <= int(y) < 4
    assert data.shape == (3, 5, 5) and data.num_classes == 4 and len(data.val) == 8
    assert torch.equal(schema.build().train.x, data.train.x)
    assert not torch.equal(SyntheticConfig(shape=[3, 5, 5], seed=2).build().train.x[:32], data.train.x)


def test_in_memory_data_moves_to_a_gpu_only_where_it_fits(monkeypatch):
    """``place``: never on the CPU; on a GPU, only tensors held in memory, and only within the share of its
    free memory (the GPU's answer stubbed, so this runs without one; tests/rank/test_gpu_sync.py moves it)."""
    import runner.data.base as base

    data = SyntheticConfig(shape=[3, 8, 8], train_size=64, val_size=16).build()
    size = data.train.nbytes() + data.val.nbytes()
    assert data.place(torch.device("cpu")) == 0 and not data.resident
    moved_to: list[torch.device] = []
    monkeypatch.setattr(base.TensorData, "to", lambda self, device: moved_to.append(device))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * size - 1, 10 * size))
    assert data.place(torch.device("cuda", 0)) == 0 and moved_to == [] and not data.resident  # too big
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (4 * size, 10 * size))
    data.workers = 2
    assert data.place(torch.device("cuda", 0)) == size and data.resident and data.workers == 0
    assert moved_to == [torch.device("cuda", 0)] * 2  # each split once
    data.train = torch.utils.data.TensorDataset(torch.zeros(4, 1), torch.zeros(4))  # not the runner's
    data.resident = False
    assert data.place(torch.device("cuda", 0)) == 0 and not data.resident


def test_synthetic_settings_are_checked():
    with pytest.raises(ValueError, match=r"shape=\[3, 0\].*positive sizes"):
        SyntheticConfig(shape=[3, 0])
    with pytest.raises(ValueError, match="num_classes=1.*at least 2"):
        SyntheticConfig(num_classes=1)
    with pytest.raises(ValueError, match="val_size=0"):
        SyntheticConfig(val_size=0)


OPTIONS = sorted(p.stem for p in (CONF / "data").glob("*.yaml"))


@pytest.mark.parametrize("name", OPTIONS)
def test_each_data_option_has_one_schema(name):
    """The schema declares every key; a YAML of the data group only selects it (and may set values)."""
    schema = schema_of("data", name)
    assert issubclass(schema, DataConfig) and schema.__name__.endswith("Config")
    assert "_target_" not in {f.name for f in fields(schema)}
    assert schema.build is not DataConfig.build


@pytest.mark.parametrize("name", OPTIONS)
def test_data_yaml_only_selects_its_schema(name):
    yaml = OmegaConf.load(CONF / "data" / f"{name}.yaml")
    assert list(yaml.defaults) == [f"/schema/data/{name}@_here_", "_self_"]
    assert set(yaml) == {"defaults"}, "keys and defaults belong in the schema (data/<name>.py)"


def test_default_data_modules_import_no_torch_numpy_or_sklearn():
    code = (
        "import sys, runner.data.digits, runner.data.synthetic, runner.data.text, runner.data.dataset; "
        "print(sorted(m for m in ('torch', 'numpy', 'sklearn') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
def test_the_digits_split_is_kept_and_read_back_without_scikit_learn(tmp_path):
    """Importing scikit-learn costs every rank over a second: the split is cached, the same arrays."""
    code = (
        "import sys; from runner.data.digits import DigitsConfig; d = DigitsConfig().build(); "
        "print(int('sklearn' in sys.modules), float(d.train.x.sum()), d.train.y.tolist()[:20], len(d.val))"
    )

    def build(cache) -> list[str]:
        env = {**os.environ, "MPITRAIN_CACHE": str(cache)}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        )
        return out.stdout.split(" ", 1)

    first, second = build(tmp_path), build(tmp_path)
    assert first[0] == "1" and second[0] == "0", "the second build reads the cache"
    assert first[1] == second[1]
    assert len(list(tmp_path.glob("digits-*.npz"))) == 1 and not list(tmp_path.glob("tmp*"))
    unwritable = build("/proc/no-such-cache")  # no cache to be had: split again, same arrays
    assert unwritable == first


def _loader_process(rank_pid: int) -> None:
    from runner.data.base import end_with_rank

    end_with_rank(rank_pid, 0)
    time.sleep(60)


@pytest.mark.parametrize("pidfd", [True, False])
def test_a_loader_process_ends_with_its_rank(monkeypatch, pidfd):
    """Its parent is the forkserver, not the rank: torch's own watch misses a killed rank."""
    import multiprocessing

    if not pidfd:
        monkeypatch.delattr(os, "pidfd_open")
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    loader = multiprocessing.get_context("fork").Process(target=_loader_process, args=(rank.pid,))
    loader.start()
    time.sleep(0.5)
    assert loader.is_alive(), "it lives while its rank does"
    rank.kill()
    rank.wait()
    start = time.monotonic()
    loader.join(timeout=10)
    assert loader.exitcode == 1 and time.monotonic() - start < 3, (loader.exitcode, time.monotonic() - start)
