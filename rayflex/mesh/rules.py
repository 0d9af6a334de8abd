"""The mesh rules: every divisibility rule a pp x dp x tp mesh obeys, stated once.

A world of ``n`` ranks runs ``pp`` pipeline stages (``x stages_per_rank`` virtual stages
with the interleaved schedule), each split over ``tp`` tensor-parallel ranks, and
``dp = n // (pp * tp)`` data-parallel ranks per stage. The dp ranks are ``dp_replicate x
dp_shard``: FSDP2 shards over ``dp_shard`` ranks and replicates over ``dp_replicate``
(HSDP; ``dp_shard=None`` shards over all of dp). The tp ranks of a dp rank see the same
samples. The global batch is fixed for the whole run, so each dp rank takes
``global_batch // dp`` samples per step and cuts them into pipeline microbatches (pp > 1)
or accumulation passes of ``micro_batch`` samples (pp == 1). Config validation, elastic sizing, ``plan_mesh`` and the
capacity search all ask this module, so a layout one of them accepts is one the workers
can build, and a size one of them rejects is never offered by another.

The rules, in the order they are checked (the first broken one is reported):

1. ``pp * tp`` divides the world size; ``dp_shard`` (if set) divides ``dp``.
2. ``1 <= pp * stages_per_rank <= num_blocks`` (each stage holds at least one block).
3. ``dp`` divides the global batch.
4. pp == 1: ``micro_batch`` (if set) divides the per-rank batch; it is the accumulation
   micro-batch and means nothing to a pipeline, which cuts its own microbatches.
5. pp > 1: ``microbatches >= pp`` (torch's 1F1B needs one per stage to fill the pipe);
   interleaved: ``microbatches`` is a multiple of ``pp`` (whole rounds of microbatches);
   ``microbatches`` divides the per-rank batch.

Plain ints in, ints out: nothing here knows the config classes, so every layer may ask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Optional

from rayflex.errors import ConfigError

INTERLEAVED = "interleaved"


@dataclass(frozen=True)
class BatchCut:
    """How one step's global batch is cut on a mesh (its degrees are the request's)."""

    per_rank_batch: int  # global_batch // dp
    microbatches: int  # pipeline microbatches (1 when pp == 1)
    micro_batch: int  # samples per forward pass
    accum_steps: int  # accumulation passes (pp == 1; a pipeline accumulates itself)


def divisors(n: int) -> list[int]:
    """Every divisor of ``n``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


# ------------------------------------------------------------------------------ the rules
# Each returns the broken rule as a ConfigError (not raised) or None, so that checking and
# enumerating share one statement of it.
def _world_problem(world_size: int, pp: int, what: str, tp: int = 1,
                   dp_shard: Optional[int] = None) -> Optional[ConfigError]:
    field = "ScalingConfig.min_workers" if what == "min_workers" else "ScalingConfig.num_workers"
    if world_size % (pp * tp):
        if tp == 1:
            return ConfigError(field, f"{what}={world_size} is not divisible by ParallelConfig.pp={pp}",
                               f"use a multiple of {pp} workers, or change pp")
        return ConfigError(field, f"{what}={world_size} is not divisible by pp x tp = {pp} x {tp}",
                           f"use a multiple of {pp * tp} workers, or change pp/tp")
    dp = world_size // (pp * tp)
    if dp_shard is not None and dp % dp_shard:
        return ConfigError("ParallelConfig.dp_shard",
                           f"dp_shard={dp_shard} does not divide the data-parallel size {dp} "
                           f"(= {what} {world_size} / (pp {pp} x tp {tp}))",
                           f"use a dp_shard dividing {dp}, a world size whose dp is a multiple of "
                           f"{dp_shard}, or dp_shard=None (shard over all dp ranks)")
    return None


def stages_problem(num_stages: int, num_blocks: int) -> Optional[ConfigError]:
    """Rule 2, or None: every stage needs a block of its own."""
    if num_stages > num_blocks:
        return ConfigError("ParallelConfig.pp", f"{num_stages} pipeline stages for a model of only "
                           f"{num_blocks} blocks", f"use pp * stages_per_rank <= {num_blocks}")
    if num_stages < 1:
        return ConfigError("ParallelConfig.pp", f"cannot cut {num_blocks} blocks into {num_stages} stages",
                           "use pp * stages_per_rank >= 1")
    return None


def _batch_problem(global_batch: int, world_size: int, pp: int, what: str, tp: int = 1) -> Optional[ConfigError]:
    dp = world_size // (pp * tp)
    if global_batch % dp:
        split = f"pp {pp}" if tp == 1 else f"(pp {pp} x tp {tp})"
        return ConfigError("DataConfig.global_batch",
                           f"global_batch={global_batch} is not divisible by the data-parallel size {dp} "
                           f"(= {what} {world_size} / {split})",
                           f"use a multiple of {dp}, or a world size whose data-parallel size divides it")
    return None


