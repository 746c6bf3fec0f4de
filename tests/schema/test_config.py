"""Config composition with Hydra's compose API, value checks, and bad input on the real command line."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException, MissingConfigException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from runner.schema.config import validate
from tests.conftest import CONF, ROOT, compose_config
from tests.helpers.rules import NEEDS as NEEDS_OF_RULES
from tests.helpers.rules import needs, rules


def _compose(*overrides: str):
    return compose_config(overrides)


GROUP_OPTIONS = [
    (group.name, option.stem)
    for group in sorted(CONF.iterdir())
    if group.is_dir() and group.name not in ("recipe", "network")  # set other groups' keys: tested apart
    for option in sorted(group.glob("*.yaml"))
]


IMAGES_32 = ["data=synthetic", "data.shape=[3,32,32]"]
#: data=shakespeare_char's corpus on the test machines (../shared/data/README.md), so that nothing is fetched.
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare"
NEEDS = {
    "cluster": ["hardware.hosts=[localhost:2]"],
    "alexnet": ["data=synthetic", "data.shape=[3,64,64]"],
    "googlenet": IMAGES_32,
    "vgg16": IMAGES_32,
    "vgg16_bn": IMAGES_32,
    "lstm": ["data=text"],  # which then asks for data.train_file
    "gpt": ["data=synthetic", "data.shape=[64]", "model.vocab_size=65"],  # a vocabulary, as data=tokens
    "gpt2": ["data=synthetic", "data.shape=[64]", "model.vocab_size=50257"],
    "dataset": ["model=mlp", "data.shape=[4]", "data.num_classes=3"],  # then asks for data.train._target_
    "shakespeare_char": ["model=gpt", f"data.root={SHAKESPEARE}"],
    **{rule: needs(rule) for rule in NEEDS_OF_RULES},
}


def test_every_group_has_options():
    groups = {g for g, _ in GROUP_OPTIONS}
    assert {"model", "data", "rule", "optim", "hardware"} <= groups


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_option_composes_and_validates(group, option):
    """Options that need a path (data sets on disk) must say which key is missing."""
    if group == "logger" and option in ("mlflow", "wandb") and importlib.util.find_spec(option) is None:
        pytest.skip(f'logger={option} needs {option}, not installed: pip install -e ".[{option}]"')
    if option == "shakespeare_char" and not (SHAKESPEARE / "input.txt").is_file():
        pytest.skip(f"data=shakespeare_char would fetch its corpus: no {SHAKESPEARE / 'input.txt'} here")
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
        (["rule.comm_dtype=fp8"], "rule.comm_dtype"),
        (["rule=gosgd", "rule.comm_dtype=half"], "rule.comm_dtype"),
        (["rule=diloco", "rule.comm_dtype=int8"], "rule.comm_dtype"),
        (["rule.comm_dtype=bf16", "rule.overlap=nonblocking"], "rule.overlap"),
        (["hardware=cluster"], "hardware.hosts"),
        (["hardware=cluster", "hardware.hosts=[a:b]"], "hardware.hosts"),
        (["hardware=cluster", "hardware.hostfile=/nonexistent"], "hardware.hostfile"),
        (["hardware=slurm", "hardware.launcher=sometimes"], "hardware.launcher"),
        (["hardware.ranks_per_gpu=0"], "hardware.ranks_per_gpu"),
        (["hardware.min_workers=3"], "hardware.min_workers=3 is invalid: the job has devices=2"),
        (["+train.epoch=1"], "train.epoch: not an option of TrainConfig (did you mean train.epochs?)"),
        (["+model.widht=3"], "model.widht: not an option of CNNConfig (did you mean model.width?)"),
        (["+hardware.launcher=srun"], "hardware.launcher: not an option of CPUConfig"),
    ],
)
def test_bad_values_name_their_key(overrides, key):
    cfg = _compose(*overrides)
    with pytest.raises(ValueError, match=re.escape(key)):
        validate(cfg)


def test_world_size_counts_server_ranks():
    assert validate(_compose("rule=bsp", "devices=3")).world_size == 3
    assert validate(_compose("rule=easgd", "rule.variant=async", "devices=3")).world_size == 4
    assert validate(_compose("rule=asgd", "rule.servers=2", "devices=3")).world_size == 5


def test_options_only_select_their_schema():
    """Defaults live in the dataclass alone: a group's YAML sets no key its schema does not need to."""
    for group in ("rule", "optim", "hardware", "schedule", "task"):
        for yaml in (CONF / group).glob("*.yaml"):
            node = OmegaConf.load(yaml)
            own = {"_target_"} if yaml.stem == "custom" else {"defaults"}  # a class of the user's: no schema
            assert set(node.keys()) == own, f"{yaml} repeats {set(node.keys()) - own}"


