"""The model zoo: published parameter counts, forward and backward passes, and Hydra composition."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import fields

import pytest
import torch

from runner.models.alexnet import AlexNet, AlexNetConfig
from runner.models.cnn import CNN, CNNConfig
from runner.models.googlenet import GoogLeNet, GoogLeNetConfig
from runner.models.lstm import LSTMClassifier, LSTMConfig
from runner.models.mlp import MLP, MLPConfig
from runner.models.resnet import ResNet, ResNetConfig
from runner.models.vgg import VGG, VGGConfig
from runner.models.wide_resnet import WideResNet, WideResNetConfig
from runner.schema import ModelConfig, option_modules, schema_of
from tests.conftest import ROOT, checked_config

IMAGENET = [3, 224, 224]
#: Overrides for images that every image model accepts.
IMAGES = ["data=synthetic", "data.shape=[3,64,64]"]
#: Sequences of length 12 with a vocabulary, as data=text gives (without needing a file).
TOKENS = ["data=synthetic", "data.shape=[12]", "model.vocab_size=100"]

# Parameter counts for 1000 classes: the ``num_params`` of the ImageNet weights in torchvision's model
# documentation (pytorch.org/vision/stable/models.html); torchvision's GoogLeNet count leaves out the
# auxiliary heads. Wide ResNets on CIFAR-10 (10 classes): Zagoruyko & Komodakis (2016) report 36.5M for
# WRN-28-10 and 2.7M for WRN-16-4; the exact counts are those of the paper's official code
# (github.com/szagoruyko/wide-residual-networks, pytorch/resnet.py), which follow from its layer shapes.
ALEXNET = 61_100_840
GOOGLENET = 6_624_904
VGG16 = 138_357_544
VGG16_BN = 138_365_992
RESNET18 = 11_689_512
RESNET50 = 25_557_032
WRN_28_10 = 36_479_194
WRN_16_4 = 2_748_890

#: The ImageNet models' configs, by YAML option: (input_shape, num_classes) -> config.
CONFIGS: dict[str, Callable[[list[int], int], ModelConfig]] = {
    "alexnet": lambda shape, classes: AlexNetConfig(shape, classes),
    "googlenet": lambda shape, classes: GoogLeNetConfig(shape, classes),
    "vgg16": lambda shape, classes: VGGConfig(shape, classes, depth=16, batch_norm=False),
    "vgg16_bn": lambda shape, classes: VGGConfig(shape, classes, depth=16, batch_norm=True),
    "resnet18": lambda shape, classes: ResNetConfig(shape, classes, depth=18),
    "resnet50": lambda shape, classes: ResNetConfig(shape, classes, depth=50),
}
#: Too expensive for a quick run (VGG's 138M parameters, ResNet-50 at 224×224): ``-m "not slow"``.
SLOW = {"vgg16", "vgg16_bn", "resnet50"}


def _options(names: Iterable[str]) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in names]


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _forward_backward(model: torch.nn.Module, x: torch.Tensor, num_classes: int) -> None:
    model.train()
    logits = model(x)
    assert isinstance(logits, torch.Tensor) and logits.shape == (x.shape[0], num_classes)
    torch.nn.functional.cross_entropy(logits, torch.arange(x.shape[0]) % num_classes).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize(
    "cfg,expected",
    [
        (AlexNetConfig(IMAGENET, 1000), ALEXNET),
        (GoogLeNetConfig(IMAGENET, 1000), GOOGLENET),
        (VGGConfig(IMAGENET, 1000, depth=16, batch_norm=False), VGG16),
        (VGGConfig(IMAGENET, 1000, depth=16, batch_norm=True), VGG16_BN),
        (ResNetConfig(IMAGENET, 1000, depth=18), RESNET18),
        (ResNetConfig(IMAGENET, 1000, depth=50), RESNET50),
        (WideResNetConfig([3, 32, 32], 10, depth=28, widen_factor=10), WRN_28_10),
        (WideResNetConfig([3, 32, 32], 10, depth=16, widen_factor=4), WRN_16_4),
    ],
    ids=["alexnet", "googlenet", "vgg16", "vgg16_bn", "resnet18", "resnet50", "wrn-28-10", "wrn-16-4"],
)
def test_published_parameter_counts(cfg, expected):
    # On the meta device the parameters have their shapes but no storage: no time spent initialising.
    with torch.device("meta"):
        model = cfg.build()
    assert _count(model) == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_imagenet_models_train_at_224(name):
    """A full-size step (224×224, 1000 classes): seconds a model, so the slow tier. The fast tier keeps the
    same forward and backward at 64×64 (next test) and the 224×224 parameter counts (above); every head pools
    adaptively, so the input size changes no code path."""
    torch.manual_seed(0)
    _forward_backward(CONFIGS[name](IMAGENET, 1000).build(), torch.randn(1, *IMAGENET), 1000)


@pytest.mark.parametrize("name", _options(CONFIGS))
def test_imagenet_models_train_at_64(name):
    torch.manual_seed(0)
    _forward_backward(CONFIGS[name]([3, 64, 64], 10).build(), torch.randn(2, 3, 64, 64), 10)


@pytest.mark.parametrize("depth", [18, 50])
def test_resnet_keeps_its_stem_on_32x32(depth):
    torch.manual_seed(0)
    _forward_backward(ResNetConfig([3, 32, 32], 10, depth=depth).build(), torch.randn(2, 3, 32, 32), 10)


def test_googlenet_aux_heads_are_optional_and_forward_returns_main_logits():
    torch.manual_seed(0)
    model = GoogLeNet(GoogLeNetConfig([3, 64, 64], 10, aux_logits=True))
    assert _count(model) > _count(GoogLeNet(GoogLeNetConfig([3, 64, 64], 10)))
    x = torch.randn(2, 3, 64, 64)
    main, aux1, aux2 = model.forward_aux(x)
    assert main.shape == aux1.shape == aux2.shape == (2, 10)
    model.eval()
    torch.testing.assert_close(model(x), model.forward_aux(x)[0])
    assert GoogLeNet(GoogLeNetConfig([3, 64, 64], 10)).forward_aux(x)[1:] == (None, None)


def test_googlenet_draws_its_weights_as_torchvision_does():
    """Convolutions and linear layers from a normal of std 0.01 (torchvision's, truncated at ±2: 200
    standard deviations out), batch norms at one and zero."""
    torch.manual_seed(0)
    model = GoogLeNet(GoogLeNetConfig([3, 64, 64], 10))
    weights = torch.cat(
        [m.weight.flatten() for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
    )
    assert abs(weights.std().item() - 0.01) < 2e-4 and abs(weights.mean().item()) < 2e-4
    assert weights.abs().max().item() < 2
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(bool((m.weight == 1).all() and (m.bias == 0).all()) for m in norms)


def test_too_small_images_name_the_key():
    with pytest.raises(ValueError, match=r"input_shape=\[3, 32, 32\] is invalid: AlexNet(Config)? needs"):
        AlexNetConfig([3, 32, 32], 10)
    with pytest.raises(ValueError, match=r"input_shape=\[3, 16, 16\] is invalid: VGG(Config)? needs"):
        VGGConfig([3, 16, 16], 10)
    with pytest.raises(ValueError, match=r"input_shape=\[3, 14, 14\] is invalid: GoogLeNet(Config)? needs"):
        GoogLeNetConfig([3, 14, 14], 10)
    with pytest.raises(ValueError, match=r"input_shape=\[1, 1, 1\] is invalid: CNN(Config)? needs"):
        CNNConfig([1, 1, 1], 10)
    with pytest.raises(ValueError, match=r"input_shape=\[64\] is invalid: ResNet expects \[C, H, W\]"):
        ResNetConfig([64], 10)


@pytest.mark.parametrize(
    "cfg,shape",
    [
        (AlexNetConfig, [3, 63, 63]),
        pytest.param(VGGConfig, [3, 32, 32], marks=pytest.mark.slow),
        (GoogLeNetConfig, [3, 15, 15]),
        (CNNConfig, [1, 2, 2]),
        (lambda shape, classes: ResNetConfig(shape, classes, depth=18), [1, 1, 1]),
        (WideResNetConfig, [2, 1, 1]),
    ],
    ids=["alexnet", "vgg", "googlenet", "cnn", "resnet18", "wide_resnet"],
)
def test_smallest_allowed_images_run(cfg, shape):
    model = cfg(shape, 10).build()
    _forward_backward(model, torch.randn(2, *shape), 10)


@pytest.mark.parametrize(
    "cfg,size", [(AlexNetConfig, 63), (GoogLeNetConfig, 15), (CNNConfig, 2), (VGGConfig, 32)]
)
def test_one_pixel_less_than_the_minimum_fails_in_torch(cfg, size):
    """The limits are tight: one pixel less empties a feature map (the config refuses it first)."""
    with pytest.raises(ValueError, match=f"needs height and width >= {size}"):
        cfg([3, size - 1, size - 1], 10)
    if cfg is VGGConfig:  # 138M parameters: the pools alone show it
        model = torch.nn.Sequential(*[torch.nn.MaxPool2d(2) for _ in range(5)])
    else:
        model = cfg([3, size, size], 10).build()
    model.eval()
    with pytest.raises(RuntimeError):
        model(torch.randn(1, 3, size - 1, size - 1))


def test_lstm_needs_token_sequences_from_text_data(tmp_path):
    with pytest.raises(ValueError, match=r"model\.vocab_size=null is invalid: model=lstm reads token ids"):
        checked_config(["model=lstm"])  # digits: images, no vocabulary
    with pytest.raises(ValueError, match=r"model\.vocab_size=null .*use data=text"):
        checked_config(["model=lstm", "data=synthetic", "data.shape=[12]"])
    with pytest.raises(
        ValueError, match=r"model\.input_shape=\[3, 8, 8\] is invalid: the LSTM reads sequences"
    ):
        checked_config(["model=lstm", "data=synthetic", "data.shape=[3,8,8]", "model.vocab_size=100"])
    train = tmp_path / "train.tsv"
    train.write_text("pos\tgood film\nneg\tbad film\n")
    with pytest.raises(ValueError, match=r"model\.input_shape=\[64\] is invalid: CNN expects \[C, H, W\]"):
        checked_config(["model=cnn", "data=text", f"data.train_file={train}"])


@pytest.mark.parametrize("depth,widen", [(16, 4), pytest.param(28, 10, marks=pytest.mark.slow)])
def test_wide_resnet_trains_on_32x32(depth, widen):
    torch.manual_seed(0)
    model = WideResNetConfig([3, 32, 32], 10, depth=depth, widen_factor=widen, dropout=0.3).build()
    _forward_backward(model, torch.randn(2, 3, 32, 32), 10)


def test_cnn_and_mlp_train_and_keep_their_parameter_names():
    torch.manual_seed(0)
    cnn = CNNConfig([1, 8, 8], 10).build()
    assert type(cnn) is CNN and isinstance(cnn, torch.nn.Module)
    assert {"features.0.weight", "features.1.running_mean", "classifier.weight"} <= cnn.state_dict().keys()
    _forward_backward(cnn, torch.randn(4, 1, 8, 8), 10)
    plain = CNN(CNNConfig([3, 16, 16], 5, width=8, batch_norm=False))
    # Without BatchNorm the convolutions have biases: conv(3→8), conv(8→16), conv(16→16), linear(16→5).
    assert _count(plain) == (9 * 3 * 8 + 8) + (9 * 8 * 16 + 16) + (9 * 16 * 16 + 16) + (16 * 5 + 5)
    mlp = MLPConfig([1, 8, 8], 10, hidden=[32, 16], dropout=0.1).build()
    assert type(mlp) is MLP
    weights = [k for k in mlp.state_dict() if k.endswith("weight")]
    assert weights == ["net.1.weight", "net.4.weight", "net.7.weight"]
    assert _count(mlp) == (64 * 32 + 32) + (32 * 16 + 16) + (16 * 10 + 10)
    _forward_backward(mlp, torch.randn(4, 1, 8, 8), 10)


@pytest.mark.parametrize("module", ["runner.models.cnn", "runner.models.mlp"])
def test_default_models_import_without_torch(module):
    # In a fresh interpreter: this one has torch loaded already.
    code = f"import sys, {module}; print(sorted({{'torch', 'numpy'}} & set(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "[]"


def test_each_model_module_has_one_schema_with_valid_defaults():
    for module in option_modules("model"):
        cls = schema_of("model", module)
        assert cls.__module__ == f"runner.models.{module}" and cls.__name__.endswith("Config")
        assert "_target_" not in {f.name for f in fields(cls)}
        cls()  # the defaults pass the checks


def _tokens() -> torch.Tensor:
    """[4, 12] token ids, right-padded with 0; one row with a 0 inside, one row of padding only."""
    x = torch.randint(1, 100, (4, 12))
    x[0, 5:] = 0
    x[1, 3] = 0
    x[2, 9:] = 0
    x[3, :] = 0
    return x


@pytest.mark.parametrize("bidirectional,num_layers,dropout", [(False, 1, 0.0), (True, 2, 0.2)])
def test_lstm_trains_and_ignores_trailing_padding(bidirectional, num_layers, dropout):
    torch.manual_seed(0)
    model = LSTMConfig(
        [12], 5, vocab_size=100, num_layers=num_layers, bidirectional=bidirectional, dropout=dropout
    ).build()
    # Embedding + (4 gate matrices on input and hidden, two biases) per layer and direction + classifier.
    d = 2 if bidirectional else 1
    lstm = sum(4 * 128 * ((128 if i == 0 else 128 * d) + 128 + 2) * d for i in range(num_layers))
    assert _count(model) == 100 * 128 + lstm + (128 * d + 1) * 5
    x = _tokens()
    assert LSTMClassifier.lengths(x).tolist() == [5, 12, 9, 1]
    _forward_backward(model, x, 5)
    model.eval()
    with torch.no_grad():
        padded = torch.cat([x, torch.zeros(4, 6, dtype=torch.long)], dim=1)
        torch.testing.assert_close(model(padded), model(x))
        torch.testing.assert_close(model(x[:1, :5]), model(x)[:1])


@pytest.mark.parametrize(
    "option,cls,shape",
    [
        ("cnn", CNN, [3, 16, 16]),
        ("mlp", MLP, [3, 16, 16]),
        ("alexnet", AlexNet, [3, 64, 64]),
        ("googlenet", GoogLeNet, [3, 64, 64]),
        pytest.param("vgg16", VGG, [3, 64, 64], marks=pytest.mark.slow),
        pytest.param("vgg16_bn", VGG, [3, 64, 64], marks=pytest.mark.slow),
        ("resnet18", ResNet, [3, 32, 32]),
        ("resnet50", ResNet, [3, 32, 32]),
        ("wide_resnet", WideResNet, [3, 32, 32]),
    ],
)
def test_yaml_option_composes_validates_and_builds(option, cls, shape):
    checked = checked_config(
        [f"model={option}", "data=synthetic", f"data.shape=[{','.join(map(str, shape))}]"]
    ).model
    assert checked.input_shape == shape and checked.num_classes == 10
    model = checked.build()
    assert type(model) is cls
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, *shape)).shape == (1, 10)


def test_yaml_defaults():
    checked = checked_config(["model=wide_resnet", "data=synthetic"]).model
    assert (checked.depth, checked.widen_factor) == (16, 4)
    assert checked_config(["model=vgg16_bn", "data=synthetic"]).model.batch_norm is True
    assert checked_config(["model=vgg16", "data=synthetic"]).model.batch_norm is False
    assert checked_config(["model=resnet50"]).model.depth == 50
    assert checked_config(["model=resnet18"]).model.depth == 18
    assert checked_config().model == CNNConfig([1, 8, 8], 10, width=32, batch_norm=True)


def test_lstm_reads_its_vocabulary_and_length_from_the_text_data(tmp_path):
    train = tmp_path / "train.tsv"
    train.write_text("pos\tgood film\nneg\tbad film\n")
    checked = checked_config(
        ["model=lstm", "data=text", f"data.train_file={train}", "data.vocab_size=500", "data.shape=[12]"]
    ).model
    assert (checked.vocab_size, checked.input_shape, checked.num_classes) == (500, [12], 2)


def test_lstm_builds_directly():
    model = LSTMClassifier(LSTMConfig([12], num_classes=3, vocab_size=100))
    assert model.embedding.num_embeddings == 100 and model.classifier.out_features == 3


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["model=vgg16", "model.depth=12", *IMAGES], "model.depth"),
        (["model=resnet18", "model.depth=20", *IMAGES], "model.depth"),
        (["model=wide_resnet", "model.depth=20", *IMAGES], "model.depth"),
        (["model=wide_resnet", "model.widen_factor=0", *IMAGES], "model.widen_factor"),
        (["model=alexnet", "model.dropout=1.0", *IMAGES], "model.dropout"),
        (["model=googlenet", "model.dropout=-0.1", *IMAGES], "model.dropout"),
        (["model=lstm", *TOKENS, "model.dropout=0.5"], "model.dropout"),
        (["model=lstm", *TOKENS, "model.vocab_size=1"], "model.vocab_size"),
        (["model=cnn", "model.width=0"], "model.width"),
        (["model=mlp", "model.hidden=[16,0]"], "model.hidden"),
        (["model=alexnet", "data=synthetic", "data.shape=[3,32,32]"], "model.input_shape"),
        (["model=googlenet"], "model.input_shape"),  # digits: 8×8
    ],
)
def test_bad_model_values_name_their_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        checked_config(overrides)
