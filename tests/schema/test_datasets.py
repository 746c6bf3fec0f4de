"""Every on-disk data format: loads from a small fixture in its real format, shards disjointly across two
ranks, rejects a bad path or a malformed file with an error naming it, and trains through mpirun."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from runner.data.cifar10 import CIFAR10Config
from runner.data.convert import convert
from runner.data.imagefolder import ImageFolderConfig
from runner.data.shards import ShardsConfig
from runner.data.text import TextConfig, vocabulary
from tests.conftest import checked_config

CLASSES = ["cat", "dog", "eel"]
EPOCHS = 3  # of the mpirun runs on the image fixture, 2 steps each (15 images, 2 ranks × 4): it learns in 1-2


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


def imagefolder(root: Path, *overrides: str):
    """The checked config of ``data=imagefolder`` on ``root`` with 16×16 crops and no loader processes."""
    return checked_config(
        ["data=imagefolder", f"data.root={root}", "data.image_size=16", "data.workers=0", *overrides]
    )


def counted_once(acc: float, n: int) -> bool:
    """Whether ``acc`` is a fraction of exactly ``n`` validation samples (none dropped or counted twice)."""
    return abs(acc * n - round(acc * n)) < 1e-6


@pytest.mark.parametrize(
    "option,key", {"cifar10": "root", "imagefolder": "root", "shards": "root", "text": "train_file"}.items()
)
def test_a_data_set_on_disk_needs_its_path(option, key):
    with pytest.raises(ValueError, match=f"data.{key}: no value given.*data.{key}="):
        checked_config([f"data={option}"])


def test_imagefolder_loads_and_shards(image_tree):
    cfg = imagefolder(image_tree)
    assert cfg.data.shape == cfg.model.input_shape == [3, 16, 16], "data.shape follows data.image_size"
    assert cfg.data.num_classes == cfg.model.num_classes == 3, "the class folders are counted"
    data = cfg.data.build()
    assert data.classes == CLASSES and len(data.train) == 15 and len(data.val) == 6
    assert data.shape == (3, 16, 16) and data.num_classes == 3 and data.workers == 0
    x, y = data.train[0]
    assert x.shape == (3, 16, 16) and x.dtype == torch.float32 and y == 0
    assert torch.equal(data.val[0][0], data.val[0][0]), "validation crops must be deterministic"
    assert x[0].mean() > x[1].mean() + 1, "class 0 (cat) has a saturated red channel"
    shard_check(data)


def test_imagefolder_fills_in_its_shape_and_class_count(image_tree):
    """Read when the config is checked, where the model's interpolations see them; in Python too."""
    cfg = checked_config(["data=imagefolder", f"data.root={image_tree}", "model=cnn"])
    assert cfg.model.input_shape == [3, 224, 224] and cfg.model.num_classes == 3
    assert imagefolder(image_tree, "data.shape=[3,16,16]", "data.num_classes=3").data.num_classes == 3
    schema = ImageFolderConfig(root=str(image_tree), image_size=12)
    assert schema.shape == [3, 12, 12] and schema.num_classes == 3 and schema.workers is None


def test_imagefolder_rejects_bad_input(image_tree, tmp_path):
    with pytest.raises(ValueError, match="root.*no folder"):
        ImageFolderConfig(root=str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match=r"data\.root=.*no folder .*nowhere/train"):
        imagefolder(tmp_path / "nowhere")
    with pytest.raises(ValueError, match=r"data\.shape=\[3, 8, 8\].*\[3, 16, 16\].*set data\.image_size"):
        imagefolder(image_tree, "data.shape=[3,8,8]")
    with pytest.raises(ValueError, match="data.resize=8.*>= image_size"):
        imagefolder(image_tree, "data.resize=8")
    with pytest.raises(ValueError, match="data.num_classes=5.*3 class folders.*data.num_classes=3"):
        imagefolder(image_tree, "data.num_classes=5")
    empty = tmp_path / "empty"
    (empty / "train").mkdir(parents=True)
    (empty / "val").mkdir()
    with pytest.raises(ValueError, match="data.root=.*train has no class folders"):
        imagefolder(empty)
    broken = tmp_path / "broken"
    for split in ("train", "val"):
        (broken / split / "cat").mkdir(parents=True)
        (broken / split / "cat" / "0.jpg").write_bytes(b"not a jpeg")
    data = ImageFolderConfig(
        root=str(broken), image_size=8, shape=[3, 8, 8], num_classes=1, workers=0
    ).build()
    with pytest.raises(ValueError, match=r"cannot read image .*0\.jpg"):
        data.train[0]


