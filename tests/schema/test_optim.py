"""Optimizers (``optim=``): Adam and AdamW compose, build torch's class with the given arguments, keep
torch's defaults, and refuse bad values naming the key."""

from __future__ import annotations

import inspect

import pytest
import torch

from runner.optim.adam import AdamConfig
from runner.optim.adamw import AdamWConfig
from tests.conftest import checked_config

OPTIONS = [("adam", AdamConfig, torch.optim.Adam), ("adamw", AdamWConfig, torch.optim.AdamW)]


@pytest.mark.parametrize("option,schema,cls", OPTIONS)
def test_defaults_are_torchs(option, schema, cls):
    cfg = checked_config([f"optim={option}"]).optim
    assert type(cfg) is schema
    defaults = {k: p.default for k, p in inspect.signature(cls.__init__).parameters.items()}
    for key, value in cfg.arguments().items():
        assert value == defaults[key], key


@pytest.mark.parametrize("option,schema,cls", OPTIONS)
def test_builds_torchs_class_with_the_arguments(option, schema, cls):
    overrides = ["optim.lr=0.01", "optim.betas=[0.8,0.99]", "optim.eps=1e-6", "optim.weight_decay=0.1"]
    cfg = checked_config([f"optim={option}", *overrides, "optim.amsgrad=true"]).optim
    model = torch.nn.Linear(3, 2)
    opt = cfg.build(model.parameters())
    assert type(opt) is cls
    group = opt.param_groups[0]
    assert group["params"] == list(model.parameters())
    assert (group["lr"], group["betas"], group["eps"]) == (0.01, (0.8, 0.99), 1e-6)
    assert (group["weight_decay"], group["amsgrad"]) == (0.1, True)


@pytest.mark.parametrize("option,schema,cls", OPTIONS)
def test_a_step_is_torchs_step(option, schema, cls):
    """The built optimizer moves the parameters as torch's own with the same arguments."""
    torch.manual_seed(0)
    ours, ref = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    ref.load_state_dict(ours.state_dict())
    before = ours.weight.detach().clone()
    kwargs = {"lr": 0.05, "betas": (0.7, 0.9), "weight_decay": 0.2}
    opts = [schema(lr=0.05, betas=[0.7, 0.9], weight_decay=0.2).build(ours.parameters())]
    opts.append(cls(ref.parameters(), **kwargs))
    x = torch.randn(8, 4)
    for _ in range(3):
        for model, opt in zip((ours, ref), opts, strict=True):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    assert not torch.equal(ours.weight, before)
    for a, b in zip(ours.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("option", ["adam", "adamw"])
@pytest.mark.parametrize(
    "override,message",
    [
        ("optim.lr=-0.001", "optim.lr=-0.001 is invalid"),
        ("optim.lr=nan", "optim.lr=nan is invalid"),
        ("optim.betas=[0.9,1.0]", r"optim.betas=\[0.9, 1.0\] is invalid"),
        ("optim.betas=[-0.1,0.9]", r"optim.betas=\[-0.1, 0.9\] is invalid"),
        ("optim.betas=[0.9]", r"optim.betas=\[0.9\] is invalid"),
        ("optim.eps=0", "optim.eps=0.0 is invalid"),
        ("optim.weight_decay=-0.1", "optim.weight_decay=-0.1 is invalid"),
        ("+optim.momentum=0.9", "optim.momentum: not an option of Adam"),
    ],
)
def test_bad_values_are_refused_naming_the_key(option, override, message):
    with pytest.raises(ValueError, match=message):
        checked_config([f"optim={option}", override])


class _Tiny(torch.nn.Module):
    """A weight matrix, a bias, a norm, a position table it names in ``no_weight_decay`` and a tied head."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(5, 4)
        self.pos = torch.nn.Embedding(3, 4)
        self.norm = torch.nn.LayerNorm(4)
        self.proj = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight

    def no_weight_decay(self):
        return {"pos.weight"}


@pytest.mark.parametrize("option", ["adam", "adamw"])
def test_decay_on_matrices_only_leaves_biases_norms_and_named_tables_alone(option):
    cfg = checked_config([f"optim={option}", "optim.weight_decay=0.1", "optim.decay=matrices"]).optim
    model = _Tiny()
    opt = cfg.build(cfg.params(model))
    decayed, kept = opt.param_groups
    assert (decayed["weight_decay"], kept["weight_decay"]) == (0.1, 0.0)
    ids = lambda ps: {id(p) for p in ps}  # noqa: E731
    assert ids(decayed["params"]) == ids([model.embed.weight, model.proj.weight])  # the tied head: once
    assert ids(kept["params"]) == ids([model.pos.weight, model.norm.weight, model.norm.bias, model.proj.bias])
    assert "decay" not in opt.defaults  # not an argument of torch's optimizer
    # a step with no gradient: the kept group is untouched, the decayed one shrinks by lr·wd (AdamW)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.step()
    after = dict(model.named_parameters())
    assert torch.equal(after["pos.weight"], before["pos.weight"])
    assert torch.equal(after["norm.weight"], before["norm.weight"])
    if option == "adamw":
        lr = cfg.lr
        assert torch.allclose(after["proj.weight"], before["proj.weight"] * (1 - lr * 0.1))


def test_decay_all_is_one_group_and_a_bad_value_is_named():
    cfg = checked_config(["optim=adamw"]).optim
    assert cfg.decay == "all" and len(cfg.build(cfg.params(_Tiny())).param_groups) == 1
    with pytest.raises(ValueError, match=r"optim\.decay='weights' is invalid: choose one of all, matrices"):
        checked_config(["optim=adamw", "optim.decay=weights"])
