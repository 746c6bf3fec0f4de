"""The model zoo: published parameter counts, forward and backward passes, and Hydra composition."""

from __future__ import annotations

import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.utils import instantiate

import runner.config  # noqa: F401
from models.alexnet import AlexNet
from models.googlenet import GoogLeNet
from models.lstm import LSTMClassifier
from models.resnet import ResNet
from models.vgg import VGG
from models.wide_resnet import WideResNet
from runner.config import validate
from tests.conftest import CONF

IMAGENET = [3, 224, 224]

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

BUILDERS = {
    "alexnet": lambda shape, classes: AlexNet(shape, classes),
    "googlenet": lambda shape, classes: GoogLeNet(shape, classes),
    "vgg16": lambda shape, classes: VGG(shape, classes, depth=16, batch_norm=False),
    "vgg16_bn": lambda shape, classes: VGG(shape, classes, depth=16, batch_norm=True),
    "resnet18": lambda shape, classes: ResNet(shape, classes, depth=18),
    "resnet50": lambda shape, classes: ResNet(shape, classes, depth=50),
}


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
    "build,expected",
    [
        (lambda: AlexNet(IMAGENET, 1000), ALEXNET),
        (lambda: GoogLeNet(IMAGENET, 1000), GOOGLENET),
        (lambda: VGG(IMAGENET, 1000, depth=16, batch_norm=False), VGG16),
        (lambda: VGG(IMAGENET, 1000, depth=16, batch_norm=True), VGG16_BN),
        (lambda: ResNet(IMAGENET, 1000, depth=18), RESNET18),
        (lambda: ResNet(IMAGENET, 1000, depth=50), RESNET50),
        (lambda: WideResNet([3, 32, 32], 10, depth=28, widen_factor=10), WRN_28_10),
        (lambda: WideResNet([3, 32, 32], 10, depth=16, widen_factor=4), WRN_16_4),
    ],
    ids=["alexnet", "googlenet", "vgg16", "vgg16_bn", "resnet18", "resnet50", "wrn-28-10", "wrn-16-4"],
)
def test_published_parameter_counts(build, expected):
    # On the meta device the parameters have their shapes but no storage: no time spent initialising.
    with torch.device("meta"):
        model = build()
    assert _count(model) == expected


@pytest.mark.parametrize("name", list(BUILDERS))
def test_imagenet_models_train_at_224(name):
    torch.manual_seed(0)
    _forward_backward(BUILDERS[name](IMAGENET, 1000), torch.randn(1, *IMAGENET), 1000)


@pytest.mark.parametrize("name", list(BUILDERS))
def test_imagenet_models_train_at_64(name):
    torch.manual_seed(0)
    _forward_backward(BUILDERS[name]([3, 64, 64], 10), torch.randn(2, 3, 64, 64), 10)


@pytest.mark.parametrize("depth", [18, 50])
def test_resnet_keeps_its_stem_on_32x32(depth):
    torch.manual_seed(0)
    _forward_backward(ResNet([3, 32, 32], 10, depth=depth), torch.randn(2, 3, 32, 32), 10)


def test_googlenet_aux_heads_are_optional_and_forward_returns_main_logits():
    torch.manual_seed(0)
    model = GoogLeNet([3, 64, 64], 10, aux_logits=True)
    assert _count(model) > _count(GoogLeNet([3, 64, 64], 10))
    x = torch.randn(2, 3, 64, 64)
    main, aux1, aux2 = model.forward_aux(x)
    assert main.shape == aux1.shape == aux2.shape == (2, 10)
    model.eval()
    torch.testing.assert_close(model(x), model.forward_aux(x)[0])
    assert GoogLeNet([3, 64, 64], 10).forward_aux(x)[1:] == (None, None)


def test_too_small_images_name_the_key():
    with pytest.raises(ValueError, match=r"input_shape=\[3, 32, 32\] is invalid: AlexNet needs"):
        AlexNet([3, 32, 32], 10)
    with pytest.raises(ValueError, match=r"input_shape=\[3, 16, 16\] is invalid: VGG needs"):
        VGG([3, 16, 16], 10)


@pytest.mark.parametrize("depth,widen", [(16, 4), (28, 10)])
def test_wide_resnet_trains_on_32x32(depth, widen):
    torch.manual_seed(0)
    model = WideResNet([3, 32, 32], 10, depth=depth, widen_factor=widen, dropout=0.3)
    _forward_backward(model, torch.randn(2, 3, 32, 32), 10)


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
    model = LSTMClassifier(
        [12], 5, vocab_size=100, num_layers=num_layers, bidirectional=bidirectional, dropout=dropout
    )
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


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize(
    "option,cls,shape",
    [
        ("alexnet", AlexNet, [3, 64, 64]),
        ("googlenet", GoogLeNet, [3, 64, 64]),
        ("vgg16", VGG, [3, 64, 64]),
        ("vgg16_bn", VGG, [3, 64, 64]),
        ("resnet18", ResNet, [3, 32, 32]),
        ("resnet50", ResNet, [3, 32, 32]),
        ("wide_resnet", WideResNet, [3, 32, 32]),
    ],
)
def test_yaml_option_composes_validates_and_instantiates(option, cls, shape):
    cfg = _compose(f"model={option}", "data=synthetic", f"data.shape=[{','.join(map(str, shape))}]")
    checked = validate(cfg)
    assert checked.model.input_shape == shape and checked.model.num_classes == 10
    model = instantiate(cfg.model)
    assert type(model) is cls
    model.eval()
    with torch.no_grad():
        assert model(torch.randn(1, *shape)).shape == (1, 10)


def test_yaml_defaults():
    checked = validate(_compose("model=wide_resnet", "data=synthetic")).model
    assert (checked.depth, checked.widen_factor) == (16, 4)
    assert validate(_compose("model=vgg16_bn")).model.batch_norm is True
    assert validate(_compose("model=resnet50")).model.depth == 50
    # Without a text data set, vocab_size falls back to the default of oc.select.
    assert validate(_compose("model=lstm")).model.vocab_size == 10000


def test_lstm_instantiates_directly():
    # No Hydra composition: the `text` data config (with `vocab_size`) will come from the data pipeline work;
    # test_config.py still composes and validates conf/model/lstm.yaml with the default data set.
    model = LSTMClassifier([12], num_classes=3, vocab_size=100)
    assert model.embedding.num_embeddings == 100 and model.classifier.out_features == 3


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["model=vgg16", "model.depth=12"], "model.depth"),
        (["model=resnet18", "model.depth=20"], "model.depth"),
        (["model=wide_resnet", "model.depth=20"], "model.depth"),
        (["model=wide_resnet", "model.widen_factor=0"], "model.widen_factor"),
        (["model=alexnet", "model.dropout=1.0"], "model.dropout"),
        (["model=googlenet", "model.dropout=-0.1"], "model.dropout"),
        (["model=lstm", "model.dropout=0.5"], "model.dropout"),
        (["model=lstm", "model.vocab_size=1"], "model.vocab_size"),
    ],
)
def test_bad_model_values_name_their_key(overrides, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        validate(_compose(*overrides))
