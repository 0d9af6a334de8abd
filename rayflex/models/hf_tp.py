"""A Hugging Face model's tensor-parallel plan, from the plan transformers ships.

Every supported family but GPT-2 carries a tensor-parallel plan in its config class
(``LlamaConfig.base_model_tp_plan``: ``layers.*.self_attn.q_proj -> colwise`` ...).
:func:`hf_tp_metadata` turns it into rayflex's model contract (``metadata["tp"]``,
:mod:`rayflex.models.tp_plan`): the decoder-layer part, ``layers.*.`` taken off, for every
decoder block; the token embedding split by vocabulary (block 0) and the LM head split by
vocabulary with its logits gathered (the last block). HF's attention views heads as
``(..., -1, head_dim)``, so a rank's local tensors are just fewer heads; grouped-query
attention keeps its ratio as long as ``tp`` divides the key/value heads. Qwen3's per-head
q/k norms (``replicated_with_grad_allreduce``) stay whole, their gradient summed over tp.
"""

from __future__ import annotations

from typing import Optional

from rayflex.models.tp_plan import STYLES, tp_metadata


def decoder_plan_of(layer_plan: dict[str, str] | None) -> dict[str, str]:
    """``base_model_tp_plan`` (keys ``layers.*.<path>``) -> ``{<path>: style}`` for one
    decoder layer; entries outside the layers (an embedding plan) are left out."""
    out = {}
    for key, style in (layer_plan or {}).items():
        if key.startswith("layers.*."):
            out[key[len("layers.*."):]] = style
    return out


def hf_tp_metadata(family: str, layer_plan: dict[str, str] | None, size: dict,
                   embedding: str = "embed_tokens") -> dict:
    """``metadata["tp"]`` of an HF causal LM: transformers' decoder plan, the embedding and
    the head; ``{"unsupported": why}`` when the family has no plan or uses styles rayflex
    does not apply."""
    inner = decoder_plan_of(layer_plan)
    if not inner:
        return {"unsupported": f"transformers ships no tensor-parallel plan for {family} (GPT-2's fused qkv "
                               "Conv1D cannot be split by columns as is)"}
    unknown = sorted({s for s in inner.values() if s not in STYLES})
    if unknown:
        return {"unsupported": f"its plan uses styles rayflex does not apply: {', '.join(unknown)}"}
    return tp_metadata(first={embedding: "rowwise_replicated_input"}, inner=inner,
                       last={"lm_head": "colwise_gather_output"},
                       divides={"attention heads": size["num_heads"], "key/value heads": size["num_kv_heads"],
                                "MLP width (intermediate_size)": size["intermediate_size"],
                                "vocabulary": size["vocab_size"]})


def tp_plan(spec) -> Optional[dict[str, str]]:
    """The decoder blocks' plan of a spec (None when the model cannot be split)."""
    plan = ((getattr(spec, "metadata", None) or {}).get("tp") or {}).get("plan")
    return dict(plan["inner"]) if plan else None
