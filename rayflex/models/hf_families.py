"""The Hugging Face families rayflex splits into blocks: names, key mapping, sizes (torch-free).

:mod:`rayflex.models.hf` builds the blocks (torch, transformers); this module holds what
needs neither: which ``model_type`` is which family, how a rayflex state-dict key
(``blocks.{i}.<name inside the block>``) maps to Hugging Face's and back, and a model's
size from its ``config.json`` values, which the capacity planner reads from
``ModelSpec.metadata["hf"]["size"]`` (:func:`hf_size_of`) without importing torch.

The blocks are HF's own modules, so a name inside a block is HF's key with its container
prefix taken off:

=======================  =====================================  ===================================
rayflex                  Llama / Qwen2 / Qwen3 / Mistral        GPT-2
=======================  =====================================  ===================================
``blocks.0.<p>``         ``model.embed_tokens.<p>``             ``transformer.wte.<p>``, ``.wpe.<p>``
``blocks.{i}.<p>``       ``model.layers.{i-1}.<p>``             ``transformer.h.{i-1}.<p>``
``blocks.{L+1}.<p>``     ``model.norm.<p>``, ``lm_head.<p>``    ``transformer.ln_f.<p>``, ``lm_head.<p>``
=======================  =====================================  ===================================
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any, Optional

from rayflex.errors import ConfigError


@dataclass(frozen=True, kw_only=True)
class HFFamily:
    """One row of the family table: where HF keeps each part and which classes build it."""

    name: str
    model_types: tuple[str, ...]
    architecture: str  # the ...ForCausalLM class an exported config names
    module: str  # the transformers modeling module
    decoder_layer: str  # class name in ``module``
    rotary: Optional[str]  # rotary embedding class (None: learned positions)
    final_norm_class: Optional[str]  # None: torch's nn.LayerNorm
    base: str  # prefix of the base model's keys ("model", "transformer")
    layers: str  # the decoder layers' ModuleList under ``base``
    embeddings: tuple[str, ...]  # modules of block 0 under ``base``
    final_norm: str  # under ``base``
    lm_head: str = "lm_head"
    # Where a layer's sliding window comes from: "attention" (its ``sliding_window``
    # attribute, set per layer type), "config" (``config.sliding_window`` for every layer)
    # or None (no sliding window).
    sliding_window: Optional[str] = None
    # Checkpoint keys HF itself ignores on load (old buffers saved by earlier versions).
    ignored_keys: tuple[str, ...] = ()

    def ignores(self, hf_key: str) -> bool:
        return any(re.search(p, hf_key) for p in self.ignored_keys)


_ROPE = dict(base="model", layers="layers", embeddings=("embed_tokens",), final_norm="norm",
             ignored_keys=(r"rotary_emb\.(original_)?inv_freq$",))

FAMILIES: dict[str, HFFamily] = {f.name: f for f in (
    HFFamily(name="llama", model_types=("llama",), architecture="LlamaForCausalLM",
             module="transformers.models.llama.modeling_llama", decoder_layer="LlamaDecoderLayer",
             rotary="LlamaRotaryEmbedding", final_norm_class="LlamaRMSNorm", **_ROPE),
    HFFamily(name="qwen2", model_types=("qwen2",), architecture="Qwen2ForCausalLM",
             module="transformers.models.qwen2.modeling_qwen2", decoder_layer="Qwen2DecoderLayer",
             rotary="Qwen2RotaryEmbedding", final_norm_class="Qwen2RMSNorm", sliding_window="attention", **_ROPE),
    HFFamily(name="qwen3", model_types=("qwen3",), architecture="Qwen3ForCausalLM",
             module="transformers.models.qwen3.modeling_qwen3", decoder_layer="Qwen3DecoderLayer",
             rotary="Qwen3RotaryEmbedding", final_norm_class="Qwen3RMSNorm", sliding_window="attention", **_ROPE),
    HFFamily(name="mistral", model_types=("mistral",), architecture="MistralForCausalLM",
             module="transformers.models.mistral.modeling_mistral", decoder_layer="MistralDecoderLayer",
             rotary="MistralRotaryEmbedding", final_norm_class="MistralRMSNorm", sliding_window="config", **_ROPE),
    HFFamily(name="gpt2", model_types=("gpt2",), architecture="GPT2LMHeadModel",
             module="transformers.models.gpt2.modeling_gpt2", decoder_layer="GPT2Block", rotary=None,
             final_norm_class=None, base="transformer", layers="h", embeddings=("wte", "wpe"), final_norm="ln_f",
             ignored_keys=(r"\.attn\.(masked_)?bias$",)),
)}

_BY_MODEL_TYPE = {t: f for f in FAMILIES.values() for t in f.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def family_of(model_type: str) -> HFFamily:
    """The family of a config's ``model_type``; ConfigError naming the supported ones."""
    family = _BY_MODEL_TYPE.get(model_type)
    if family is None:
        raise ConfigError("causal_lm(config)", f"model_type {model_type!r} is not supported (supported: "
                          f"{', '.join(supported_model_types())})",
                          "use a decoder-only model of a supported family, or write a ModelSpec for it "
                          "(rayflex.models.spec.ModelSpec: an ordered list of blocks plus a loss)")
    return family


