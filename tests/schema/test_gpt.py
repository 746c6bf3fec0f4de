"""The GPT language model (models/gpt.py): causality, parameter counts, tied weights, initialization, the
config's checks and its YAML options, the FLOP estimate, weight-decay groups, and a short training run."""

from __future__ import annotations

import math

import pytest
import torch

from runner.models.gpt import GPT, GPTConfig
from tests.conftest import checked_config

#: Token windows of 12 with a vocabulary of 100, without a language-model data set.
TOKENS = ["data=synthetic", "data.shape=[12]", "model.vocab_size=100"]
GPT2_SMALL = 124_439_808  # with the position embedding; nanoGPT prints 123.65M, which leaves it out


def _small(**kw) -> GPTConfig:
    settings = {"vocab_size": 50, "n_layer": 2, "n_head": 2, "n_embd": 32} | kw
    return GPTConfig([16], 50, **settings)


def _count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _formula(vocab: int, block: int, layers: int, d: int, bias: bool) -> int:
    """Token and position embeddings; per block ln_1 (d), c_attn (3d² + 3d), attn.c_proj (d² + d), ln_2
    (d), c_fc (4d² + 4d), mlp.c_proj (4d² + d), the terms in d alone only with biases but the LayerNorms'
    weights; the final LayerNorm; the head is the token embedding."""
    ln = 2 * d if bias else d
    block_ = ln + (3 * d * d + 3 * d * bias) + (d * d + d * bias) + ln + (4 * d * d + 4 * d * bias)
    block_ += 4 * d * d + d * bias
    assert block_ == 12 * d * d + (13 * d if bias else 2 * d)
    return vocab * d + block * d + layers * block_ + ln


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("vocab,block,layers,heads,d", [(50, 16, 2, 2, 32), (65, 64, 4, 4, 128)])
def test_parameter_count_matches_the_closed_formula(vocab, block, layers, heads, d, bias):
    with torch.device("meta"):
        model = GPTConfig([block], vocab, vocab, layers, heads, d, bias=bias).build()
    expected = _formula(vocab, block, layers, d, bias)
    assert _count(model) == model.num_params(non_embedding=False) == expected
    assert model.num_params() == expected - block * d


def test_gpt2_preset_has_124m_parameters():
    checked = checked_config(["model=gpt2", "data=synthetic", "data.shape=[1024]", "model.vocab_size=50257"])
    cfg = checked.model
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.block_size, cfg.bias, cfg.dropout) == (
        12, 12, 768, 1024, True, 0.0
    )  # fmt: skip
    with torch.device("meta"):
        model = cfg.build()
    assert type(model) is GPT and model.wpe.num_embeddings == 1024
    assert _count(model) == model.num_params(non_embedding=False) == GPT2_SMALL
    assert _formula(50257, 1024, 12, 768, True) == GPT2_SMALL
    assert model.num_params() == GPT2_SMALL - 1024 * 768


def test_outputs_depend_only_on_earlier_tokens():
    torch.manual_seed(0)
    model = _small().build().eval()
    x = torch.randint(0, 50, (3, 16))
    with torch.no_grad():
        base = model(x)
        assert base.shape == (3, 16, 50)
        for t in (0, 3, 7, 14):
            changed = x.clone()
            changed[:, t + 1 :] = (x[:, t + 1 :] + torch.randint(1, 50, (3, 15 - t))) % 50
            out = model(changed)
            assert torch.equal(out[:, : t + 1], base[:, : t + 1])
            assert not torch.allclose(out[:, t + 1], base[:, t + 1])  # the change is seen where it may be


def test_head_is_tied_to_the_token_embedding():
    model = _small().build()
    assert model.lm_head.weight is model.wte.weight
    assert sum(p is model.wte.weight for p in model.parameters()) == 1
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names
    x = torch.randint(0, 50, (2, 16))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    assert model.wte.weight.grad is not None and model.lm_head.weight.grad is model.wte.weight.grad


def test_weights_are_drawn_as_gpt2_s():
    torch.manual_seed(0)
    layers = 4
    model = GPTConfig([64], 1000, 1000, n_layer=layers, n_head=4, n_embd=256, bias=True).build()
    residual = torch.cat([p.flatten() for n, p in model.named_parameters() if n.endswith("c_proj.weight")])
    others = torch.cat(
        [m.weight.flatten() for n, m in model.named_modules() if n.endswith(("c_attn", "c_fc"))]
    )
    for values, std in [
        (model.wte.weight, 0.02),
        (model.wpe.weight, 0.02),
        (others, 0.02),
        (residual, 0.02 / math.sqrt(2 * layers)),
    ]:
        assert abs(values.std().item() / std - 1) < 0.02 and abs(values.mean().item()) < 0.02 * std * 5
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    assert len(biases) == 6 * layers + 1 and all(bool((b == 0).all()) for b in biases)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    assert len(norms) == 2 * layers + 1 and all(bool((m.weight == 1).all()) for m in norms)


