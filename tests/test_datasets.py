"""Every on-disk data format: loads from a small fixture in its real format, shards disjointly across two
ranks, rejects a bad path or a malformed file with an error naming it, and trains through mpirun."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from data.cifar10 import CIFAR10, CIFAR10Config
from data.convert import convert
from data.imagefolder import ImageFolder, ImageFolderConfig
from data.shards import Shards, ShardsConfig
from data.text import Text, TextConfig

CLASSES = ["cat", "dog", "eel"]


@pytest.fixture(scope="module")
def image_tree(tmp_path_factory) -> Path:
    """root/{train,val}/<class>/: 5 training and 2 validation images per class, JPEG and PNG, odd sizes."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for split, count in (("train", 5), ("val", 2)):
        for c, name in enumerate(CLASSES):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                pixels = rng.integers(0, 255, (20 + i, 26, 3), dtype=np.uint8)
                pixels[..., c] = 255  # a class signal
                ext = "png" if i % 2 else "jpg"
                Image.fromarray(pixels).save(folder / f"{i}.{ext}")
    return root


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("cifar")
    rng = np.random.default_rng(1)
    for name, n in [*((f"data_batch_{i}", 8) for i in range(1, 6)), ("test_batch", 10)]:
        batch = {
            b"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8),
            b"labels": list(rng.integers(0, 10, n)),
        }
        with open(root / name, "wb") as f:
            pickle.dump(batch, f)
    return root


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "reviews.tsv"
    good = ["a wonderful film", "great acting and a great story", "loved it", "wonderful wonderful"]
    bad = ["a dull film", "terrible acting", "boring and long", "hated it"]
    lines = [f"pos\t{t}" for t in good * 5] + [f"neg\t{t}" for t in bad * 5]
    path.write_text("\n".join(lines) + "\n")
    return path


def shard_check(data, batch=4):
    """Two ranks' loaders for one epoch: disjoint (but for padding) shards covering the set, same steps."""
    seen, labels_ok, steps = [], True, set()
    for rank in range(2):
        loader = data.train_loader(rank, 2, batch, seed=5)
        loader.sampler.set_epoch(1)
        indices = list(loader.sampler)
        got = torch.cat([y for _, y in loader]).tolist()
        expected = [int(data.train[i][1]) for i in indices]
        labels_ok &= got == expected
        seen.append(indices)
        steps.add(len(loader))
    n = len(data.train)
    assert set(seen[0]) | set(seen[1]) == set(range(n))
    assert len(set(seen[0]) & set(seen[1])) <= n % 2
    assert labels_ok and len(steps) == 1


