"""The tests' cache of Hydra's loaded configs (tests/hydra_cache.py) composes what Hydra alone composes."""

from __future__ import annotations

from typing import Any

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, ListConfig, OmegaConf

from tests import hydra_cache
from tests.conftest import CONF, compose_config

EXAMPLE = "hydra.searchpath=[file://examples/my_project/conf]"
CASES = [
    [],
    ["rule=easgd", "devices=4", "optim.lr=0.2", "logger=[tensorboard,mlflow]", "network=lan"],
    ["recipe=shakespeare_char_diloco"],
    [EXAMPLE, "model=blob_mlp", "data=blobs"],
]


def _shape(node: Any, path: str = "") -> list[tuple]:
    """Every node's path, value (unresolved), type and flags: what two compositions must agree on."""
    flags = tuple(node._get_node_flag(f) for f in ("struct", "readonly"))
    if isinstance(node, DictConfig):
        out = [(path, "dict", OmegaConf.get_type(node), flags, node._is_none(), node._is_missing())]
        if not node._is_none() and not node._is_missing():
            for key in node:
                out += _shape(node._get_node(key), f"{path}.{key}")
        return out
    if isinstance(node, ListConfig):
        out = [(path, "list", flags, node._is_none(), node._is_missing())]
        if not node._is_none() and not node._is_missing():
            for i in range(len(node)):
                out += _shape(node._get_node(i), f"{path}[{i}]")
        return out
    return [(path, type(node).__name__, node._value(), flags)]


def _composed(overrides: list[str], hydra: bool) -> list[tuple]:
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=hydra)
    return _shape(cfg)


@pytest.fixture
def hydra_alone():
    """Composes as Hydra does without the cache, then puts it back."""
    compose_config()  # (the runner's registration)
    hydra_cache.uninstall()
    yield
    hydra_cache.install()


@pytest.mark.parametrize("hydra", [False, True], ids=["job", "with-hydra"])
def test_the_cache_composes_what_hydra_composes(hydra_alone, hydra):
    alone = [_composed(overrides, hydra) for overrides in CASES]
    hydra_cache.install()
    twice = [[_composed(overrides, hydra) for overrides in CASES] for _ in range(2)]  # filled, then read
    assert twice[0] == alone and twice[1] == alone


def test_a_rewritten_yaml_is_read_anew_and_a_composed_config_is_the_callers_own(tmp_path):
    (tmp_path / "model").mkdir()
    mine = tmp_path / "model" / "mine.yaml"
    overrides = [f"hydra.searchpath=[file://{tmp_path}]", "model=mine", "model.dropout=0.1"]
    text = (CONF / "model" / "mlp.yaml").read_text() + "hidden: [11]\n"
    mine.write_text(text)
    assert compose_config(overrides).model.hidden == [11]
    mine.write_text(text.replace("[11]", "[22]"))  # same size, within the file system's time step
    assert compose_config(overrides).model.hidden == [22]
    first = compose_config(["optim.lr=0.3"])
    first.optim.lr = 9.0
    first.train.epochs = 7
    again = compose_config(["optim.lr=0.3"])
    assert again.optim.lr == 0.3 and again.train.epochs != 7
    assert not hydra_cache.memoizable(overrides) and not hydra_cache.memoizable(["model=my_project.nets"])
