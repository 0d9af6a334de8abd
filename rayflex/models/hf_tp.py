"""Tensor parallelism inside a Hugging Face decoder block, from the plan transformers ships.

Every supported family but GPT-2 carries a tensor-parallel plan in its config class
(``LlamaConfig.base_model_tp_plan``: ``layers.*.self_attn.q_proj -> colwise`` ...).
:func:`rayflex.models.hf.causal_lm` keeps the decoder-layer part of it, with the
``layers.*.`` prefix taken off, in ``spec.metadata["hf"]["tp_plan"]``, so the torch-free
planners can see whether a model can be split over ``tp`` ranks at all
(:func:`check_tp`); :func:`apply_tp` applies it to one decoder block with torch's
``parallelize_module``:

* ``colwise`` (q/k/v, gate/up): ``ColwiseParallel``, each rank computing its own heads /
  its slice of the MLP's width. HF's attention views heads as ``(..., -1, head_dim)``,
  so a rank's local tensors are just fewer heads; grouped-query attention keeps its
  ratio as long as ``tp`` divides the key/value heads.
* ``rowwise`` (o_proj, down_proj): ``RowwiseParallel``, whose output is summed over the
  tp group (one all-reduce after attention, one after the MLP, as in Megatron).
* ``replicated_with_grad_allreduce`` (Qwen3's per-head q/k norms): the weight stays whole
  on every rank, but each rank only sees its own heads, so its gradient is summed over
  the tp group by a hook.

The embedding and the head (blocks 0 and L+1) are not split here: a vocabulary-sharded
head needs a loss that knows it (``loss_parallel``), which is the 3-D parallelism work's.
"""

from __future__ import annotations

from typing import Any

from rayflex.errors import ConfigError

STYLES = ("colwise", "rowwise", "replicated_with_grad_allreduce")


def decoder_plan_of(layer_plan: dict[str, str] | None) -> dict[str, str]:
    """``base_model_tp_plan`` (keys ``layers.*.<path>``) -> ``{<path>: style}`` for one
    decoder layer; entries outside the layers (an embedding plan) are left out."""
    out = {}
    for key, style in (layer_plan or {}).items():
        if key.startswith("layers.*."):
            out[key[len("layers.*."):]] = style
    return out


def tp_plan(spec) -> dict[str, str]:
    """The decoder blocks' plan of a :func:`rayflex.models.hf.causal_lm` spec (or its
    summary); ConfigError when the model has none."""
    hf = (getattr(spec, "metadata", None) or {}).get("hf") or {}
    plan = hf.get("tp_plan")
    if not plan:
        family = hf.get("family", getattr(spec, "name", "this model"))
        raise ConfigError("tensor parallelism", f"{family} has no tensor-parallel plan (transformers ships none "
                          "for it: GPT-2's fused qkv Conv1D cannot be split by columns as is)",
                          "use tp=1 for this model, or a Llama / Qwen2 / Qwen3 / Mistral model")
    unknown = sorted({s for s in plan.values() if s not in STYLES})
    if unknown:
        raise ConfigError("tensor parallelism", f"the plan uses styles rayflex does not apply: {', '.join(unknown)}",
                          f"supported styles: {', '.join(STYLES)}")
    return dict(plan)


def check_tp(spec, tp: int) -> None:
    """ConfigError unless the decoder blocks split evenly over ``tp`` ranks: a plan, and
    ``tp`` dividing the attention heads, the key/value heads and the MLP width."""
    if tp == 1:
        return
    tp_plan(spec)
    size = spec.metadata["hf"]["size"]
    for what, n in (("attention heads", size["num_heads"]), ("key/value heads", size["num_kv_heads"]),
                    ("MLP width (intermediate_size)", size["intermediate_size"])):
        if n % tp:
            raise ConfigError("tensor parallelism", f"tp={tp} does not divide the {what} ({n})",
                              f"pick a tp that divides {n}")


def apply_tp(block, spec, tp_mesh) -> Any:
    """Split one decoder block over the 1-D device mesh ``tp_mesh`` (in place; returns it).

    Every rank of the mesh must hold the same weights (the seeded build or the loaded
    checkpoint gives them); afterwards each keeps its shards as DTensors."""
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    check_tp(spec, tp_mesh.size())
    plan = tp_plan(spec)
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    parallelize_module(block, tp_mesh, {path: styles[s]() for path, s in plan.items() if s in styles})
    group = tp_mesh.get_group()
    for path, style in plan.items():
        if style != "replicated_with_grad_allreduce":
            continue
        for param in block.get_submodule(path).parameters():
            param.register_hook(lambda grad: funcol.all_reduce(grad, "sum", group))
    return block