# ------------------------------------------------------------------------------ keys
def _family_and_layers(spec) -> tuple[HFFamily, int]:
    hf = (getattr(spec, "metadata", None) or {}).get("hf")
    if not hf:
        raise ConfigError("spec", f"model {getattr(spec, 'name', spec)!r} was not made by "
                          "rayflex.models.hf.causal_lm (its metadata has no 'hf' entry)",
                          "map keys of models made by causal_lm")
    return FAMILIES[hf["family"]], spec.num_blocks - 2


def hf_key_of(family: HFFamily, n_layers: int, index: int, name: str) -> str:
    """HF's key of parameter ``name`` of block ``index`` (a model of ``n_layers`` layers)."""
    if index == 0:
        return f"{family.base}.{name}"
    if index <= n_layers:
        return f"{family.base}.{family.layers}.{index - 1}.{name}"
    if name.startswith(family.lm_head + "."):
        return name
    return f"{family.base}.{name}"


def block_key_of(family: HFFamily, n_layers: int, hf_key: str) -> Optional[tuple[int, str]]:
    """(block index, name inside the block) of an HF key; None if no block holds it.
    Keys of a base model saved alone (no ``model.`` / ``transformer.`` prefix, as GPT-2's
    original checkpoints) are accepted too."""
    if hf_key.startswith(family.lm_head + "."):
        return n_layers + 1, hf_key
    name = hf_key.removeprefix(family.base + ".")
    m = re.fullmatch(rf"{re.escape(family.layers)}\.(\d+)\.(.+)", name)
    if m is not None:
        return (int(m.group(1)) + 1, m.group(2)) if int(m.group(1)) < n_layers else None
    head = name.split(".")[0]
    if head in family.embeddings:
        return 0, name
    if head == family.final_norm:
        return n_layers + 1, name
    return None


def to_hf_key(spec, rayflex_key: str) -> str:
    """``blocks.3.self_attn.q_proj.weight`` -> ``model.layers.2.self_attn.q_proj.weight``
    (``spec``: a ModelSpec made by :func:`rayflex.models.hf.causal_lm`, or its summary)."""
    family, n_layers = _family_and_layers(spec)
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", rayflex_key)
    if m is None or int(m.group(1)) > n_layers + 1:
        raise ConfigError("to_hf_key", f"{rayflex_key!r} is not a key of this model's blocks "
                          f"(blocks.0 .. blocks.{n_layers + 1})", "pass a key of the spec's state dict")
    return hf_key_of(family, n_layers, int(m.group(1)), m.group(2))