def _micro_batch_problem(micro_batch: int, per_rank: int, dp: int) -> Optional[ConfigError]:
    if per_rank % micro_batch:
        return ConfigError("DataConfig.micro_batch",
                           f"micro_batch={micro_batch} does not divide the per-rank batch {per_rank} at dp={dp}",
                           f"use a divisor of {per_rank}")
    return None


def _count_problem(pp: int, microbatches: int, schedule: str) -> Optional[ConfigError]:
    """The rules on the microbatch count alone (no batch needed)."""
    if pp > 1 and microbatches < pp:
        return ConfigError("ParallelConfig.microbatches",
                           f"microbatches={microbatches} is fewer than pp={pp} stages",
                           f"use microbatches >= {pp} (4 x pp keeps the bubble small)")
    if pp > 1 and schedule == INTERLEAVED and microbatches % pp:
        return ConfigError("ParallelConfig.microbatches",
                           f"interleaved schedule needs microbatches ({microbatches}) divisible by pp ({pp})",
                           f"use a multiple of {pp}")
    return None


def _feed_problem(pp: int, microbatches: int, per_rank: int, dp: int) -> Optional[ConfigError]:
    if per_rank % microbatches:
        return ConfigError("ParallelConfig.microbatches",
                           f"{microbatches} microbatches do not divide the per-rank batch {per_rank} at dp={dp}",
                           f"use a divisor of {per_rank} that is >= {pp}")
    return None


# ------------------------------------------------------------------------------ checks
def check_world_size(world_size: int, pp: int, *, what: str = "world_size", tp: int = 1,
                     dp_shard: Optional[int] = None) -> None:
    """Raise ConfigError unless ``world_size`` ranks are whole pipelines of ``pp`` stages
    of ``tp`` ranks each (and whole shard groups of ``dp_shard``)."""
    problem = _world_problem(world_size, pp, what, tp, dp_shard)
    if problem is not None:
        raise problem


def check_stages(num_stages: int, num_blocks: int) -> None:
    """Raise ConfigError unless ``num_stages`` stages can each hold at least one block."""
    problem = stages_problem(num_stages, num_blocks)
    if problem is not None:
        raise problem


def check_microbatches(pp: int, microbatches: int, schedule: str) -> None:
    """The rules a user-set microbatch count must pass whatever the world size."""
    problem = _count_problem(pp, microbatches, schedule)
    if problem is not None:
        raise problem


def mesh_problem(world_size: int, global_batch: int, *, micro_batch: Optional[int] = None,
                 num_blocks: Optional[int] = None, what: str = "world_size", **layout) -> Optional[ConfigError]:
    """The first rule ``world_size`` ranks running ``layout`` (:func:`split_batch`'s keywords)
    break, or None.

    ``what`` names the size in the message (``num_workers``, ``min_workers``); the stage
    count is only checked when ``num_blocks`` is given.
    """
    try:
        split_batch(world_size, global_batch, micro_batch=micro_batch, num_blocks=num_blocks, what=what, **layout)
    except ConfigError as e:
        return e
    return None


