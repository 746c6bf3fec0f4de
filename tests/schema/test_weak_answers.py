"""Older weak answers (issue 46), each now one clear line naming the key and the fix: a user's data set whose
samples differ in shape or whose constructor raises, EASGD refused under ``hardware.max_workers``, a model
reading a data key ``data=dataset`` leaves unset, and a warm-up as long as the run."""

from __future__ import annotations

import pickle
import sys
import textwrap

import pytest
import torch

from runner.data.dataset import DatasetConfig
from runner.rank.records.output import root_cause
from runner.schedule.constant import ConstantConfig
from runner.schedule.cosine import CosineConfig
from runner.schedule.step import StepConfig
from tests.conftest import checked_config

SUBSET = "torch.utils.data.Subset"

#: A user's module, as a project of theirs writes it (no base class of the runner).
USER_MODULE = '''
import torch
from torch.utils.data import Dataset


class Ragged(Dataset):
    """64 samples of 4 features and a class; sample ``bad`` has 5 features, or a target of shape [2]."""

    def __init__(self, bad=9, part="inputs", size=64):
        self.bad, self.part, self.size = bad, part, size

    def __len__(self):
        return self.size

    def __getitem__(self, i):
        odd = i == self.bad
        x = torch.ones(5 if odd and self.part == "inputs" else 4)
        y = torch.zeros(2, dtype=torch.long) if odd and self.part == "targets" else i % 3
        return x, y


class Broken(Dataset):
    def __init__(self, root="/nowhere"):
        raise FileNotFoundError(f"no such folder: {root}")
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """``weak_sets``, the user's module, importable from the working folder as the ranks find it."""
    (tmp_path / "weak_sets.py").write_text(textwrap.dedent(USER_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "weak_sets"
    sys.modules.pop("weak_sets", None)


# 1. Samples of different shapes: collate's "stack expects each tensor to be equal size" (or, in a loader
# process, "storage that is not resizable") named neither the samples nor the data set.


@pytest.mark.parametrize("part,shapes", [("inputs", ("[5]", "[4]")), ("targets", ("[2]", "[]"))])
def test_samples_of_different_shapes_are_named_with_their_indices_and_the_key(user_module, part, shapes):
    ragged = {"_target_": f"{user_module}.Ragged", "part": part}
    data = DatasetConfig(
        train=ragged, val={"_target_": f"{user_module}.Ragged", "bad": -1}, workers=0
    ).build()
    with pytest.raises(ValueError) as refused:
        next(iter(data.train_loader(0, 1, 64, seed=0)))
    message = str(refused.value)
    assert message.startswith(f"data.train._target_={user_module}.Ragged: sample "), message
    assert "sample 9" in message and f"{part} of shape" in message, message
    assert all(shape in message for shape in shapes), message
    assert f"return {part} of one shape" in message, message


def test_a_held_out_split_names_the_samples_by_their_index_in_the_data_set(user_module):
    data = DatasetConfig(train={"_target_": f"{user_module}.Ragged", "bad": 9}, workers=0).build()
    loaders = [data.train_loader(0, 1, 64, seed=0), data.val_loader(0, 1, 64)]
    with pytest.raises(ValueError, match=r"sample 9 has inputs of shape \[5\]|but sample 9 has \[5\]"):
        for loader in loaders:
            next(iter(loader))


def test_the_checked_data_set_reaches_loader_processes_by_name(user_module):
    """Loader processes (forkserver) unpickle the data set: its class is found by name."""
    data = DatasetConfig(train={"_target_": f"{user_module}.Ragged", "bad": -1}, workers=0).build()
    again = pickle.loads(pickle.dumps(data.train))
    assert type(again.dataset) is type(data.train.dataset) and len(again) == len(data.train)
    x, y = next(iter(torch.utils.data.DataLoader(again, batch_size=8)))
    assert x.shape == (8, 4) and y.shape == (8,)


# 2. A constructor that raises: the rank's line named only the user's exception, not the key that built it.


@pytest.mark.parametrize(
    "kwargs,key",
    [
        ({"train": {"_target_": "weak_sets.Broken"}}, "data.train._target_=weak_sets.Broken"),
        (
            {
                "train": {"_target_": "weak_sets.Ragged"},
                "val": {"_target_": "weak_sets.Broken", "root": "/v"},
            },
            "data.val._target_=weak_sets.Broken",
        ),
        (
            {"train": {"_target_": SUBSET, "dataset": {"_target_": "weak_sets.Broken"}, "indices": [0]}},
            "data.train.dataset._target_=weak_sets.Broken",
        ),
    ],
)
def test_a_constructor_that_raises_is_named_with_its_key_on_the_ranks_line(user_module, kwargs, key):
    with pytest.raises(ValueError) as refused:
        DatasetConfig(**kwargs, workers=0).build()
    line = root_cause(refused.value)  # what "rank N failed: ..." says
    assert line.startswith(f"ValueError: {key} failed: FileNotFoundError: no such folder: /"), line
    raised_at = (
        USER_MODULE.splitlines().index('        raise FileNotFoundError(f"no such folder: {root}")') + 1
    )
    assert line.endswith(f"weak_sets.py:{raised_at})"), f"the user's own line: {line}"


# 3. EASGD under hardware.max_workers said "devices × alpha" and named neither key to change.


def test_easgd_refused_for_the_workers_a_job_may_grow_to_names_both_keys():
    grown = ["rule=easgd", "rule.alpha=0.3", "hardware.fault_tolerance=heal", "hardware.max_workers=8"]
    with pytest.raises(ValueError) as refused:
        checked_config(grown)
    message = str(refused.value)
    assert message.startswith("hardware.max_workers=8 lets the job grow to 8 workers"), message
    assert "rule.alpha=0.3 is invalid: sync EASGD with 8 workers has beta = 8 × alpha = 2.4" in message
    assert "use rule.alpha <= 0.125" in message and "or lower hardware.max_workers" in message, message
    assert "devices ×" not in message
    checked_config([*grown[:-1], "hardware.max_workers=6"])  # 6 × 0.3 < 2


def test_easgd_refused_for_its_devices_says_how_many_workers():
    with pytest.raises(ValueError, match=r"^rule\.alpha=0\.6 is invalid: sync EASGD with 4 workers"):
        checked_config(["rule=easgd", "rule.alpha=0.6", "devices=4"])
    with pytest.raises(ValueError, match=r"rule\.beta=5\.0 is invalid: with 2 workers .*rule\.beta <= 2"):
        checked_config(["rule=easgd", "rule.beta=5", "devices=2"])


# 4. A model reading data.shape or data.num_classes that data=dataset leaves unset: OmegaConf's "While
# dereferencing interpolation '${data.num_classes}': Incompatible value 'None'".

TRAIN = "data.train._target_=tests.helpers.plain_data.Blobs"


@pytest.mark.parametrize(
    "given,message",
    [
        (
            [],
            r"^data\.shape and data\.num_classes are not given, but model\.input_shape: \$\{data\.shape\} "
            r"and model\.num_classes: \$\{data\.num_classes\} read them, and data=dataset cannot know them .*"
            r"give them, e.g\. data\.shape=\[3,32,32\] .* data\.num_classes=10",
        ),
        (
            ["data.shape=[4]"],
            r"^data\.num_classes is not given, but model\.num_classes: .* reads it.*give it",
        ),
        (["data.num_classes=3"], r"^data\.shape is not given, but model\.input_shape: .*data\.shape=\["),
    ],
)
def test_a_model_reading_unset_data_keys_names_them(given, message):
    with pytest.raises(ValueError, match=message):
        checked_config(["model=mlp", "data=dataset", TRAIN, *given])


def test_a_custom_model_reading_an_unset_data_key_names_it():
    custom = ["model=custom", "model._target_=torch.nn.Linear", "+model.out_features=3"]
    with pytest.raises(
        ValueError, match=r"^data\.shape is not given, but model\.in_features: \$\{data\.shape\[0\]\}"
    ):
        checked_config(["data=dataset", TRAIN, *custom, "+model.in_features=${data.shape[0]}"])
    cfg = checked_config(
        ["data=dataset", TRAIN, "data.shape=[4]", *custom, "+model.in_features=${data.shape[0]}"]
    )
    assert cfg.model.args["in_features"] == 4


# 5. A warm-up longer than the run was accepted: the rate never reached optim.lr.


@pytest.mark.parametrize("schedule", [[], ["schedule=cosine"], ["schedule=step", "schedule.milestones=[60]"]])
def test_a_warmup_longer_than_max_steps_is_refused_before_launch(schedule):
    with pytest.raises(ValueError) as refused:
        checked_config([*schedule, "schedule.warmup_steps=51", "train.max_steps=50"])
    message = str(refused.value)
    assert message.startswith(
        "schedule.warmup_steps=51 is invalid: it is longer than the run, 50 optimizer steps"
    )
    assert "(train.max_steps=50)" in message and "schedule.warmup_steps=5," in message, message
    assert message.endswith("or raise train.max_steps"), message
    assert (
        checked_config([*schedule, "schedule.warmup_steps=50", "train.max_steps=50"]).schedule.warmup_steps
        == 50
    )


@pytest.mark.parametrize(
    "cfg",
    [ConstantConfig(warmup_steps=100), CosineConfig(warmup_steps=46), StepConfig(100, milestones=[200])],
)
def test_a_warmup_longer_than_the_epochs_is_refused_on_the_rank(cfg):
    """With no train.max_steps the run's length is known on the ranks (an epoch's steps): they refuse it
    when they build the schedule, before training."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError) as refused:
        cfg.build(optimizer, 45)
    message = str(refused.value)
    assert message.startswith(
        f"schedule.warmup_steps={cfg.warmup_steps} is invalid: it is longer than the run, 45"
    )
    assert "train.epochs ×" in message and "schedule.warmup_steps=4," in message, message
    assert ConstantConfig(warmup_steps=45).build(optimizer, 45).total_steps == 45
