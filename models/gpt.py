"""Decoder-only transformer language model in the layout of nanoGPT (github.com/karpathy/nanoGPT), which is
GPT-2's (Radford et al., "Language Models are Unsupervised Multitask Learners", 2019).

Inputs are LongTensors [batch, T] of token ids, T <= the context ``block_size``; the output is the logits
[batch, T, vocab_size] of the next token at every position (the task computes the loss). Each block is
pre-norm: LayerNorm, causal self-attention, residual; LayerNorm, MLP (4x wide, GELU), residual. The
output head shares its weight with the token embedding. Weights are drawn as GPT-2's: every Linear and
Embedding from N(0, 0.02), biases zero, and the projections that write into the residual stream (both
``c_proj``) from N(0, 0.02 / sqrt(2 n_layer)), so the stream's variance does not grow with depth. The
defaults are nanoGPT's CPU recipe for shakespeare_char; ``model=gpt2`` is GPT-2 small (124,439,808
parameters with its 50257 tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from runner.schema import ModelConfig, require


@dataclass
class GPTConfig(ModelConfig):
    input_shape: list[int] = field(default_factory=lambda: [64])  # [block]: the data's window
    num_classes: int = 65  # not used: the language-model data sets set it to the vocabulary size
    vocab_size: int | None = 65  # token ids 0 .. vocab_size - 1, from the data set (None: it has none)
    n_layer: int = 4  # transformer blocks
    n_head: int = 4  # attention heads; each is n_embd / n_head wide
    n_embd: int = 128  # width of the residual stream
    block_size: int | None = None  # longest context (position embeddings); None: the data's window
    dropout: float = 0.0  # after the embeddings, on the attention weights and on each residual branch
    bias: bool = False  # biases in the Linears and LayerNorms (GPT-2 has them)

    def __post_init__(self) -> None:
        super().__post_init__()
        require(
            self.vocab_size is not None,
            "vocab_size",
            self.vocab_size,
            "model=gpt reads token ids: use a text data set such as data=shakespeare_char or data=tokens "
            "(it sets the vocabulary), or set model.vocab_size; this data set has none",
        )
        require(
            len(self.input_shape) == 1,
            "input_shape",
            self.input_shape,
            "the GPT reads sequences of token ids, [block] (data.shape=[64]), not images",
        )
        require(self.vocab_size is None or self.vocab_size >= 1, "vocab_size", self.vocab_size, ">= 1")
        require(self.n_layer >= 1, "n_layer", self.n_layer, "number of transformer blocks, >= 1")
        require(self.n_head >= 1, "n_head", self.n_head, "number of attention heads, >= 1")
        require(self.n_embd >= 1, "n_embd", self.n_embd, "must be >= 1")
        require(
            self.n_embd % max(self.n_head, 1) == 0,
            "n_embd",
            self.n_embd,
            f"must be a multiple of model.n_head={self.n_head} (each head is n_embd / n_head wide)",
        )
        window = self.input_shape[0]
        require(
            self.block_size is None or self.block_size >= window,
            "block_size",
            self.block_size,
            f"shorter than the data's window, model.input_shape[0]={window} (from data.shape): set "
            f"model.block_size >= {window}, or null to take the window",
        )
        require(0 <= self.dropout < 1, "dropout", self.dropout, "must be in [0, 1)")

    def context(self) -> int:
        """The longest sequence the model reads: ``block_size``, or the data's window where it is None."""
        return self.input_shape[0] if self.block_size is None else self.block_size

    def build(self) -> nn.Module:
        return GPT(self)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.dropout = cfg.n_head, cfg.dropout
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)  # q, k and v of every head
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        heads = self.c_attn(x).view(b, t, 3, self.n_head, c // self.n_head)
        q, k, v = heads.permute(2, 0, 3, 1, 4)  # each [b, n_head, t, head size]
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_layer, self.n_embd, self.block_size = cfg.n_layer, cfg.n_embd, cfg.context()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(self.block_size, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        residual = 0.02 / math.sqrt(2 * cfg.n_layer)
        for block in self.h:
            for proj in (block.attn.c_proj, block.mlp.c_proj):
                nn.init.normal_(proj.weight, mean=0.0, std=residual)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(
                f"a sequence of {t} tokens is longer than model.block_size={self.block_size}: set "
                f"model.block_size >= {t}, or feed shorter windows"
            )
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, the tied embedding and head once; ``non_embedding`` leaves out the position
        embedding (the token embedding stays: it is also the head's weight), as nanoGPT counts."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.wpe.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int | None = None) -> int:
        """Training FLOPs (forward and backward) per token at context ``seq_len`` (default ``block_size``),
        as PaLM's appendix B (Chowdhery et al. 2022) and nanoGPT's ``estimate_mfu``:
        ``6 N + 12 n_layer n_embd T``, N = ``num_params(non_embedding=True)``: 6 FLOPs per weight and token
        for the matrix products, and the attention scores and their weighting of the values."""
        t = self.block_size if seq_len is None else seq_len
        return 6 * self.num_params() + 12 * self.n_layer * self.n_embd * t

    def no_weight_decay(self) -> set[str]:
        """Names of the parameters AdamW should not decay: the 1-D ones (biases, LayerNorm weights) and
        the position embedding; the token embedding, tied with the head, is decayed (as nanoGPT)."""
        return {name for name, p in self.named_parameters() if p.dim() < 2} | {"wpe.weight"}
