"""A small GPT written as blocks: embedding, N transformer blocks, head.

Sized by :class:`GPTConfig` so tests run in seconds on CPU and the same code describes a
real model for the planners.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn

from rayflex.models.gpt_config import GPTConfig
from rayflex.models.spec import ModelSpec


class Embedding(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tok(tokens) + self.pos(positions)


class TransformerBlock(nn.Module):
    """Pre-norm causal self-attention + MLP.

    The fused ``qkv`` projection's output features are grouped by head (``[h0: q k v][h1:
    q k v]...``) and heads are viewed by their fixed size, so a tensor-parallel split of
    ``qkv`` by output rows (:data:`TP_PLAN`) hands each rank whole heads, q, k and v
    together; with fewer local heads the same code runs unchanged.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.out = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)
        # GPT-2 style: scale residual projections down with depth.
        for lin in (self.proj, self.out):
            nn.init.normal_(lin.weight, std=0.02 / math.sqrt(2 * cfg.n_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, -1, 3, self.head_dim)  # -1: the heads this rank holds
        q, k, v = (z.transpose(1, 2) for z in qkv.unbind(dim=3))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, -1))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.d_model)
        self.lm = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.lm.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(self.ln(x))


def build_gpt_block(cfg: GPTConfig, index: int) -> nn.Module:
    if index == 0:
        return Embedding(cfg)
    if index == cfg.n_layers + 1:
        return Head(cfg)
    return TransformerBlock(cfg)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the microbatch."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# Megatron's split: q/k/v and the MLP's up-projection by output features, the attention
# and MLP out-projections by input features (one all-reduce after each), the token
# embedding and the head by vocabulary; norms and positions replicated.
TP_PLAN = {"first": {"tok": "rowwise_replicated_input"},
           "inner": {"qkv": "colwise", "proj": "rowwise", "fc": "colwise", "out": "rowwise"},
           "last": {"lm": "colwise_gather_output"}}


def gpt(cfg: GPTConfig | None = None, **sizes) -> ModelSpec:
    """A GPT as a :class:`ModelSpec`: ``n_layers + 2`` blocks (embedding, layers, head),
    splittable over tensor-parallel ranks by :data:`TP_PLAN`."""
    from rayflex.models.tp_plan import tp_metadata

    cfg = cfg or GPTConfig(**sizes)
    tp = tp_metadata(**TP_PLAN, divides={"attention heads": cfg.n_heads, "MLP width": cfg.mlp_ratio * cfg.d_model,
                                         "vocabulary": cfg.vocab_size})
    return ModelSpec(name=f"gpt-{cfg.n_layers}x{cfg.d_model}", num_blocks=cfg.n_layers + 2,
                     build_block=functools.partial(build_gpt_block, cfg), loss_fn=lm_loss,
                     hidden_size=cfg.d_model, vocab_size=cfg.vocab_size, metadata={"tp": tp})
