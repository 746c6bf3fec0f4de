"""Files from outside are data, never code: a run folder's ``config.yaml`` that names a function to run
(``os.system`` as the model, the loss or the data set) or a module to import (``_schemas_``) is refused by
``resume=`` and ``eval=`` before anything is built; a crafted CIFAR-10 batch file is refused when the data
set loads; ``eval=`` of a ``model.pt`` with one changed byte says so instead of reporting other metrics."""

from __future__ import annotations

import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import yaml
from omegaconf import OmegaConf

from tests.conftest import ROOT, Run, compose_config, run_cli

MLP = ["model=mlp", "train.epochs=1"]
PLAIN = "tests.helpers.plain_data"


def touch(marker: Path) -> str:
    """A shell command that would leave ``marker`` behind if it ran."""
    return f"touch {marker}"


def saved_config(run_dir: Path, overrides: list[str]) -> dict:
    """Write ``run_dir/config.yaml`` as the launcher writes it; returns it as a dict."""
    from runner.schema.config import schema_paths

    cfg = compose_config(overrides)
    saved = OmegaConf.to_container(cfg, resolve=True)
    saved["_schemas_"] = schema_paths(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(yaml.safe_dump(saved))
    return saved


def crafted(config: dict, case: str, marker: Path) -> dict:
    """``config`` with ``case``'s crafted entry: os.system as the model, loss or data set, or a
    ``_schemas_`` module that runs the command when imported (``evilschema``, next to the marker)."""
    config = yaml.safe_load(yaml.safe_dump(config))
    command = {"_target_": "os.system", "command": touch(marker)}
    if case == "model":
        config["model"], config["_schemas_"]["model"] = command, "target"
    elif case == "loss":
        config["task"]["loss"] = command
    elif case == "data":
        config["_schemas_"]["data"] = "runner.data.dataset.DatasetConfig"
        keep = {k: config["data"][k] for k in ("shape", "num_classes", "assignment")}
        config["data"] = {**keep, "train": command, "val": {"_target_": None}, "workers": 0}
    else:
        module = marker.parent / "evilschema.py"
        module.write_text(f"import os\nos.system({touch(marker)!r})\n")
        config["_schemas_"]["rule"] = "evilschema.BSPConfig"
    return config


def write_crafted(run_dir: Path, config: dict, case: str) -> Path:
    """Overwrite ``run_dir/config.yaml`` with ``case``'s crafted config; returns the marker to look for."""
    marker = run_dir.parent / f"{run_dir.name}.ran"
    (run_dir / "config.yaml").write_text(yaml.safe_dump(crafted(config, case, marker)))
    return marker


CASES = ["model", "loss", "data", "schemas"]
REFUSED = {
    "model": "model._target_=os.system is refused",
    "loss": "task.loss._target_=os.system is refused",
    "data": "data.train._target_=os.system is refused",
    "schemas": "_schemas_.rule=evilschema.BSPConfig is refused",
}


def env_with(folder: Path) -> dict[str, str]:
    """This environment with ``folder`` on PYTHONPATH (where ``evilschema`` would be imported from)."""
    paths = [str(folder), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}


# -- in one process: the rank's load and eval's own check ---------------------------------------------------


@pytest.mark.parametrize("case", CASES)
def test_load_refuses_what_no_key_builds_and_runs_nothing(tmp_path, case, monkeypatch):
    from runner.schema.config import load

    marker = write_crafted(tmp_path / "run", saved_config(tmp_path / "run", MLP), case)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match=REFUSED[case].replace(".", r"\.")) as err:
        load(tmp_path / "run" / "config.yaml")
    assert "config.yaml is data, never code" in str(err.value)
    assert not marker.exists(), "the command ran"


@pytest.mark.parametrize("case", CASES)
def test_eval_process_refuses_a_crafted_config_with_status_2(tmp_path, case, monkeypatch, capsys):
    from runner.rank import evaluate

    run_dir = tmp_path / "run"
    marker = write_crafted(run_dir, saved_config(run_dir, MLP), case)
    (run_dir / "model.pt").write_bytes(b"not read")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as done:
        evaluate.main([str(run_dir)])
    assert done.value.code == 2
    assert REFUSED[case] in capsys.readouterr().err
    assert not marker.exists(), "the command ran"


