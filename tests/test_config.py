"""Config composition with Hydra's compose API, value checks, and bad input on the real command line."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

import runner.config  # noqa: F401
from runner.config import validate
from tests.conftest import CONF


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


GROUP_OPTIONS = [
    (group.name, option.stem)
    for group in sorted(CONF.iterdir())
    if group.is_dir()
    for option in sorted(group.glob("*.yaml"))
]


NEEDS = {"cluster": ["hardware.hosts=[localhost:2]"]}


def test_every_group_has_options():
    groups = {g for g, _ in GROUP_OPTIONS}
    assert {"model", "data", "rule", "optim", "hardware"} <= groups


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_option_composes_and_validates(group, option):
    """Options that need a path (data sets on disk) must say which key is missing."""
    cfg = _compose(f"{group}={option}", *NEEDS.get(option, []))
    assert OmegaConf.select(cfg, group) is not None
    missing = OmegaConf.missing_keys(cfg)
    if missing:
        with pytest.raises(ValueError, match=sorted(missing)[0].replace(".", r"\.") + ".*no value given"):
            validate(cfg)
    else:
        assert validate(cfg).devices == 2


def test_default_config():
    cfg = _compose()
    assert cfg.devices == 2 and cfg.rule.mode == "grads" and cfg.model.num_classes == 10
    assert list(cfg.model.input_shape) == [1, 8, 8]


def test_model_shape_follows_data():
    cfg = _compose("data=synthetic", "data.shape=[3,16,16]", "data.num_classes=7")
    checked = validate(cfg)
    assert checked.model.input_shape == [3, 16, 16] and checked.model.num_classes == 7


def test_unknown_rule():
    with pytest.raises(MissingConfigException, match="bsp"):
        _compose("rule=nosuchrule")


def test_misspelt_key_fails_at_compose():
    with pytest.raises(ConfigCompositionException, match="rule.mdoe"):
        _compose("rule.mdoe=params")


def test_misspelt_key_in_a_yaml_fails_at_compose(tmp_path):
    (tmp_path / "rule").mkdir()
    (tmp_path / "rule" / "typo.yaml").write_text(
        "defaults:\n  - /schema/rule/bsp@_here_\n  - _self_\nmdoe: x\n"
    )
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        with pytest.raises((ConfigCompositionException, ConfigKeyError), match="mdoe"):
            compose(config_name="config", overrides=[f"hydra.searchpath=[file://{tmp_path}]", "rule=typo"])


def test_wrong_type_fails_at_compose():
    with pytest.raises((ConfigCompositionException, ValidationError), match="optim.lr"):
        _compose("optim.lr=fast")


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["devices=0"], "devices"),
        (["optim.lr=-0.1"], "optim.lr"),
        (["optim.momentum=1.5"], "optim.momentum"),
        (["rule.mode=both"], "rule.mode"),
        (["rule.avg_freq=0"], "rule.avg_freq"),
        (["train.batch_size=0"], "train.batch_size"),
        (["hardware.bind=everywhere"], "hardware.bind"),
        (["train.save_model=sometimes"], "train.save_model"),
        (["rule=easgd", "rule.alpha=0"], "rule.alpha"),
        (["rule=easgd", "rule.beta=0.9", "rule.alpha=0.2"], "rule.alpha"),
        (["rule=easgd", "rule.alpha=0.5", "devices=4"], "rule.alpha"),
        (["rule=easgd", "rule.beta=2.5"], "rule.beta"),
        (["rule=easgd", "rule.tau=0"], "rule.tau"),
        (["rule=easgd", "rule.variant=later"], "rule.variant"),
        (["rule=gosgd", "rule.p=1.5"], "rule.p"),
        (["rule=gosgd", "devices=1"], "rule.p"),
        (["rule=asgd", "rule.servers=3"], "rule.servers"),
        (["rule=asgd", "rule.servers=0"], "rule.servers"),
        (["rule=asgd", "rule.staleness=drop"], "rule.max_staleness"),
        (["rule=asgd", "rule.n_push=0"], "rule.n_push"),
        (["hardware=cluster"], "hardware.hosts"),
        (["hardware.hosts=[a:b]"], "hardware.hosts"),
        (["hardware.hostfile=/nonexistent"], "hardware.hostfile"),
    ],
)
def test_bad_values_name_their_key(overrides, key):
    cfg = _compose(*overrides)
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate(cfg)


def test_world_size_counts_server_ranks():
    from runner.launch import world_size

    assert world_size(validate(_compose("rule=bsp", "devices=3"))) == 3
    assert world_size(validate(_compose("rule=easgd", "rule.variant=async", "devices=3"))) == 4
    assert world_size(validate(_compose("rule=asgd", "rule.servers=2", "devices=3"))) == 5


@pytest.mark.parametrize(
    "override,message",
    [
        ("rule=nosuchrule", "rule/nosuchrule"),
        ("devices=0", "devices=0 is invalid"),
        ("rule.mdoe=params", "rule.mdoe"),
        ("optim.lr=-0.1", "optim.lr=-0.1 is invalid"),
        pytest.param(
            "hardware=gpu",
            "hardware.device='cuda'",
            marks=pytest.mark.skipif(
                __import__("torch").cuda.is_available(), reason="this machine has a GPU"
            ),
        ),
    ],
)
def test_bad_input_on_the_command_line_starts_no_process(cli, override, message):
    run = cli(override, timeout=60)
    assert run.returncode in (1, 2), "1: Hydra could not compose it, 2: our checks refused it"
    assert message in run.output and "Traceback" not in run.output, run.output
    assert not (run.dir / "mpirun.txt").exists() and not (run.dir / "logs").exists()