def test_imagefolder_loads_and_shards(image_tree):
    data = ImageFolder(str(image_tree), image_size=16, shape=[3, 16, 16], num_classes=3, workers=0)
    assert data.classes == CLASSES and len(data.train) == 15 and len(data.val) == 6
    x, y = data.train[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y == 0
    assert torch.equal(data.val[0][0], data.val[0][0]), "validation crops must be deterministic"
    shard_check(data)


def test_imagefolder_rejects_bad_input(image_tree, tmp_path):
    with pytest.raises(ValueError, match="root.*no folder"):
        ImageFolderConfig(root=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="num_classes=5.*3 class"):
        ImageFolder(str(image_tree), image_size=16, num_classes=5)
    broken = tmp_path / "broken"
    for split in ("train", "val"):
        (broken / split / "cat").mkdir(parents=True)
        (broken / split / "cat" / "0.jpg").write_bytes(b"not a jpeg")
    data = ImageFolder(str(broken), image_size=8, num_classes=1, workers=0)
    with pytest.raises(ValueError, match=r"cannot read image .*0\.jpg"):
        data.train[0]


def test_convert_to_shards_and_load(image_tree, tmp_path):
    meta = convert(image_tree, tmp_path / "shards", size=12)
    assert meta["classes"] == CLASSES and meta["train"] == 15 and len(meta["mean"]) == 3
    x = np.load(tmp_path / "shards" / "train_x.npy", mmap_mode="r")
    assert x.shape == (15, 12, 12, 3) and x.dtype == np.uint8
    ShardsConfig(root=str(tmp_path / "shards"), shape=[3, 12, 12], num_classes=3)
    data = Shards(str(tmp_path / "shards"), shape=[3, 12, 12], num_classes=3, workers=0)
    xb, yb = data.val.__getitems__([3, 0, 5])
    assert xb.shape == (3, 3, 12, 12) and yb.tolist() == [data.val.y[i].item() for i in (3, 0, 5)]
    assert abs(float(data.train.__getitems__(list(range(15)))[0].mean())) < 0.5, "standardised with meta.json"
    shard_check(data)
    cropped = Shards(str(tmp_path / "shards"), crop=8, shape=[3, 8, 8], num_classes=3, workers=0)
    assert cropped.train[0][0].shape == (3, 8, 8) and cropped.val[0][0].shape == (3, 8, 8)
    assert pickle.loads(pickle.dumps(data.train))._x is None, "memory maps must not be pickled to workers"


def test_shards_reject_bad_input(image_tree, tmp_path):
    with pytest.raises(ValueError, match="root.*missing train_x.npy.*data.convert"):
        ShardsConfig(root=str(tmp_path))
    convert(image_tree, tmp_path / "s", size=12)
    with pytest.raises(ValueError, match=r"shape.*data.shape=\[3,12,12\]"):
        ShardsConfig(root=str(tmp_path / "s"), shape=[3, 224, 224], num_classes=3)


def test_cifar10_loads_and_shards(cifar_dir):
    data = CIFAR10(str(cifar_dir), workers=0)
    assert len(data.train) == 40 and len(data.val) == 10
    x, y = data.train.__getitems__([0, 1, 2])
    assert x.shape == (3, 3, 32, 32) and x.dtype == torch.float32
    v1, v2 = data.val.__getitems__([0])[0], data.val.__getitems__([0])[0]
    assert torch.equal(v1, v2), "no augmentation on validation"
    shard_check(data)


def test_cifar10_rejects_bad_input(cifar_dir, tmp_path):
    with pytest.raises(ValueError, match="root.*no such folder"):
        CIFAR10Config(root=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="missing data_batch_1"):
        CIFAR10Config(root=str(tmp_path))
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        (tmp_path / name).write_bytes((cifar_dir / name).read_bytes())
    (tmp_path / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="data_batch_3 is not a CIFAR-10 batch file"):
        CIFAR10(str(tmp_path))


def test_text_loads_builds_vocabulary_and_shards(corpus):
    data = Text(str(corpus), shape=[6], num_classes=2, vocab_size=8, val_fraction=0.25)
    assert len(data.train) + len(data.val) == 40 and len(data.val) == 10
    x, y = data.train.__getitems__([0, 1])
    assert x.shape == (2, 6) and x.dtype == torch.long and set(y.tolist()) <= {0, 1}
    assert max(data.vocab.values()) == 7 and int(x.max()) <= 7
    assert (x == 0).any(), "short texts are padded with 0"
    shard_check(data)


def test_text_rejects_bad_input(corpus, tmp_path):
    with pytest.raises(ValueError, match="train_file.*no such file"):
        TextConfig(train_file=str(tmp_path / "none.tsv"))
    bad = tmp_path / "bad.tsv"
    bad.write_text("pos\tfine\nno tab here\n")
    with pytest.raises(ValueError, match=r"bad\.tsv:2: expected `label<TAB>text`"):
        Text(str(bad))
    with pytest.raises(ValueError, match="num_classes=3 but .* has 2 labels"):
        Text(str(corpus), num_classes=3)


def test_imagefolder_trains_with_background_loaders_under_mpirun(cli, image_tree):
    run = cli(
        "model=cnn",
        "data=imagefolder",
        f"data.root={image_tree}",
        "data.image_size=16",
        "data.num_classes=3",
        "data.workers=2",
        "devices=2",
        "train.epochs=2",
        "train.batch_size=4",
    )
    assert run.returncode == 0, run.output
    assert run.summary["steps"] == 4 and 0 <= run.summary["final_val_acc"] <= 1


def test_shards_train_under_mpirun(cli, image_tree, tmp_path):
    convert(image_tree, tmp_path / "shards", size=12)
    run = cli(
        "model=cnn",
        "data=shards",
        f"data.root={tmp_path / 'shards'}",
        "data.shape=[3,12,12]",
        "data.num_classes=3",
        "devices=2",
        "train.epochs=1",
        "train.batch_size=4",
    )
    assert run.returncode == 0, run.output


def test_missing_data_path_fails_before_launch(cli, tmp_path):
    run = cli("data=cifar10", f"data.root={tmp_path / 'nowhere'}", timeout=60)
    assert run.returncode != 0 and "data.root=" in run.output and "no such folder" in run.output
    assert not (run.dir / "mpirun.txt").exists()


def test_resnet18_trains_from_a_cifar_folder(cli, cifar_dir):
    run = cli(
        "model=resnet18",
        "data=cifar10",
        f"data.root={cifar_dir}",
        "devices=2",
        "train.epochs=1",
        "train.batch_size=8",
        timeout=300,
    )
    assert run.returncode == 0, run.output
    assert run.summary["steps"] == 3 and run.summary["model"] == "models.resnet.ResNet"


def test_lstm_trains_on_a_text_file(cli, corpus):
    run = cli(
        "model=lstm",
        "data=text",
        f"data.train_file={corpus}",
        "data.vocab_size=50",
        "devices=2",
        "train.epochs=15",
        "train.batch_size=4",
        "optim.lr=0.5",
        "optim.momentum=0",
        timeout=300,
    )
    assert run.returncode == 0, run.output
    assert run.summary["best_val_acc"] >= 0.75, "the toy corpus is separable by its words"


def test_alexnet_runs_a_few_steps_on_synthetic_data(cli):
    run = cli(
        "model=alexnet",
        "data=synthetic",
        "data.shape=[3,64,64]",
        "data.num_classes=100",
        "data.train_size=64",
        "data.val_size=16",
        "devices=2",
        "train.max_steps=3",
        "train.batch_size=8",
        "train.save_model=none",
        timeout=300,
    )
    assert run.returncode == 0, run.output
    assert run.summary["steps"] == 3