@pytest.mark.parametrize(
    "entry,message",
    [
        ({"rule": "subprocess.Popen"}, "_schemas_.rule=subprocess.Popen is refused"),
        (
            {"nosuch": "runner.rules.bsp.BSPConfig"},
            "_schemas_.nosuch=runner.rules.bsp.BSPConfig is refused: no such group",
        ),
        ({"rule": "runner.launcher.cli.main"}, "_schemas_.rule=runner.launcher.cli.main is refused"),
        (
            {"rule": "tests.helpers.plain_data.Blobs"},
            "_schemas_.rule=tests.helpers.plain_data.Blobs is refused",
        ),
        (
            {"rule": "tests.helpers.plain_data.Nowhere"},
            "_schemas_.rule=tests.helpers.plain_data.Nowhere is refused",
        ),
    ],
)
def test_schemas_name_the_runners_or_a_schema_class_of_the_project(tmp_path, entry, message):
    from runner.schema.config import load_structured

    config = saved_config(tmp_path, MLP)
    config["_schemas_"].update(entry)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        load_structured(tmp_path / "config.yaml")


@pytest.mark.parametrize(
    "node,message",
    [
        ({"model": {"_target_": "subprocess.run", "args": "x"}}, "model._target_=subprocess.run is refused"),
        ({"model": {"_target_": "torch.load", "f": "x"}}, "it is a function of torch.serialization"),
        ({"model": {"_target_": "torch.nn.Linear", "x": {"_target_": "builtins.eval"}}}, "model.x._target_="),
        ({"optim": {"_target_": "torch.nn.Linear"}}, "optim takes a torch.optim.Optimizer class"),
        ({"task": {"loss": {"_target_": "numpy.load"}}}, "task.loss takes a torch.nn.Module class"),
        ({"data": {"train": {"_target_": "torch.hub.load"}}}, "data.train takes a torch.utils.data.Dataset"),
    ],
)
def test_a_target_of_the_wrong_kind_is_refused_without_being_called(node, message):
    from runner.schema.trust import check_kinds, targets

    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        check_kinds(targets(node), "config.yaml")


def test_the_users_own_classes_and_torchs_pass():
    from runner.schema.trust import check_kinds, targets

    config = {
        "model": {
            "_target_": "torch.nn.TransformerEncoderLayer",
            "activation": {"_target_": "torch.nn.GELU"},
        },
        "optim": {"_target_": "torch.optim.RMSprop"},
        "task": {"loss": {"_target_": "torch.nn.HuberLoss"}},
        "data": {
            "train": {
                "_target_": "tests.helpers.plain_data.blobs_pair",
                "sizes": {"_target_": "builtins.dict"},
            },
            "val": {"_target_": "torch.utils.data.TensorDataset"},
        },
    }
    check_kinds(targets(config), "config.yaml")


# -- the command line: resume= and eval= exit 2 before anything starts ---------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished 2-rank run with a checkpoint and its model (the MLP on digits, a few seconds)."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    run = run_cli(run_dir, *MLP, "train.max_steps=6", "checkpoint.every=3", "hardware.bind=none")
    assert run.returncode == 0, run.output
    return run_dir


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.parametrize("how", ["resume", "eval"])
@pytest.mark.parametrize("case", CASES)
def test_resume_and_eval_of_a_crafted_run_folder_exit_2_and_run_nothing(tmp_path, trained, case, how):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    marker = write_crafted(run_dir, config, case)
    mpirun_log = (run_dir / "mpirun.log").read_text()
    run = run_cli(tmp_path / "other", f"{how}={run_dir}", env=env_with(tmp_path), timeout=120)
    assert run.returncode == 2, run.output
    assert REFUSED[case] in run.output, run.output
    assert not marker.exists(), "the command ran"
    assert (run_dir / "mpirun.log").read_text() == mpirun_log, "a rank started"
    if how == "resume":
        assert "invalid input, nothing was started" in run.output