def split_batch(world_size: int, global_batch: int, *, pp: int = 1, tp: int = 1, dp_shard: Optional[int] = None,
                schedule: str = "1f1b", stages_per_rank: int = 1, microbatches: Optional[int] = None,
                micro_batch: Optional[int] = None, num_blocks: Optional[int] = None,
                what: str = "world_size") -> BatchCut:
    """The mesh's batch arithmetic; raises the first broken rule as a ConfigError.

    The layout is ``ParallelConfig``'s request as plain values (``ParallelConfig.mesh_request``):
    ``microbatches=None`` is one per stage, the fewest the schedule allows; ``dp_shard=None``
    shards over every dp rank. ``micro_batch`` (pp == 1 only) is the accumulation
    micro-batch; None runs the whole per-rank batch in one pass.
    """
    problem = _world_problem(world_size, pp, what, tp, dp_shard)
    if problem is None and num_blocks is not None:
        problem = stages_problem(pp * stages_per_rank, num_blocks)
    if problem is None:
        problem = _batch_problem(global_batch, world_size, pp, what, tp)
    if problem is not None:
        raise problem
    dp = world_size // (pp * tp)
    per_rank = global_batch // dp
    if pp == 1:
        micro = micro_batch or per_rank
        problem = _micro_batch_problem(micro, per_rank, dp)
        if problem is not None:
            raise problem
        return BatchCut(per_rank, 1, micro, per_rank // micro)
    m = microbatches or pp * stages_per_rank
    problem = _count_problem(pp, m, schedule) or _feed_problem(pp, m, per_rank, dp)
    if problem is not None:
        raise problem
    return BatchCut(per_rank, m, per_rank // m, 1)


# ------------------------------------------------------------------------------ what is possible
def microbatch_options(pp: int, per_rank_batch: int, schedule: str, max_microbatches: int = 0) -> list[int]:
    """Microbatch counts a pipeline of ``pp`` stages may cut ``per_rank_batch`` into,
    ascending (at most ``max_microbatches`` when that is set)."""
    return [m for m in divisors(per_rank_batch)  # rule 5's "divides" by construction
            if (not max_microbatches or m <= max_microbatches) and _count_problem(pp, m, schedule) is None]


def mesh_base_problem(world_size: int, pp: int, global_batch: int, num_blocks: int,
                      tp: int = 1) -> Optional[ConfigError]:
    """What stops ``world_size`` ranks from running ``pp`` plain stages of ``tp`` ranks at
    this batch before any microbatch is chosen (rules 1-3), or None."""
    return (_world_problem(world_size, pp, "world_size", tp) or stages_problem(pp, num_blocks)
            or _batch_problem(global_batch, world_size, pp, "world_size", tp))


def pp_options(world_size: int, global_batch: int, num_blocks: int, tp: int = 1) -> list[int]:
    """The pp values ``layout="auto"`` can pick from at ``world_size`` ranks with ``tp``-way
    tensor parallelism, ascending: rules 1-3 hold and, with a pipeline, some microbatch count
    passes rule 5 (the planner can always fall back to 1F1B). Whether a mesh also fits in
    memory is the planner's question."""
    out = []
    if world_size % tp:
        return out
    for pp in divisors(world_size // tp):
        if mesh_base_problem(world_size, pp, global_batch, num_blocks, tp) is not None:
            continue
        if pp > 1 and not microbatch_options(pp, global_batch // (world_size // (pp * tp)), "1f1b"):
            continue
        out.append(pp)
    return out


def valid_world_sizes(layout: Optional[Mapping[str, Any]], global_batch: int, *, min_size: int, max_size: int,
                      micro_batch: Optional[int] = None, num_blocks: Optional[int] = None,
                      tp_options: tuple[int, ...] = (1,)) -> list[int]:
    """World sizes in ``[min_size, max_size]`` a run can use, largest first.

    ``layout``: :func:`split_batch`'s layout keywords (``ParallelConfig.mesh_request()``);
    None is ``layout="auto"``: a size is valid where :func:`pp_options` offers a pp at one
    of ``tp_options`` (the tp degrees the model splits into, :func:`tp_options_of`;
    ``num_blocks`` is then required).
    """
    sizes = range(max_size, min_size - 1, -1)
    if layout is None:
        if num_blocks is None:
            raise ValueError("valid_world_sizes(layout=None) (layout='auto') needs num_blocks")
        return [n for n in sizes if any(pp_options(n, global_batch, num_blocks, tp) for tp in tp_options)]
    return [n for n in sizes if mesh_problem(n, global_batch, micro_batch=micro_batch, num_blocks=num_blocks,
                                             **layout) is None]


# ------------------------------------------------------------------------------ tensor parallelism
def tp_problem(metadata: Optional[dict], tp: int, *, model: str = "this model") -> Optional[ConfigError]:
    """Whether a model (its ``ModelSpec.metadata``) splits over ``tp`` tensor-parallel ranks,
    or the ConfigError saying why not.

    A model that can be split declares it in ``metadata["tp"]`` (the model contract,
    :mod:`rayflex.models.tp_plan`): ``"plan"`` (how each block's modules split) and
    ``"divides"`` (``{"attention heads": 8, ...}``: sizes tp must divide). None there means
    the model declared it cannot be split (``metadata["tp"]["unsupported"]`` says why).
    """
    if tp == 1:
        return None
    info = (metadata or {}).get("tp")
    if not info or not info.get("plan"):
        why = (info or {}).get("unsupported") or "its ModelSpec has no tensor-parallel plan (metadata['tp'])"
        return ConfigError("ParallelConfig.tp", f"{model} cannot be split over tp={tp} ranks: {why}",
                           "use tp=1, or give the model a TP plan (docs/parallelism.md: the reference GPT, "
                           "Hugging Face Llama/Qwen/Mistral and ModelSpec.from_module(tp_plan=...) have one)")
    for what, n in (info.get("divides") or {}).items():
        if n % tp:
            return ConfigError("ParallelConfig.tp", f"tp={tp} does not divide the {what} ({n}) of {model}",
                               f"use a tp dividing {n} (one of {[d for d in divisors(n) if d > 1]})")
    return None


# The tp degrees layout="auto" considers before it knows the node shape: what a node of up
# to 8 devices can hold (the planner then keeps those dividing the real node).
TP_DEGREES = (1, 2, 4, 8)


def tp_options_of(metadata: Optional[dict]) -> tuple[int, ...]:
    """The :data:`TP_DEGREES` a model (its ``ModelSpec.metadata``) can be split into."""
    return tuple(tp for tp in TP_DEGREES if tp_problem(metadata, tp) is None)


def check_tp(metadata: Optional[dict], tp: int, *, model: str = "this model") -> None:
    problem = tp_problem(metadata, tp, model=model)
    if problem is not None:
        raise problem