@pytest.mark.parametrize("rule", rules())
def test_each_rule_option_is_its_module_s_schema_and_its_defaults_validate(rule):
    """``rule=NAME`` (conf/rule/NAME.yaml, what tests/helpers/rules.py lists for every per-rule test) takes
    runner/rules/NAME.py's schema, whose defaults pass the checks."""
    from runner.schema import RuleConfig, schema_of

    cls = schema_of("rule", rule)
    assert issubclass(cls, RuleConfig) and cls.__module__ == f"runner.rules.{rule}"
    assert isinstance(validate(_compose(f"rule={rule}", *NEEDS.get(rule, []))).rule, cls)


def test_every_rule_module_is_an_option():
    """The other way round: a rule's module without its YAML would be left out of every per-rule test."""
    from runner.schema import option_modules, schema_of

    def is_rule(module: str) -> bool:  # (base.py and fragments.py are helpers: they define no schema)
        try:
            return schema_of("rule", module) is not None
        except ValueError:
            return False

    assert {m for m in option_modules("rule") if is_rule(m)} == set(rules())
    assert {"base", "bsp"} <= set(option_modules("rule"))


def test_checked_config_holds_the_schema_objects():
    from runner.optim.sgd import SGDConfig
    from runner.rules.easgd import EASGDConfig

    checked = validate(_compose("rule=easgd", "rule.beta=0.6", "devices=3", "optim.lr=0.2"))
    assert isinstance(checked.rule, EASGDConfig) and isinstance(checked.optim, SGDConfig)
    assert checked.rule.alpha_for(checked.devices) == pytest.approx(0.2) and checked.optim.lr == 0.2


IMPORTS = """
import sys
from hydra import compose, initialize_config_dir
from runner.launcher.register import register
from runner.schema.config import validate
import runner.launcher.launch
register()
with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
    for overrides in sys.argv[2:]:
        validate(compose(config_name="config", overrides=overrides.split()))
print(sorted(m for m in ("torch", "sklearn", "numpy", "mpi4py") if m in sys.modules))
"""


def test_the_launcher_imports_no_torch_sklearn_or_mpi():
    """Composing and checking the default job with every rule imports none of torch, scikit-learn, MPI."""
    argv = [
        sys.executable,
        "-c",
        IMPORTS,
        str(CONF),
        *(" ".join([f"rule={r}", *NEEDS.get(r, [])]) for r in rules()),
    ]
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["rule=nosuchrule"], "rule/nosuchrule"),
        (["model=nosuch"], "model/nosuch"),
        (["devices=0"], "devices=0 is invalid"),
        (["devices=abc"], "devices"),
        (["rule.mdoe=params"], "rule.mdoe"),
        (["train.epoch=1"], "train.epoch"),
        (["devices=["], "no viable alternative"),
        (["optim.lr=-0.1"], "optim.lr=-0.1 is invalid"),
        (["+train.epoch=1"], "did you mean train.epochs?"),
        (  # a project's own model given by its class: its node's keys, and the + for an argument of one's own
            ["hydra.searchpath=[file://examples/my_project/conf]", "model=blob_mlp", "model.hiden=32"],
            "model.hiden: no such key (did you mean model.hidden?)",
        ),
        (["model=alexnet"], "model.input_shape=[1, 8, 8] is invalid: AlexNet needs height and width >= 63"),
        (["devices=1000"], "hardware.oversubscribe=true"),
        pytest.param(
            ["hardware=gpu"],
            "hardware.device='cuda'",
            marks=pytest.mark.skipif(
                __import__("torch").cuda.is_available(), reason="this machine has a GPU"
            ),
        ),
    ],
)
@pytest.mark.slow
def test_bad_input_on_the_command_line_exits_2_and_starts_no_process(cli, overrides, message):
    """Hydra's own compose errors (unknown option, misspelt key, wrong type, bad syntax) exit 2, as our
    checks do: a script can tell a typo from a failed job."""
    run = cli(*overrides, timeout=60)
    assert run.returncode == 2, run.output
    assert message in run.output and "Traceback" not in run.output, run.output
    assert not (run.dir / "mpirun.txt").exists() and not (run.dir / "logs").exists()