@pytest.mark.slow
@pytest.mark.mpi
def test_the_users_own_model_and_data_still_resume_and_eval(tmp_path):
    from tests.jobs.test_examples import BLOBS, run_example

    run_dir = tmp_path / "run"
    first = run_example(run_dir, *BLOBS, "checkpoint.every=20", "hardware.bind=none")
    assert first.returncode == 0, first.output
    again = run_example(tmp_path / "x", f"resume={run_dir}", "train.epochs=3")
    assert again.returncode == 0, again.output
    assert Run(again.proc, run_dir).summary["resumed_from_step"] > 0
    evaluated = run_example(tmp_path / "y", f"eval={run_dir}")
    assert evaluated.returncode == 0, evaluated.output
    assert "warning" not in evaluated.output, evaluated.output


# -- model.pt's size and CRC-32 -----------------------------------------------------------------------------


def saved_model(run_dir: Path) -> Path:
    """A run folder with the MLP's config and its model saved as a run saves it (with its record)."""
    from runner.rank.saved_model import save_model
    from runner.schema.config import load

    saved_config(run_dir, MLP)
    save_model(load(run_dir / "config.yaml").model.build().state_dict(), run_dir / "model.pt")
    return run_dir / "model.pt"


def flip_tensor_byte(model: Path) -> None:
    """Flip one byte in the middle of the first tensor's data (the zip stays whole and readable)."""
    with zipfile.ZipFile(model) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 16)
    with open(model, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
        at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
        f.seek(at)
        byte = f.read(1)[0]
        f.seek(at)
        f.write(bytes([byte ^ 0x10]))


def test_eval_refuses_a_model_with_one_flipped_byte_naming_it(tmp_path, capsys):
    import torch

    from runner.rank import evaluate

    model = saved_model(tmp_path)
    assert (tmp_path / "model.pt.crc").is_file()
    flip_tensor_byte(model)
    torch.load(model, weights_only=True)  # torch reads it without a word
    with pytest.raises(SystemExit) as done:
        evaluate.main([str(tmp_path)])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert f"cannot evaluate {tmp_path}: {model} is damaged (checksum mismatch: CRC-32 " in err, err
    assert not (tmp_path / "eval.json").exists()


def test_a_model_saved_without_a_record_evaluates_with_one_warning(tmp_path, capsys):
    from runner.rank import evaluate

    saved_model(tmp_path)
    (tmp_path / "model.pt.crc").unlink()
    evaluate.main([str(tmp_path)])
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and "has no size and CRC-32 record" in err, err
    assert (tmp_path / "eval.json").is_file()


def test_an_intact_model_evaluates_in_silence_and_a_damaged_record_is_named(tmp_path, capsys):
    from runner.rank import evaluate

    saved_model(tmp_path)
    evaluate.main([str(tmp_path)])
    assert "warning" not in capsys.readouterr().err
    (tmp_path / "model.pt.crc").write_text("{")
    with pytest.raises(SystemExit) as done:
        evaluate.main([str(tmp_path)])
    assert done.value.code == 2 and "model.pt.crc is damaged" in capsys.readouterr().err


# -- CIFAR-10 batch files ------------------------------------------------------------------------------------


class RunsACommand:
    """Pickles as a call of os.system: what a crafted batch file holds."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self) -> tuple:
        return os.system, (self.command,)


def cifar_folder(root: Path, protocol: int = pickle.DEFAULT_PROTOCOL) -> Path:
    """Small batch files of CIFAR-10's python format (bytes keys, a uint8 array, labels, file names)."""
    rng = np.random.default_rng(0)
    root.mkdir(parents=True, exist_ok=True)
    for name, n in [*((f"data_batch_{i}", 4) for i in range(1, 6)), ("test_batch", 6)]:
        batch = {
            b"batch_label": name.encode(),
            b"labels": [int(v) for v in rng.integers(0, 10, n)],
            b"data": rng.integers(0, 255, (n, 3072), dtype=np.uint8),
            b"filenames": [f"{name}_{i}.png".encode() for i in range(n)],
        }
        (root / name).write_bytes(pickle.dumps(batch, protocol=protocol))
    return root


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_a_valid_cifar_batch_loads(tmp_path, protocol):
    from runner.data.cifar10 import CIFAR10Config

    data = CIFAR10Config(root=str(cifar_folder(tmp_path / "c", protocol)), workers=0).build()
    assert len(data.train) == 20 and len(data.val) == 6


def test_a_crafted_cifar_batch_is_refused_and_runs_nothing(tmp_path):
    from runner.data.cifar10 import CIFAR10Config

    root = cifar_folder(tmp_path / "c")
    marker = tmp_path / "ran"
    batch = {b"data": np.zeros((1, 3072), np.uint8), b"labels": [RunsACommand(touch(marker))]}
    (root / "data_batch_3").write_bytes(pickle.dumps(batch))
    with pytest.raises(ValueError, match=r"data_batch_3 is not a CIFAR-10 batch file.*names posix\.system"):
        CIFAR10Config(root=str(root), workers=0).build()
    assert not marker.exists(), "the batch file ran its command"


def test_the_trust_check_needs_no_torch_in_the_launcher():
    """The launcher's part (the standard library refused, _schemas_) imports neither torch nor the module."""
    code = (
        "import sys; from runner.schema.trust import check_paths, targets\n"
        "try:\n    check_paths(targets({'model': {'_target_': 'os.system'}}), 'c')\nexcept ValueError: pass\n"
        "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


@pytest.mark.slow
@pytest.mark.mpi
def test_eval_of_a_run_whose_model_has_one_flipped_byte_fails_naming_it(tmp_path, trained):
    run_dir = tmp_path / "run"
    shutil.copytree(trained, run_dir)
    assert (run_dir / "model.pt.crc").is_file(), "the run wrote no record with its model"
    flip_tensor_byte(run_dir / "model.pt")
    run = run_cli(tmp_path / "other", f"eval={run_dir}", timeout=120)
    assert run.returncode != 0, run.output
    assert f"{run_dir / 'model.pt'} is damaged (checksum mismatch" in run.output, run.output


INSTALLED = (  # a function of an installed package (returns the data set it is given): refused from elsewhere
    "data=dataset",
    "data.train._target_=torch.utils.data.default_convert",
    "+data.train.data._target_=tests.helpers.plain_data.Blobs",
    "data.shape=[4]",
    "data.num_classes=3",
    "model=mlp",
)


def test_the_ranks_take_the_config_their_launcher_vouched_for_and_check_any_other(tmp_path, monkeypatch):
    """A rank whose config.yaml has the hash the launcher set (MPITRAIN_CONFIG_SHA256: the user's own
    command line) loads what it names without MPITRAIN_TRUSTED_PACKAGES; without the hash, or with a file
    changed since, it checks it as a folder from elsewhere."""
    import hashlib

    from runner.launcher.launch import prepare
    from runner.run_folder import CONFIG_SHA_ENV
    from runner.schema.config import load

    monkeypatch.delenv("MPITRAIN_TRUSTED_PACKAGES", raising=False)
    prepare(compose_config(list(INSTALLED)), tmp_path / "run")
    config = tmp_path / "run" / "config.yaml"
    monkeypatch.delenv(CONFIG_SHA_ENV, raising=False)
    refused = r"data\.train\._target_=torch\.utils\.data\.default_convert is refused"
    with pytest.raises(ValueError, match=refused):
        load(config)
    monkeypatch.setenv(CONFIG_SHA_ENV, hashlib.sha256(config.read_bytes()).hexdigest())
    assert load(config).data.train["_target_"] == "torch.utils.data.default_convert"
    config.write_text(config.read_text() + "# changed after the launcher wrote it\n")
    with pytest.raises(ValueError, match="is refused"):
        load(config)


@pytest.mark.slow
@pytest.mark.mpi
def test_a_run_of_an_installed_packages_data_function_needs_no_trusted_packages(tmp_path, monkeypatch):
    """The user's own command line names a function of an installed package: the job trains."""
    monkeypatch.delenv("MPITRAIN_TRUSTED_PACKAGES", raising=False)
    run = run_cli(tmp_path / "run", *INSTALLED, "train.max_steps=3", "hardware.bind=none", timeout=120)
    assert run.returncode == 0, run.output
