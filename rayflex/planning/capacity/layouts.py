"""The capacity search's candidate space: every mesh rayflex can run for a world size.

A candidate is ``(tp, pp, dp_shard, schedule, stages_per_rank, microbatches)`` for pp > 1,
or ``(tp, pp=1, dp_shard, micro_batch)`` (gradient accumulation) without a pipeline; dp is
what the world size leaves. Which meshes exist is ``rayflex.mesh.rules``, the rules
``plan_mesh`` applies, so every candidate is a mesh the workers build. On top of the rules:

* **tp** divides the slots of a node (a tp group all-reduces activations four times per
  block and never leaves its node) and passes the model's own TP rule
  (``ModelDescription.tp_problem``: a ModelSpec's ``metadata["tp"]``, whose sizes tp must
  divide; no TP plan, no tp > 1).
* **dp_shard** is dp (plain FSDP) or the number of dp ranks one node, rack or zone holds
  when that divides dp: HSDP shard groups that fit a fast tier, replicated across the slow
  one. Other sizes only move a shard group across a tier boundary without shrinking the
  replica all-reduce, so they are not worth a candidate.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from rayflex.mesh import rules
from rayflex.mesh.stage_split import stage_split
from rayflex.mesh.plan import NO_PIPELINE, MeshPlan
from rayflex.planning.capacity.memory import ModelDescription
from rayflex.planning.cost_model import NodeTree
from rayflex.planning.topology import Topology

_TIER_WORDS = ("node", "rack", "zone")


def tp_degrees(model: ModelDescription, topology: Topology, world: int,
               only: Optional[Iterable[int]] = None) -> tuple[list[int], list[tuple[str, str]]]:
    """The tp degrees to search (ascending) and ``(what, why)`` for those left out.

    ``only``: restrict to these (the elastic rule keeps the launch tp); a degree in it that
    is impossible here is reported, not searched.
    """
    slots = [n.slots for n in topology.usable().nodes if n.slots > 0]
    if not slots:
        return [], []
    biggest = max(slots)
    wanted = sorted(set(only)) if only is not None else rules.divisors(biggest)
    keep, skipped = [], []
    for tp in wanted:
        if tp > biggest or biggest % tp:
            skipped.append((f"tp={tp}", f"a tp group must sit on one node, and tp={tp} does not divide the "
                                        f"{biggest} slots of the largest node"))
        elif world % tp:
            skipped.append((f"tp={tp}", f"the world size {world} is not a multiple of tp={tp}"))
        elif sum(s // tp for s in slots) * tp < world:
            skipped.append((f"tp={tp}", f"the nodes hold only {sum(s // tp for s in slots)} whole tp groups "
                                        f"of {tp}, fewer than {world // tp}"))
        elif (problem := model.tp_problem(tp)) is not None:
            skipped.append((f"tp={tp}", problem.problem))
        else:
            keep.append(tp)
    return keep, skipped


def tier_units(topology: Topology, tp: int) -> list[tuple[str, int]]:
    """``(tier word, tp groups)`` the smallest node, rack and zone holding any can take: the
    sizes of shard groups that fit a tier wherever they land."""
    tree = NodeTree([n for n in topology.usable().nodes if n.slots >= tp], unit=tp)
    out = []
    for lv, word in enumerate(_TIER_WORDS):
        sizes = [sum(tree.cap[i] for i in ns) for ns in tree.subtrees(lv).values()]
        sizes = [s for s in sizes if s > 0]
        if sizes:
            out.append((word, min(sizes)))
    return out


def shard_sizes(tiers: Sequence[tuple[str, int]], dp: int) -> list[int]:
    """FSDP shard-group sizes to try at ``dp``: dp (plain FSDP) first, then every tier's
    size that divides dp and is smaller (HSDP), largest first."""
    out = [dp]
    for _, units in sorted(tiers, key=lambda t: -t[1]):
        if units < dp and dp % units == 0 and units not in out:
            out.append(units)
    return out


def enumerate_layouts(model: ModelDescription, world: int, global_batch: int, *,
                      schedules: Sequence[str] = ("gpipe", "1f1b", "interleaved"), max_stages_per_rank: int = 4,
                      max_microbatches: int = 0, tp_options: Sequence[int] = (1,),
                      tiers: Sequence[tuple[str, int]] | dict = ()):
    """Every mesh rayflex can run for this world size and batch; yields MeshPlans and
    ``("skip", what, why)`` for meshes it cannot. ``tp_options``: the tp degrees (from
    :func:`tp_degrees`); ``tiers``: tp -> :func:`tier_units` (or one list for every tp; empty:
    plain FSDP only). Which meshes are runnable, and their batch arithmetic, is
    ``rayflex.mesh.rules``: the same rules ``plan_mesh`` applies."""
    n = model.num_blocks
    for tp in tp_options:
        tier = tiers.get(tp, ()) if isinstance(tiers, dict) else tiers
        yield from _layouts_at_tp(model, world, global_batch, n, tp, tier, schedules, max_stages_per_rank,
                                  max_microbatches)


def _layouts_at_tp(model, world, global_batch, n, tp, tiers, schedules, max_stages_per_rank, max_microbatches):
    tp_word = f" x tp={tp}" if tp > 1 else ""
    for pp in rules.divisors(world // tp):
        dp = world // (pp * tp)
        problem = rules.mesh_base_problem(world, pp, global_batch, n, tp)
        if problem is not None:
            yield ("skip", f"pp={pp}" if pp > n else f"pp={pp} x dp={dp}{tp_word}", problem.problem)
            continue
        shards = shard_sizes(tiers, dp)
        per_rank = global_batch // dp
        if pp == 1:
            split_blocks = stage_split(model.block_params, 1)
            for micro in rules.divisors(per_rank):
                split = rules.split_batch(world, global_batch, tp=tp, micro_batch=micro)
                for shard in shards:
                    yield MeshPlan(1, dp, tp, dp // shard, schedule=NO_PIPELINE, stage_blocks=split_blocks,
                                   per_rank_batch=per_rank, micro_batch=split.micro_batch,
                                   accum_steps=split.accum_steps)
            continue
        shapes = [(s, 1) for s in schedules if s in ("gpipe", "1f1b")]
        if rules.INTERLEAVED in schedules:
            shapes += [(rules.INTERLEAVED, v) for v in range(2, max_stages_per_rank + 1)
                       if rules.stages_problem(pp * v, n) is None]
        if not shapes:
            yield ("skip", f"pp={pp} x dp={dp}{tp_word}", f"none of the schedules {', '.join(schedules)} can cut "
                   f"{n} blocks into stages for pp={pp}")
            continue
        fed = False
        for schedule, v in shapes:
            ms = rules.microbatch_options(pp, per_rank, schedule, max_microbatches)
            fed = fed or bool(ms)
            if not ms:
                continue
            split_blocks = stage_split(model.block_params, pp * v)
            for m in ms:
                batch = rules.split_batch(world, global_batch, pp=pp, tp=tp, schedule=schedule, stages_per_rank=v,
                                          microbatches=m, num_blocks=n)
                for shard in shards:
                    yield MeshPlan(pp, dp, tp, dp // shard, schedule=schedule, stages_per_rank=v,
                                   stage_blocks=split_blocks, per_rank_batch=per_rank,
                                   microbatches=batch.microbatches, micro_batch=batch.micro_batch)
        if not fed:
            yield ("skip", f"pp={pp} x dp={dp}{tp_word}", f"per-rank batch {per_rank} cannot feed {pp} stages "
                   f"(microbatches must be >= pp and divide it)")