def test_convert_to_shards_and_load(image_tree, tmp_path):
    meta = convert(image_tree, tmp_path / "shards", size=12)
    assert meta["classes"] == CLASSES and meta["train"] == 15 and len(meta["mean"]) == 3
    x = np.load(tmp_path / "shards" / "train_x.npy", mmap_mode="r")
    assert x.shape == (15, 12, 12, 3) and x.dtype == np.uint8
    data = ShardsConfig(root=str(tmp_path / "shards"), shape=[3, 12, 12], num_classes=3, workers=0).build()
    assert data.classes == CLASSES and data.shape == (3, 12, 12) and data.num_classes == 3
    xb, yb = data.val.__getitems__([3, 0, 5])
    assert xb.shape == (3, 3, 12, 12) and yb.tolist() == [data.val.y[i].item() for i in (3, 0, 5)]
    assert abs(float(data.train.__getitems__(list(range(15)))[0].mean())) < 0.5, "standardised with meta.json"
    shard_check(data)
    cropped = ShardsConfig(root=str(tmp_path / "shards"), crop=8, shape=[3, 8, 8], num_classes=3, workers=0)
    cropped = cropped.build()
    assert cropped.train[0][0].shape == (3, 8, 8) and cropped.val[0][0].shape == (3, 8, 8)
    assert pickle.loads(pickle.dumps(data.train))._x is None, "memory maps must not be pickled to workers"


def test_shards_fill_in_their_shape_and_class_count(image_tree, tmp_path):
    """From meta.json, when the config is checked: the model's interpolations see them; in Python too."""
    root = tmp_path / "s"
    convert(image_tree, root, size=12)
    cfg = checked_config(["data=shards", f"data.root={root}", "model=cnn"])
    assert cfg.data.shape == cfg.model.input_shape == [3, 12, 12] and cfg.model.num_classes == 3
    cfg = checked_config(["data=shards", f"data.root={root}", "data.crop=8", "model=mlp"])
    assert cfg.model.input_shape == [3, 8, 8] and cfg.data.workers is None
    schema = ShardsConfig(root=str(root), crop=10)
    assert schema.shape == [3, 10, 10] and schema.num_classes == 3


