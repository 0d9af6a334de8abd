"""The tensor-parallel part of the model contract: how a model says its blocks split.

A model that can be split over ``tp`` ranks carries, in ``ModelSpec.metadata["tp"]``,

* ``"plan"``: ``{"first": {path: style}, "inner": {...}, "last": {...}}``, the styles of
  the submodules (paths relative to the block) of block 0, of every block between, and of
  the last block (with pp the first and last blocks are still the model's, whatever the
  stage holding them);
* ``"divides"``: ``{"attention heads": 8, "MLP width": 2048, ...}``, the sizes ``tp`` must
  divide (checked torch-free by :func:`rayflex.mesh.rules.tp_problem` before anything
  starts).

A model without ``metadata["tp"]`` declares it cannot be split (``{"unsupported": why}``
says why in the error). Plain strings, so the spec stays JSON-able and the planners read
it without torch. The styles (torch's ``parallelize_module`` does the work):

* ``colwise``: ``ColwiseParallel``, output features split (q/k/v, MLP up/gate). The block's
  code must view heads by a fixed head size (local heads = heads / tp), never by a head
  count taken from the config.
* ``rowwise``: ``RowwiseParallel``, input features split, output summed over the tp group
  (attention out-projection, MLP down): Megatron's two all-reduces per block.
* ``colwise_gather_output``: the LM head, vocabulary split and the logits gathered, so any
  loss (and the pipeline's last stage) sees whole logits.
* ``rowwise_replicated_input``: a token embedding, vocabulary split; each rank looks up the
  ids it holds and the outputs are summed.
* ``replicated_with_grad_allreduce``: the weight stays whole on each rank but sees only
  that rank's heads (Qwen3's per-head q/k norms): its gradient is summed over the tp group
  after backward (:func:`sum_replicated_grads`; a tensor hook would not survive
  ``fully_shard`` replacing the parameter).

Everything outside the plan (norms, position embeddings) is replicated: its inputs are the
same on every tp rank, so are its gradients.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_replicated_input",
          "replicated_with_grad_allreduce")
GRAD_SUMMED = "replicated_with_grad_allreduce"


def tp_metadata(*, first: dict[str, str], inner: dict[str, str], last: dict[str, str],
                divides: dict[str, int]) -> dict:
    """``metadata["tp"]`` for a model: a plan per block position and the sizes tp divides."""
    for part in (first, inner, last):
        unknown = sorted({s for s in part.values() if s not in STYLES})
        if unknown:
            from rayflex.errors import ConfigError

            raise ConfigError("tensor-parallel plan", f"unknown styles {unknown}", f"use {', '.join(STYLES)}")
    return {"plan": {"first": dict(first), "inner": dict(inner), "last": dict(last)},
            "divides": {k: int(v) for k, v in divides.items()}}


def block_plan(metadata: Optional[dict], index: int, num_blocks: int) -> dict[str, str]:
    """The styles of block ``index``'s submodules ({} when the block is not split)."""
    plan = ((metadata or {}).get("tp") or {}).get("plan") or {}
    where = "first" if index == 0 else "last" if index == num_blocks - 1 else "inner"
    return dict(plan.get(where) or {})


def _style(name: str):
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"colwise": lambda: ColwiseParallel(),
            "rowwise": lambda: RowwiseParallel(),
            "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
            "rowwise_replicated_input": lambda: RowwiseParallel(input_layouts=Replicate())}[name]()


def apply_tp(block: nn.Module, plan: dict[str, str], tp_mesh) -> list[nn.Parameter]:
    """Split ``block`` over the 1-D mesh ``tp_mesh`` by ``plan`` (in place).

    Works on the meta device too (shapes only): the worker splits the meta build, shards it
    with FSDP, and only then materialises this rank's slices. Returns the parameters whose
    gradients :func:`sum_replicated_grads` must sum over the tp group; take them after
    ``fully_shard`` (:func:`grad_summed_params`), which replaces parameter objects.
    """
    from torch.distributed.tensor.parallel import parallelize_module

    split = {path: _style(s) for path, s in plan.items() if s != GRAD_SUMMED}
    if split:
        parallelize_module(block, tp_mesh, split)
    return grad_summed_params(block, plan)


def grad_summed_params(block: nn.Module, plan: dict[str, str]) -> list[nn.Parameter]:
    """The (current) parameters of the ``replicated_with_grad_allreduce`` submodules."""
    return [p for path, s in plan.items() if s == GRAD_SUMMED for p in block.get_submodule(path).parameters()]


@torch.no_grad()
def sum_replicated_grads(params: list[nn.Parameter], tp_group: Any) -> None:
    """Sum the gradients of ``replicated_with_grad_allreduce`` parameters over the tp group.

    Each tp rank's gradient covers only its own heads; the sum is the full gradient. After
    FSDP's reduce-scatter the local gradient is this rank's dp shard, the same shard on
    every rank of the tp group, so summing the shards is summing the whole (the sum is
    linear). Device tensors on the tp group (a device group: NCCL on GPU)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    for p in params:
        if p.grad is None:
            continue
        g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(g, group=tp_group)