def test_an_unwritable_output_folder_is_not_invalid_input(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    argv = [sys.executable, "-m", "runner", f"hydra.run.dir={blocker / 'run'}"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stdout + proc.stderr


def test_invalid_input_is_told_from_other_errors():
    from hydra.errors import ConfigCompositionException, MissingConfigException
    from omegaconf.errors import InterpolationResolutionError

    from runner.launcher.cli import invalid_input

    assert invalid_input(ConfigCompositionException("x")) and invalid_input(MissingConfigException("x"))
    assert invalid_input(ValidationError("x")) and invalid_input(ValueError("x"))
    assert not invalid_input(RuntimeError("x")) and not invalid_input(None)
    wrapped = InterpolationResolutionError("could not resolve hydra.run.dir")
    wrapped.__cause__ = PermissionError(13, "Permission denied")
    assert not invalid_input(wrapped), "an OS error under Hydra's exception is the machine, not the input"


def test_run_folders_of_one_second_never_collide(tmp_path, monkeypatch):
    """``${mpitrain_unique:...}`` makes the folder itself: DATE/TIME, then TIME-2, TIME-3 for the launchers
    started in the same second; one config reads the same folder however often it is resolved."""
    from runner.launcher.register import register, unique_dir

    register()
    monkeypatch.chdir(tmp_path)
    names = [unique_dir("outputs/2026-01-01/12-00-00") for _ in range(3)]
    assert names == [
        "outputs/2026-01-01/12-00-00",
        "outputs/2026-01-01/12-00-00-2",
        "outputs/2026-01-01/12-00-00-3",
    ]
    assert all((tmp_path / n).is_dir() for n in names)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        first = compose(config_name="config", return_hydra_config=True)
        second = compose(config_name="config", return_hydra_config=True)
        sweep = compose(config_name="config", return_hydra_config=True, overrides=["hydra.mode=MULTIRUN"])
    runs = [first.hydra.run.dir, first.hydra.run.dir, second.hydra.run.dir]
    assert runs[0] == runs[1] and runs[0] != runs[2], runs
    assert runs[0].startswith("outputs/") and all((tmp_path / r).is_dir() for r in runs)
    assert (
        sweep.hydra.sweep.dir.startswith("outputs/multirun/") and (tmp_path / sweep.hydra.sweep.dir).is_dir()
    )


def test_resume_and_eval_keep_the_run_folder_and_file_their_records_beside_it(tmp_path, monkeypatch):
    from runner.launcher.register import register

    register()
    monkeypatch.chdir(tmp_path)
    run = str(tmp_path / "outputs" / "old")
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        resumed = compose(config_name="config", return_hydra_config=True, overrides=[f"resume={run}"])
        evaluated = compose(config_name="config", return_hydra_config=True, overrides=[f"eval={run}"])
        plain = compose(config_name="config", return_hydra_config=True)
    assert resumed.hydra.run.dir == run and resumed.hydra.output_subdir.startswith(".hydra/resumed-")
    assert evaluated.hydra.run.dir == run and evaluated.hydra.output_subdir.startswith(".hydra/eval-")
    assert plain.hydra.run.dir != run and plain.hydra.output_subdir == ".hydra"


def test_the_hydra_config_prints_resolved(tmp_path):
    """Hydra prints its own node without the job's keys, which the run folder's interpolations read."""
    argv = [sys.executable, "-m", "runner", "--cfg", "hydra", "--resolve"]
    proc = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "output_subdir: .hydra\n" in proc.stdout and "dir: outputs/" in proc.stdout


def test_a_run_folder_of_the_first_release_still_loads(tmp_path):
    """Its config.yaml names the schemas models.cnn.CNNConfig and data.digits.DigitsConfig (installed now as
    runner.models and runner.data), runner.optim.sgd.SGD and runner.hardware.cpu.CPU (now SGDConfig and
    CPUConfig), and has no task or schedule: resume= and eval= must still read it."""
    from runner.models.cnn import CNNConfig
    from runner.schedule.constant import ConstantConfig
    from runner.schema.config import load, schema_paths
    from runner.tasks.classification import ClassificationConfig

    cfg = _compose()
    old = OmegaConf.to_container(cfg, resolve=True)
    old["_schemas_"] = {
        **schema_paths(cfg),
        "model": "models.cnn.CNNConfig",
        "data": "data.digits.DigitsConfig",
        "optim": "runner.optim.sgd.SGD",  # before every schema was named <Name>Config
        "hardware": "runner.hardware.cpu.CPU",
    }
    for group in ("task", "schedule"):
        del old[group], old["_schemas_"][group]
    OmegaConf.save(old, tmp_path / "config.yaml")
    loaded = load(tmp_path / "config.yaml")
    assert type(loaded.model) is CNNConfig and type(loaded.data).__module__ == "runner.data.digits"
    assert isinstance(loaded.task, ClassificationConfig) and isinstance(loaded.schedule, ConstantConfig)
    assert (type(loaded.optim).__name__, type(loaded.hardware).__name__) == ("SGDConfig", "CPUConfig")


def test_a_rank_imports_no_hydra():
    """Hydra composes only in the launcher; a rank reads the written config with OmegaConf and the schemas,
    and importing Hydra would cost each rank's start about 0.1 s (benchmarks/README.md, start-up)."""
    code = "import sys, runner.rank.worker; print(sorted(m for m in sys.modules if m.startswith('hydra')))"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


def test_a_misspelt_argument_of_a_model_given_by_its_class_names_the_close_key_and_the_plus():
    from runner.launcher.explain import _unknown

    argv = ["hydra.searchpath=[file://examples/my_project/conf]", "model=blob_mlp", "model.hiden=32"]
    line = _unknown("model.hiden", argv)
    assert line is not None and line.startswith("model.hiden: no such key (did you mean model.hidden?)"), line
    assert "the keys of model are: inputs, outputs, hidden" in line and "+model.hiden=VALUE" in line