def test_shards_reject_bad_input(image_tree, tmp_path):
    with pytest.raises(ValueError, match="root.*missing train_x.npy.*data.convert"):
        ShardsConfig(root=str(tmp_path))
    with pytest.raises(ValueError, match=r"data\.root=.*missing train_x\.npy") as refused:
        checked_config(["data=shards", f"data.root={tmp_path}", "model=resnet18"])
    assert "model.root" not in str(refused.value), "said once, as data.root (the model's shape read it)"
    root = tmp_path / "s"
    convert(image_tree, root, size=12)
    with pytest.raises(ValueError, match=r"data\.num_classes=4 .*3 classes: use data\.num_classes=3"):
        checked_config(["data=shards", f"data.root={root}", "data.num_classes=4"])
    with pytest.raises(ValueError, match=r"shape.*data.shape=\[3,12,12\]"):
        ShardsConfig(root=str(root), shape=[3, 224, 224], num_classes=3)
    with pytest.raises(ValueError, match=r"shape.*with crop=8 use data.shape=\[3,8,8\]"):
        ShardsConfig(root=str(root), crop=8, shape=[3, 12, 12], num_classes=3)
    with pytest.raises(ValueError, match="crop=20.*at most 12"):
        ShardsConfig(root=str(root), crop=20, shape=[3, 20, 20], num_classes=3)
    with pytest.raises(ValueError, match="num_classes=1000.*data.num_classes=3"):
        ShardsConfig(root=str(root), shape=[3, 12, 12], num_classes=1000)
    meta = json.loads((root / "meta.json").read_text())
    (root / "meta.json").write_text(json.dumps({**meta, "image_shape": [16, 16, 3]}))
    with pytest.raises(
        ValueError, match=r"train_x\.npy holds images of 12×12×3, but .*meta\.json says 16×16×3"
    ):
        ShardsConfig(root=str(root))
    (root / "meta.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"meta\.json is not the meta\.json"):
        ShardsConfig(root=str(root))


def test_cifar10_loads_and_shards(cifar_dir):
    cfg = checked_config(["data=cifar10", f"data.root={cifar_dir}", "data.workers=0"])
    assert cfg.model.input_shape == [3, 32, 32] and cfg.model.num_classes == 10
    data = cfg.data.build()
    assert len(data.train) == 40 and len(data.val) == 10 and data.shape == (3, 32, 32)
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
    with pytest.raises(ValueError, match=r"data\.shape=\[3, 64, 64\].*yields \[3, 32, 32\]"):
        checked_config(["data=cifar10", f"data.root={cifar_dir}", "data.shape=[3,64,64]"])
    with pytest.raises(ValueError, match="num_classes=100.*10 classes"):
        CIFAR10Config(root=str(cifar_dir), num_classes=100)
    for name in [*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"]:
        (tmp_path / name).write_bytes((cifar_dir / name).read_bytes())
    (tmp_path / "data_batch_3").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="data_batch_3 is not a CIFAR-10 batch file"):
        CIFAR10Config(root=str(tmp_path)).build()


def test_text_loads_builds_vocabulary_and_shards(corpus):
    data = TextConfig(
        train_file=str(corpus), shape=[6], num_classes=2, vocab_size=8, val_fraction=0.25
    ).build()
    assert len(data.train) + len(data.val) == 40 and len(data.val) == 10
    assert data.classes == ["neg", "pos"] and data.shape == (6,)
    x, y = data.train.__getitems__([0, 1])
    assert x.shape == (2, 6) and x.dtype == torch.long and set(y.tolist()) <= {0, 1}
    assert int(torch.cat([data.train.x, data.val.x]).max()) <= 7
    assert (data.train.x == 0).any(), "short texts are padded with 0"
    shard_check(data)
    vocab = vocabulary(["b a", "a c", "a b"], size=4)
    assert vocab == {"a": 2, "b": 3}, "the size - 2 most frequent words, ids from 2"


def test_text_rejects_bad_input(corpus, tmp_path):
    with pytest.raises(ValueError, match="train_file.*no such file"):
        TextConfig(train_file=str(tmp_path / "none.tsv"))
    bad = tmp_path / "bad.tsv"
    bad.write_text("pos\tfine\nno tab here\n")
    with pytest.raises(ValueError, match=r"bad\.tsv:2: expected `label<TAB>text`"):
        TextConfig(train_file=str(bad)).build()
    with pytest.raises(ValueError, match="num_classes=3 but .* has 2 labels"):
        TextConfig(train_file=str(corpus), num_classes=3).build()
    with pytest.raises(ValueError, match=r"shape=\[6, 6\].*sequence length"):
        TextConfig(train_file=str(corpus), shape=[6, 6])


def test_missing_data_path_fails_before_launch(cli, tmp_path):
    """The launcher checks the path itself (no mpirun): one line naming the key, nothing started."""
    run = cli("data=cifar10", f"data.root={tmp_path / 'nowhere'}", timeout=60)
    assert run.returncode != 0 and "data.root=" in run.output and "no such folder" in run.output
    assert not (run.dir / "mpirun.txt").exists()


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("option", ["imagefolder", "shards"])
def test_images_train_under_mpirun(cli, image_tree, tmp_path, option):
    """The image fixture through real jobs: decoded by background loader processes, or from shards."""
    if option == "shards":
        convert(image_tree, tmp_path / "shards", size=12)
        data = [f"data.root={tmp_path / 'shards'}"]  # shape and class count from meta.json
    else:
        data = [f"data.root={image_tree}", "data.image_size=16", "data.workers=2"]
    train = ["devices=2", f"train.epochs={EPOCHS}", "train.batch_size=4"]
    run = cli("model=cnn", f"data={option}", *data, *train)
    assert run.returncode == 0, run.output
    summary, validations = run.summary, run.records("val")
    assert summary["data"].startswith(f"runner.data.{option}.") and summary["steps"] == 2 * EPOCHS
    assert len(validations) == EPOCHS and all(counted_once(r["val_acc"], 6) for r in validations)
    assert summary["best_val_acc"] >= 5 / 6, "each class has its own saturated colour channel"


@pytest.mark.slow
@pytest.mark.mpi
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
    summary = run.summary
    assert summary["steps"] == 3 and summary["model"] == "runner.models.resnet.ResNet"
    assert summary["data"].startswith("runner.data.cifar10.") and counted_once(summary["final_val_acc"], 10)


@pytest.mark.slow
@pytest.mark.mpi
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
    assert (
        run.summary["data"].startswith("runner.data.text.")
        and run.summary["model"] == "runner.models.lstm.LSTMClassifier"
    )
    assert run.summary["best_val_acc"] >= 0.75, "the toy corpus is separable by its words"


@pytest.mark.slow
@pytest.mark.mpi
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
    assert run.summary["steps"] == 3 and run.summary["data"].startswith("runner.data.synthetic.")
    assert [r["epoch"] for r in run.records("val")] == [0] and counted_once(run.summary["final_val_acc"], 16)
    assert not (run.dir / "model.pt").exists(), "train.save_model=none"
