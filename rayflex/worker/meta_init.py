"""Building a rank's stage(s) on the meta device, sharding them, then filling in the shards.

Building a stage in full before ``fully_shard`` makes every rank hold its whole stage
(a 7B model does not start). Here the stage is built on ``meta`` (shapes only), sharded
exactly as the worker shards it, moved to the real device with ``to_empty`` (this rank's
shards, uninitialised), and then filled block by block: each block is built once more, in
full and seeded exactly as :meth:`ModelSpec.block` always builds it, this rank's slice of
every tensor is copied into the shard, and the block is dropped before the next one. The
weights are therefore bit-identical to the plain seeded build whatever the split (pp, dp),
and the peak during setup is this rank's shards plus one full block.

Why not an ``init_weights()`` on the sharded module (torchtitan's way): a block's random
init draws the whole tensor from one seeded generator, so a shard's values depend on every
element drawn before it; only a full draw reproduces them. One block at a time costs the
same compute as today's build and no communication (each rank takes its slice locally).

``to_empty`` leaves buffers (persistent or not: a rotary ``inv_freq``, position ids)
as garbage too: they are copied from the full block like parameters. Names are never
touched, so checkpoint keys stay those of the plain build.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from rayflex.mesh.plan import MeshPlan
from rayflex.models.spec import ModelSpec, Stage, build_stage

# ``shard(stage_index, stage)`` -> the sharded stage: the worker's own call of
# ``shard_stage`` (mesh, schedule, precision, recomputation, whether the stage is the last),
# so a meta build is sharded exactly as a plain one.
ShardFn = Callable[[int, Stage], Stage]

# Path segments that wrappers applied while sharding insert (torch's checkpoint_wrapper,
# ``torch.compile``'s OptimizedModule); the freshly built block has neither.
_WRAPPER_SEGMENTS = frozenset({"_checkpoint_wrapped_module", "_orig_mod"})


def build_sharded_stages(spec: ModelSpec, plan: MeshPlan, rank: int, device: torch.device, *,
                         shard: ShardFn) -> list[tuple[int, Stage]]:
    """This rank's stage(s), sharded by ``shard``, with the weights of the plain seeded
    build: what ``build_local_stages`` followed by ``shard`` on each module returns,
    without ever holding a whole stage."""
    pp_index, _ = plan.coords(rank)
    out = []
    for s in plan.local_stages(pp_index):
        indices = list(plan.stage_blocks[s])
        stage = shard(s, build_stage(spec, indices, "meta"))
        stage.to_empty(device=device)
        for i in indices:
            materialize_block(stage.blocks[str(i)], spec, i, device, where=f"rank {rank}, stage {s}")
        out.append((s, stage))
    return out


@torch.no_grad()
def materialize_block(sharded: nn.Module, spec: ModelSpec, index: int, device: torch.device,
                      *, where: str = "") -> None:
    """Fill block ``index``'s (sharded, ``to_empty``'d) parameters and buffers from one full
    seeded build of it; the full block is dropped on return."""
    full = spec.block(index, device)
    sources = {"parameter": dict(full.named_parameters()), "buffer": dict(full.named_buffers())}
    targets = {"parameter": _by_plain_name(sharded.named_parameters()),
               "buffer": _by_plain_name(sharded.named_buffers())}
    for kind in ("parameter", "buffer"):
        src, dst = sources[kind], targets[kind]
        if src.keys() != dst.keys():
            raise RuntimeError(
                f"{where}: block {index} has {kind}s {sorted(dst)} after sharding but the full build has "
                f"{sorted(src)}; build_block({index}) must make the same module on every device, meta "
                "included (no device-dependent branches, no tensors created outside the default device)")
        for name, target in dst.items():
            _copy_local_slice(target, src[name].detach(), f"{where}: block {index} {kind} {name!r}")
    del full, sources


def _by_plain_name(named) -> dict[str, torch.Tensor]:
    return {".".join(p for p in name.split(".") if p not in _WRAPPER_SEGMENTS): t for name, t in named}


def _copy_local_slice(target: torch.Tensor, full: torch.Tensor, what: str) -> None:
    """Copy this rank's part of ``full`` into ``target`` in place.

    A sharded target is a DTensor; ``distribute_tensor(..., src_data_rank=None)`` cuts this
    rank's slice by the target's own mesh and placements (uneven ``Shard(0)`` included)
    without any communication, so the slicing rule is DTensor's, not a copy of it here.
    ``to_local()`` shares the shard's storage: writing it fills the parameter FSDP holds.
    ``copy_`` casts, as ``.to(dtype)`` on the full build would, if sharding changed the dtype.
    """
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(target, DTensor):
        if tuple(target.shape) != tuple(full.shape):
            raise RuntimeError(f"{what}: global shape {tuple(target.shape)} after sharding, "
                               f"{tuple(full.shape)} in the full build")
        piece = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None).to_local()
        local = target.to_local()
    else:
        piece, local = full, target
    if local.shape != piece.shape:
        raise RuntimeError(f"{what}: local shard {tuple(local.shape)} but this rank's slice of the full "
                           f"build is {tuple(piece.shape)}")
    local.copy_(piece)