def test_flops_per_token_is_palm_s_estimate():
    model = _small().build()
    n = _formula(50, 16, 2, 32, False) - 16 * 32
    assert model.flops_per_token() == 6 * n + 12 * 2 * 32 * 16
    assert model.flops_per_token(seq_len=8) == 6 * n + 12 * 2 * 32 * 8


@pytest.mark.parametrize("bias", [False, True])
def test_no_weight_decay_names_the_1d_parameters_and_the_position_embedding(bias):
    model = _small(bias=bias).build()
    norms = ["ln_f", *(f"h.{i}.{ln}" for i in range(2) for ln in ("ln_1", "ln_2"))]
    expected = {"wpe.weight"} | {f"{m}.weight" for m in norms}
    if bias:
        linears = (
            f"h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
        )
        expected |= {f"{m}.bias" for m in norms} | {f"{m}.bias" for m in linears}
    assert model.no_weight_decay() == expected
    decayed = {n for n, _ in model.named_parameters()} - expected
    assert "wte.weight" in decayed and all(p.dim() == 2 for n, p in model.named_parameters() if n in decayed)


def test_block_size_is_the_window_or_at_least_it():
    assert _small().build().wpe.num_embeddings == 16
    model = _small(block_size=32).build()
    assert model.wpe.num_embeddings == 32 and model(torch.randint(0, 50, (1, 32))).shape == (1, 32, 50)
    with pytest.raises(ValueError, match=r"block_size=8 is invalid: .*model\.input_shape\[0\]=16"):
        _small(block_size=8)
    with pytest.raises(ValueError, match=r"33 tokens is longer than model\.block_size=32"):
        model(torch.randint(0, 50, (1, 33)))
    with pytest.raises(ValueError, match=r"model\.block_size=8 is invalid: .*model\.input_shape\[0\]=12"):
        checked_config(["model=gpt", *TOKENS, "model.block_size=8"])


def test_yaml_option_needs_a_vocabulary_then_composes_and_builds():
    with pytest.raises(ValueError, match=r"model\.vocab_size=null is invalid: .*data=shakespeare_char"):
        checked_config(["model=gpt", "data=synthetic", "data.shape=[12]"])
    with pytest.raises(ValueError, match=r"vocab_size=null is invalid: .*or set model\.vocab_size"):
        GPTConfig([12], 10, vocab_size=None)
    cfg = checked_config(["model=gpt", *TOKENS]).model
    assert cfg == GPTConfig([12], 10, vocab_size=100)  # the class's defaults: nanoGPT's CPU recipe
    assert (cfg.n_layer, cfg.n_head, cfg.n_embd, cfg.dropout, cfg.bias) == (4, 4, 128, 0.0, False)
    model = cfg.build().eval()
    assert type(model) is GPT and model.block_size == 12
    with torch.no_grad():
        assert model(torch.randint(0, 100, (2, 12))).shape == (2, 12, 100)


@pytest.mark.parametrize(
    "override,key",
    [
        ("model.n_head=3", "model.n_embd"),
        ("model.n_layer=0", "model.n_layer"),
        ("model.n_embd=0", "model.n_embd"),
        ("model.dropout=1.0", "model.dropout"),
        ("model.vocab_size=0", "model.vocab_size"),
        ("data.shape=[3,8,8]", "model.input_shape"),
    ],
)
def test_bad_values_name_their_key(override, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + "=.* is invalid"):
        checked_config(["model=gpt", *TOKENS, override])


def test_dropout_and_bias_train():
    torch.manual_seed(0)
    model = _small(dropout=0.2, bias=True).build().train()
    x = torch.randint(0, 50, (2, 16))
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_learns_a_repeating_pattern():
    """Sixty AdamW steps on windows of a period-7 pattern, next token as target: the loss falls from about
    ln(vocab) to a few thousandths (a hundredth of ln(vocab) is a wide margin)."""
    torch.manual_seed(0)
    model = _small(vocab_size=10, n_embd=32).build().train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    pattern = torch.tensor([5, 2, 8, 0, 7, 3, 9] * 4)
    losses = []
    for _ in range(60):
        starts = torch.randint(0, 7, (8,))
        windows = torch.stack([pattern[s : s + 17] for s in starts.tolist()])
        x, y = windows[:, :-1], windows[:, 1:]
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[0] > 2.0 and losses[-1] < losses[0] / 100
