"""Recipes (``recipe=``): complete set-ups over the whole config, each option overridable after it."""

from __future__ import annotations

import pytest

from runner.data.shakespeare_char import ShakespeareCharConfig
from runner.models.gpt import GPTConfig
from runner.optim.adamw import AdamWConfig
from runner.schedule.cosine import CosineConfig
from runner.tasks.language_model import LanguageModelConfig
from tests.conftest import CONF, ROOT, checked_config

SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare"
RECIPES = sorted(p.stem for p in (CONF / "recipe").glob("*.yaml"))
needs_corpus = pytest.mark.skipif(
    not (SHAKESPEARE / "input.txt").is_file(), reason=f"no {SHAKESPEARE / 'input.txt'} (../shared/data)"
)


def recipe(name: str, *overrides: str):
    return checked_config([f"recipe={name}", f"data.root={SHAKESPEARE}", *overrides])


@needs_corpus
@pytest.mark.parametrize("name", RECIPES)
def test_every_recipe_composes_and_validates(name):
    assert recipe(name).train.max_steps is not None


@needs_corpus
def test_shakespeare_char_is_nanogpts_cpu_recipe():
    cfg = recipe("shakespeare_char")
    assert isinstance(cfg.model, GPTConfig) and isinstance(cfg.data, ShakespeareCharConfig)
    assert isinstance(cfg.task, LanguageModelConfig)
    m = cfg.model
    assert (m.n_layer, m.n_head, m.n_embd, m.dropout, m.bias, m.vocab_size) == (4, 4, 128, 0.0, False, 65)
    assert cfg.data.block_size == 64 and m.input_shape == [64] and cfg.devices == 1
    t = cfg.train
    assert (t.batch_size, t.max_steps, t.grad_clip) == (12, 2000, 1.0)
    assert isinstance(cfg.optim, AdamWConfig) and isinstance(cfg.schedule, CosineConfig)
    o, s = cfg.optim, cfg.schedule
    assert (o.lr, o.betas, o.weight_decay, o.decay) == (1e-3, [0.9, 0.99], 0.1, "matrices")
    assert (s.warmup_steps, s.min_factor) == (100, 0.1)
    # nanoGPT's rates: 0 at the start, lr at the warm-up's end, a tenth at step 2000
    assert s.factor(0, 2000) == 0 and s.factor(100, 2000) == 1 and s.factor(2000, 2000) == pytest.approx(0.1)


@needs_corpus
def test_the_command_line_overrides_a_recipe():
    cfg = recipe("shakespeare_char", "devices=4", "optim.lr=0.002", "rule=diloco", "model.n_layer=2")
    assert (cfg.devices, cfg.optim.lr, type(cfg.rule).__name__, cfg.model.n_layer) == (
        4,
        0.002,
        "DiLoCoConfig",
        2,
    )
    assert cfg.model.n_head == 4  # the recipe's other keys stay


def test_no_recipe_by_default():
    assert checked_config([]).model.__class__.__name__ == "CNNConfig"


@needs_corpus
def test_a_key_of_a_swept_recipe_s_option_names_the_group_to_give_with_it():
    """Hydra composes a sweep's config once without its swept values (there: digits), so ``data.root`` of a
    swept recipe's data set is refused; the line says which group to give with it, not 'did you mean'."""
    from runner.launcher.explain import explain

    argv = ["-m", "recipe=shakespeare_char_bsp,shakespeare_char_diloco", f"data.root={SHAKESPEARE}"]
    err = ValueError("Could not override 'data.root'.\nKey 'root' not in 'DigitsConfig'")
    line = explain(err, argv)
    assert line.startswith("data.root: not a key of the config before the sweep's values are applied"), line
    assert "(data=shakespeare_char data.root=...)" in line and "recipe=..." in line
    # not for a key the first point does not have either: the other explanations
    other = explain(
        ValueError("Could not override 'rule.inner_steps'."), ["-m", "rule=bsp,diloco", "rule.inner_steps=5"]
    )
    assert "not an option of BSPConfig" in other, other


def test_an_option_that_lacks_a_key_the_recipe_sets_is_named_with_the_fix():
    """``recipe=shakespeare_char optim=sgd``: the recipe sets optim.betas (AdamW's), which SGD lacks; Hydra
    says only 'ConfigKeyError raised while composing config'."""
    from runner.launcher.explain import explain

    text = (
        "In 'recipe/shakespeare_char': ConfigKeyError raised while composing config:\n"
        "Key 'betas' not in 'SGDConfig'\n    full_key: optim.betas\n    object_type=SGDConfig"
    )
    line = explain(ValueError(text), ["recipe=shakespeare_char", "optim=sgd"])
    assert line.startswith(
        "recipe=shakespeare_char sets optim.betas, which optim=sgd (SGDConfig) does not have"
    ), line
    assert "leave out recipe=shakespeare_char" in line and "\n" not in line