def from_hf_key(spec, hf_key: str) -> str:
    """``model.layers.2.self_attn.q_proj.weight`` -> ``blocks.3.self_attn.q_proj.weight``."""
    family, n_layers = _family_and_layers(spec)
    found = block_key_of(family, n_layers, hf_key)
    if found is None:
        raise ConfigError("from_hf_key", f"{hf_key!r} is not a key of a {family.name} model with {n_layers} "
                          "layers", "pass a key of the Hugging Face model this spec was made from")
    return f"blocks.{found[0]}.{found[1]}"


# ------------------------------------------------------------------------------ sizes
@dataclass(frozen=True, kw_only=True)
class HFSize:
    """A model's shape as the planners need it (from ``config.json``; no torch)."""

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    max_positions: int
    learned_positions: bool  # GPT-2's wpe (block 0) instead of rotary embeddings
    gated_mlp: bool  # gate/up/down (SwiGLU) instead of fc/proj
    layer_norm: bool  # LayerNorm (weight + bias) instead of RMSNorm (weight)
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool  # Qwen3: an RMSNorm over head_dim on q and on k
    activation: str = ""

    @property
    def q_width(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    def _norm(self, width: int) -> int:
        return (2 if self.layer_norm else 1) * width

    def embedding_params(self) -> int:
        return (self.vocab_size + (self.max_positions if self.learned_positions else 0)) * self.hidden_size

    def layer_params(self) -> int:
        h, q, kv, f = self.hidden_size, self.q_width, self.kv_width, self.intermediate_size
        attn = h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.qkv_bias + h * self.o_bias
        if self.qk_norm:
            attn += 2 * self._norm(self.head_dim)
        mats = 3 if self.gated_mlp else 2
        mlp = mats * h * f + ((mats - 1) * f + h) * self.mlp_bias
        return attn + mlp + 2 * self._norm(h)

    def head_params(self) -> int:
        return self._norm(self.hidden_size) + self.vocab_size * self.hidden_size  # untied, no bias

    def block_params(self) -> list[int]:
        return [self.embedding_params()] + [self.layer_params()] * self.num_layers + [self.head_params()]

    def to_dict(self) -> dict:
        return asdict(self)


def size_of_config(family: HFFamily, cfg: dict[str, Any]) -> HFSize:
    """An :class:`HFSize` from a config's ``to_dict()`` values."""
    if family.name == "gpt2":
        h = cfg["n_embd"]
        return HFSize(family="gpt2", vocab_size=cfg["vocab_size"], hidden_size=h, num_layers=cfg["n_layer"],
                      num_heads=cfg["n_head"], num_kv_heads=cfg["n_head"], head_dim=h // cfg["n_head"],
                      intermediate_size=cfg.get("n_inner") or 4 * h, max_positions=cfg["n_positions"],
                      learned_positions=True, gated_mlp=False, layer_norm=True, qkv_bias=True, o_bias=True,
                      mlp_bias=True, qk_norm=False, activation=cfg.get("activation_function", ""))
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    bias = bool(cfg.get("attention_bias", False))
    qkv_bias, o_bias = {"qwen2": (True, False), "mistral": (False, False)}.get(family.name, (bias, bias))
    return HFSize(family=family.name, vocab_size=cfg["vocab_size"], hidden_size=h, num_layers=cfg["num_hidden_layers"],
                  num_heads=heads, num_kv_heads=cfg.get("num_key_value_heads") or heads,
                  head_dim=cfg.get("head_dim") or h // heads, intermediate_size=cfg["intermediate_size"],
                  max_positions=cfg.get("max_position_embeddings", 0), learned_positions=False, gated_mlp=True,
                  layer_norm=False, qkv_bias=qkv_bias, o_bias=o_bias,
                  mlp_bias=bool(cfg.get("mlp_bias", False)) and family.name == "llama",
                  qk_norm=family.name == "qwen3", activation=cfg.get("hidden_act", ""))


def hf_size_of(model) -> Optional[HFSize]:
    """The HFSize of a model made by :func:`rayflex.models.hf.causal_lm` (a ModelSpec or
    its ModelSummary), else None."""
    hf = (getattr(model, "metadata", None) or {}).get("hf") or {}
    size = hf.get("size")
    return HFSize(**size) if size else None
