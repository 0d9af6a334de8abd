"""The one workload both trainers of the GPU kit run (torch-free, so the CPU test reads it).

A Llama-3-style model of torchtitan's ``llama3`` "1B" flavour (Llama 3.2 1B: 16 layers,
d 2048, 32 heads, 8 KV heads, FFN 8192, vocabulary 128,256, RoPE theta 500,000) with
**untied** embeddings on both sides: rayflex trains tied embeddings untied (its blocks
are built apart), so torchtitan's weight tying is switched off too and both step the same
1.50B parameters. Same sequence length, global batch, AdamW (fused; lr, betas, eps,
weight decay, clip), bf16 compute with fp32 reduce and master weights, ``torch.compile``
per block, no activation checkpointing, causal attention by each trainer's own kernel
(rayflex's HF blocks: SDPA; torchtitan 0.3, which dropped SDPA: FlexAttention).

One FLOP formula for both (:data:`FLOP_FORMULA`): per token ``6 * N_matmul + 12 * L * d *
seq_len``, ``N_matmul`` the parameters of every linear layer including the output head
(the embedding lookup multiplies nothing), the second term the attention scores and
their weighted sum, forward and backward, without halving for causality: torchtitan's
convention, so its own MFU figures compare.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

FLOP_FORMULA = ("6 * N_matmul + 12 * n_layers * dim * seq_len per token; N_matmul = parameters of every linear "
                "incl. the output head (embeddings excluded); attention not halved for causality (torchtitan's "
                "convention)")


@dataclass(frozen=True)
class Workload:
    name: str
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_hidden: int
    vocab_size: int
    seq_len: int
    global_batch: int
    steps: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    lr: float = 3e-4
    warmup_steps: int = 2
    betas: tuple = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    param_dtype: str = "bf16"
    reduce_dtype: str = "fp32"
    compile: bool = True
    activation_checkpointing: str = "none"
    attention: str = "sdpa"  # rayflex's HF blocks; torchtitan uses its own default kernel (flex)
    tied_embeddings: bool = False
    seed: int = 0

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def matmul_params(self) -> int:
        """Parameters of every linear layer: q, k, v, o, the three FFN matrices, the head."""
        kv = self.n_kv_heads * self.head_dim
        per_layer = self.dim * (self.dim + 2 * kv) + self.dim * self.dim + 3 * self.dim * self.ffn_hidden
        return self.n_layers * per_layer + self.dim * self.vocab_size

    def params(self) -> int:
        """Every parameter of the untied model: linears, embedding, RMSNorm weights."""
        return self.matmul_params() + self.vocab_size * self.dim + (2 * self.n_layers + 1) * self.dim

    def flops_per_token(self) -> int:
        return 6 * self.matmul_params() + 12 * self.n_layers * self.dim * self.seq_len

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "params": self.params(), "matmul_params": self.matmul_params(),
                "tokens_per_step": self.tokens_per_step, "flops_per_token": self.flops_per_token(),
                "flop_formula": FLOP_FORMULA}


def llama3_1b(*, seq_len: int = 2048, global_batch: int = 4, steps: int = 12) -> Workload:
    """torchtitan's llama3 "1B" flavour, untied (see the module's docstring)."""
    return Workload(name="llama3-1B-untied", dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_hidden=8192,
                    vocab_size=128256, seq_len=seq_len, global_batch=global_batch, steps=steps)


def tiny(*, steps: int = 6) -> Workload:
    """The CPU mode's shape: the same code paths in seconds (fp32, no compile: CPU bf16
    matmuls are slow and inductor needs a C++ compiler)."""
    return Workload(name="llama-tiny", dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128,
                    vocab_size=256, seq_len=32, global_batch=4, steps=steps, param_dtype="fp32", compile=False)


def hf_llama_config(w: Workload) -> dict:
    """The ``transformers.LlamaConfig`` keyword arguments of ``w`` (rayflex's HF path)."""
    return {"vocab_size": w.vocab_size, "hidden_size": w.dim, "intermediate_size": w.ffn_hidden,
            "num_hidden_layers": w.n_layers, "num_attention_heads": w.n_heads, "num_key_value_heads": w.n_kv_heads,
            "max_position_embeddings": max(w.seq_len, 2048), "rms_norm_eps": w.norm_eps, "rope_theta": w.rope_theta,
            "tie_word_embeddings": w.tied_embeddings, "attention_bias": False, "mlp_bias": False}


def titan_settings(w: Workload) -> dict:
    """What the torchtitan run sets, in torchtitan's names (``gpu_kit_titan.py`` builds its
    ``Trainer.Config`` from exactly this; the CPU test checks it against rayflex's run)."""
    dtypes = {"bf16": "bfloat16", "fp32": "float32"}
    return {
        "model": {"flavor": "1B" if w.dim == 2048 and w.n_layers == 16 else "kit", "dim": w.dim,
                  "n_layers": w.n_layers, "n_heads": w.n_heads, "n_kv_heads": w.n_kv_heads,
                  "ffn_hidden": w.ffn_hidden, "vocab_size": w.vocab_size, "rope_theta": w.rope_theta,
                  "norm_eps": w.norm_eps, "enable_weight_tying": w.tied_embeddings,
                  # torchtitan 0.3 dropped SDPA for language models: its default, FlexAttention
                  "attn_backend": "flex"},
        "training": {"local_batch_size": w.global_batch, "global_batch_size": w.global_batch,
                     "seq_len": w.seq_len, "steps": w.steps, "max_norm": w.grad_clip, "dtype": "float32",
                     "mixed_precision_param": dtypes[w.param_dtype],
                     "mixed_precision_reduce": dtypes[w.reduce_dtype]},
        "optimizer": {"name": "AdamW", "implementation": "fused", "lr": w.lr, "betas": list(w.betas), "eps": w.eps,
                      "weight_decay": w.weight_decay},
        "lr_scheduler": {"warmup_steps": w.warmup_steps},
        "compile": {"enable": w.compile, "components": ["model", "loss"] if w.compile else []},
        "activation_checkpoint": None if w.activation_checkpointing == "none" else w.activation_checkpointing,
        "metrics": {"log_freq": 1},
    }


def rayflex_settings(w: Workload, *, float8: bool = False) -> dict:
    """What the rayflex run sets, in the same terms as :func:`titan_settings`."""
    return {"model": hf_llama_config(w), "seq_len": w.seq_len, "global_batch": w.global_batch, "steps": w.steps,
            "optimizer": {"implementation": "fused", "lr": w.lr, "betas": list(w.betas), "weight_decay": w.weight_decay,
                          "warmup_steps": w.warmup_steps, "grad_clip": w.grad_clip},
            "precision": {"param_dtype": w.param_dtype, "reduce_dtype": w.reduce_dtype, "float8": float8},
            "memory": {"activation_checkpointing": w.activation_checkpointing, "compile": w.compile}}
