"""Parallelizing a rank's model: device mesh, tensor parallelism, FSDP2 sharding, pipeline
schedules, grad norm.

The mesh itself (ranks, stages, batch arithmetic) is :class:`rayflex.mesh.plan.MeshPlan`.
Per stage the steps compose in torchtitan's order, each per block: float8 linears
(:mod:`rayflex.worker.float8`), tensor parallelism
(the model's plan, :mod:`rayflex.models.tp_plan`, over the mesh's ``tp`` dim), activation
checkpointing, ``torch.compile``, then ``fully_shard`` over the data-parallel dims (with
the mixed-precision policy): one dim for FSDP, ``(dp_replicate, dp_shard)`` for HSDP.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rayflex.config import MemoryConfig, PrecisionConfig
from rayflex.mesh.plan import MESH_DIMS, MeshPlan
from rayflex.models.spec import ModelSpec, Stage, build_stage
from rayflex.models.tp_plan import apply_tp, block_plan, grad_summed_params

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_device_mesh(plan: MeshPlan, device_type: str):
    """The attempt's DeviceMesh, dims :data:`MESH_DIMS` in the MeshPlan's rank order."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device_type, plan.shape, mesh_dim_names=MESH_DIMS)


def data_parallel_mesh(mesh, plan: MeshPlan, replicas_by_fsdp: bool = True):
    """The mesh ``fully_shard`` takes: 2-D ``(dp_replicate, dp_shard)`` for HSDP (FSDP2
    replicates over the first dim and shards over the second), else the 1-D shard dim.
    ``replicas_by_fsdp=False``: the 1-D shard dim whatever the replicas, which rayflex then
    keeps in step itself (``CommConfig.replicate``: int8 gradients or DiLoCo)."""
    if plan.dp_replicate > 1 and replicas_by_fsdp:
        return mesh["dp_replicate", "dp_shard"]
    return mesh["dp_shard"]


def apply_tensor_parallel(stage: Stage, spec: ModelSpec, tp_mesh) -> None:
    """Split each block of ``stage`` over ``tp_mesh`` by the model's plan (in place)."""
    for i in stage.indices:
        plan = block_plan(spec.metadata, i, spec.num_blocks)
        if plan:
            apply_tp(stage.blocks[str(i)], plan, tp_mesh)


def tp_grad_summed_params(stage: Stage, spec: ModelSpec) -> list[nn.Parameter]:
    """The stage's parameters whose gradients are summed over tp after backward (the
    plan's ``replicated_with_grad_allreduce``); call after sharding (it replaces them)."""
    return [p for i in stage.indices
            for p in grad_summed_params(stage.blocks[str(i)], block_plan(spec.metadata, i, spec.num_blocks))]


