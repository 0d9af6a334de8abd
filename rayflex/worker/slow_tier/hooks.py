"""Gradients averaged over the replicas by a :class:`ReplicateReducer`, every step.

With ``CommConfig(replicate="int8")`` FSDP2 shards each stage over ``dp_shard`` alone (a
1-D mesh: it reduce-scatters inside the replica) and this hook, which FSDP2 calls with each
parameter group's reduce-scattered gradient, averages that shard over the replicate
group in place, before FSDP2 views it out into the parameters' ``.grad``. One call per
FSDP module per step: on the last microbatch only, as FSDP2 reduces then.
"""

from __future__ import annotations

import functools

from torch import nn

from rayflex.worker.slow_tier.reduce import ReplicateReducer


def _average_over_replicas(reducer: ReplicateReducer, key: str, reduce_output) -> None:
    reducer.mean_(reduce_output, key)


def reduce_gradients_over_replicas(stages: list[tuple[int, nn.Module]], reducer: ReplicateReducer) -> int:
    """Install the hook on every FSDP module of ``stages``; returns how many. A module's key
    is its stage and name, so its residual survives a re-setup of the same layout."""
    from torch.distributed.fsdp import FSDPModule

    installed = 0
    for s, stage in stages:
        for name, module in stage.named_modules():
            if isinstance(module, FSDPModule):
                module.set_all_reduce_hook(functools.partial(_average_over_replicas, reducer, f"{s}:{name}"))
                installed += 1
    return installed