class _KeepInput(torch.autograd.Function):
    """Identity that saves its input for backward.

    A recomputed block keeps its input alive (the recomputation needs it), but
    non-reentrant checkpointing holds it in a Python closure that autograd's
    ``saved_tensors_hooks`` never see. Saving it here (the same storage, no copy) puts it
    where the activation probe (``worker/instrument.py``) counts it, so a step's measured
    activation peak stays the bytes really kept for backward.
    """

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class RecomputedForward:
    """A block's ``forward`` that keeps only its input and recomputes the rest in backward.

    Installed as the block's instance attribute ``forward`` rather than by wrapping the
    block in torch's ``checkpoint_wrapper``: a wrapper is a new parent module, which
    renames every parameter (``_checkpoint_wrapped_module.``) and with them the keys of
    checkpoints, optimizer state and everything else keyed by name. Here the module tree
    is untouched, so a checkpoint saved with recomputation loads without it and back.
    FSDP2's hooks stay on the block's ``__call__``, outside the recomputed region: its
    pre-backward all-gather has run by the time backward reaches the block and replays it.
    """

    def __init__(self, forward):
        self.forward = forward

    def __call__(self, x, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint

        if isinstance(x, torch.Tensor) and x.requires_grad:
            x = _KeepInput.apply(x)
        return checkpoint(self.forward, x, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(stage: Stage, memory: MemoryConfig) -> list[int]:
    """Recompute the blocks ``memory`` selects (by global index); returns their indices."""
    chosen = [i for i in stage.indices if memory.checkpointed(i)]
    for i in chosen:
        block = stage.blocks[str(i)]
        block.forward = RecomputedForward(block.forward)
    return chosen


def apply_compile(stage: Stage, memory: MemoryConfig) -> None:
    """``torch.compile`` each block's forward in place.

    ``torch.compile(module)`` returns an ``OptimizedModule`` whose parameters are named
    ``_orig_mod.*``; compiling the forward keeps names, and leaves FSDP2's hooks (added
    next) outside the graph.
    """
    for i in stage.indices:
        block = stage.blocks[str(i)]
        block.forward = torch.compile(block.forward, backend=memory.compile_backend)


def mixed_precision_policy(precision: PrecisionConfig, *, last: bool):
    """FSDP2's policy for ``precision``; ``last``: the stage whose output is the loss's
    input, cast to fp32 so the loss is computed in fp32 whatever the model computes in.

    The sharded parameters keep the dtype the model was built in (fp32): the optimizer
    updates fp32 master weights and its states are fp32. Other stages hand their output
    on in the compute dtype (half the pipeline traffic in bf16).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not precision.mixed:
        return MixedPrecisionPolicy()  # exactly the fp32 behaviour without a policy
    return MixedPrecisionPolicy(param_dtype=DTYPES[precision.param_dtype],
                                reduce_dtype=DTYPES[precision.reduce_dtype],
                                output_dtype=torch.float32 if last else None)


def shard_stage(stage: Stage, dp_mesh, *, pipelined: bool, precision: Optional[PrecisionConfig] = None,
                memory: Optional[MemoryConfig] = None, last: bool = True, tp_mesh=None,
                spec: Optional[ModelSpec] = None) -> Stage:
    """Float8 linears per block (``precision.float8``), tensor parallelism per block
    (``tp_mesh`` of more than one rank, by ``spec``'s plan), checkpointing and compile per
    block (if asked), then ``fully_shard`` each block, then the stage as root (torchtitan's
    recipe).

    With a pipeline the parameters stay gathered between forward and backward
    (``reshard_after_forward=False``): each microbatch would otherwise all-gather twice.
    ``last``: this stage ends the model (its output goes to the loss).
    """
    from torch.distributed.fsdp import fully_shard

    precision = precision or PrecisionConfig()
    memory = memory or MemoryConfig()
    if precision.float8:
        if spec is None:
            raise ValueError("shard_stage: float8 needs the ModelSpec (which block holds the output head)")
        from rayflex.worker.float8 import convert_stage

        convert_stage(stage, spec)  # on the model as built: before TP, checkpointing, compile and sharding
    if tp_mesh is not None and tp_mesh.size() > 1:
        if spec is None:
            raise ValueError("shard_stage: tensor parallelism needs the ModelSpec (its TP plan)")
        apply_tensor_parallel(stage, spec, tp_mesh)
    apply_activation_checkpointing(stage, memory)
    if memory.compile:
        apply_compile(stage, memory)
    block_policy = mixed_precision_policy(precision, last=False)
    for i in stage.indices:
        fully_shard(stage.blocks[str(i)], mesh=dp_mesh, reshard_after_forward=not pipelined, mp_policy=block_policy)
    fully_shard(stage, mesh=dp_mesh, reshard_after_forward=not pipelined,
                mp_policy=mixed_precision_policy(precision, last=last))
    return stage


def build_local_stages(spec: ModelSpec, plan: MeshPlan, rank: int, device: torch.device) -> list[tuple[int, Stage]]:
    """Build only this rank's stage(s): (stage index, module) with global block keys."""
    pp_index, _ = plan.coords(rank)
    return [(s, build_stage(spec, list(plan.stage_blocks[s]), device)) for s in plan.local_stages(pp_index)]


def build_schedule(plan: MeshPlan, stages: list[tuple[int, nn.Module]], pp_group, device: torch.device,
                   loss_fn):
    """A torch.distributed.pipelining schedule over this rank's stage(s)."""
    from torch.distributed import pipelining as pl

    pipe_stages = [pl.PipelineStage(mod, stage_index=s, num_stages=plan.num_stages, device=device,
                                    group=pp_group) for s, mod in stages]
    if plan.schedule == "gpipe":
        return pl.ScheduleGPipe(pipe_stages[0], n_microbatches=plan.microbatches, loss_fn=loss_fn)
    if plan.schedule == "1f1b":
        return pl.Schedule1F1B(pipe_stages[0], n_microbatches=plan.microbatches, loss_fn=loss_fn)
    return pl.ScheduleInterleaved1F1B(pipe_stages, n_microbatches=plan.microbatches, loss_fn=loss_fn)


def _copies(p: torch.Tensor, stage_ranks: int) -> int:
    """How many ranks of a stage hold the same local piece of ``p``: the ranks outside its
    mesh (a parameter FSDP shards over dp but tensor parallelism left whole lives on every
    tp rank) times the sizes of the mesh dims it is replicated over (a rowwise bias over
    tp, HSDP's replicas)."""
    from torch.distributed.tensor import DTensor, Replicate

    if not isinstance(p, DTensor):  # never in a sharded stage; counted as a piece of its own
        return 1
    mesh = p.device_mesh
    copies = stage_ranks // mesh.size()
    for dim, placement in enumerate(p.placements):
        if isinstance(placement, Replicate):
            copies *= mesh.size(dim)
    return max(copies, 1)


def _local_grads(params: list[nn.Parameter]) -> list[tuple[torch.Tensor, nn.Parameter]]:
    """``(this rank's gradient tensor, its parameter)`` per parameter with a gradient: the
    DTensor's local shard (the storage its in-place updates write) or the plain tensor."""
    from torch.distributed.tensor import DTensor

    return [(p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad, p)
            for p in params if p.grad is not None]


def global_grad_norm(params: list[nn.Parameter], group=None, stage_ranks: int = 0) -> torch.Tensor:
    """L2 norm of all gradients of the whole model, across pp stages, tp splits and FSDP
    shards.

    Each piece of a gradient lives on one or more ranks of its stage (``stage_ranks`` =
    dp x tp; 0: each rank owns a disjoint piece, plain FSDP): every rank adds its local
    squared norm divided by the piece's number of copies (:func:`_copies`), so the sum
    all-reduced over the world is the global squared norm, each element counted once.

    The local norms are list ops over the local shards in float64 (a few kernels, not a
    sharding dispatch per parameter), the sum stays on the gradients' device (one
    device-to-host copy per step) and the all-reduce runs on the host: ``group`` must
    serve CPU tensors — the worker passes ``ProcessGroups.host`` (on GPU the gloo control
    group; an NCCL group would refuse the host tensor). Returns a 0-dim float64 CPU tensor.
    """
    return _norm_of(_local_grads(params), group, stage_ranks)


def _norm_of(local: list[tuple[torch.Tensor, nn.Parameter]], group, stage_ranks: int) -> torch.Tensor:
    import torch.distributed as dist

    sq = torch.zeros((), dtype=torch.float64)
    by_device: dict[torch.device, list[tuple[torch.Tensor, int]]] = {}
    for g, p in local:
        by_device.setdefault(g.device, []).append((g.detach(), _copies(p.grad, stage_ranks) if stage_ranks else 1))
    for pieces in by_device.values():
        norms = torch._foreach_norm([g for g, _ in pieces], 2, dtype=torch.float64)
        weights = torch.tensor([1.0 / c for _, c in pieces], dtype=torch.float64, device=norms[0].device)
        sq += (torch.stack(norms).square_() * weights).sum().cpu()
    if dist.is_initialized():
        dist.all_reduce(sq, group=group)
    return sq.sqrt()


def clip_grads_(params: list[nn.Parameter], max_norm: float, group=None, stage_ranks: int = 0) -> float:
    """Scale every gradient so the global norm is at most ``max_norm``; returns the norm
    before clipping. ``group``, ``stage_ranks``: as for :func:`global_grad_norm`."""
    local = _local_grads(params)
    norm = float(_norm_of(local, group, stage_ranks))
    scale = max_norm / (norm + 1e-6)
    if scale < 1.0:
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for g, _ in local:
            by_device.setdefault(g.device, []).append(g)
        for grads in by_device.values():
            torch._foreach_mul_(grads, scale)
    return norm
