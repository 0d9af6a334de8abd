"""Workers started before a restart needs them (growth, replacements), while the run trains.

A new worker process costs seconds (tens on a GPU node); started while the old attempt
still trains or winds down, the restart finds it warm.
"""

from __future__ import annotations

import logging
from typing import Optional

log = logging.getLogger(__name__)


def warm_standbys(ctx, target: int, current: Optional[dict[str, int]] = None,
                  avoid: frozenset | set = frozenset()) -> bool:
    """Start, on the nodes the plan for ``target`` ranks uses, the workers missing there
    beyond ``current`` (node -> workers up; default: the live group's). False if that plan
    cannot be made now."""
    if target <= 0:
        return False
    standby = ctx.ensure_standby()
    try:
        topology = ctx.usable_topology(avoid)
        if avoid:
            target = min(target, ctx.best_size(topology))
            if target <= 0:
                return False
        _, _, placement = ctx.plan_at(target, topology)
        if current is None:
            current = ctx.workers_per_node(ctx.group.node_of)
        for node, ranks in placement.node_ranks().items():
            need = len(ranks) - current.get(node, 0) - standby.count(node)
            if need > 0:
                standby.start(node, need)
        return True
    except Exception as e:  # noqa: BLE001 - the node went meanwhile: retry at the next check
        log.warning("could not warm workers for %d ranks: %s", target, e)
        standby.clear()
        return False


def warm_replacements(ctx, node_of: dict[int, str], gone: set[int]) -> None:
    """Start the replacements for the ranks that are gone now, while the survivors leave
    (seconds, when one is blocked on a dead peer). Never on a node that lost all its
    ranks: it is probably on its way out, before Ray has noticed."""
    if not ctx.warm_restarts:
        return
    avoid = {node for node in set(node_of.values())
             if all(r in gone for r, n in node_of.items() if n == node)}
    warm_standbys(ctx, ctx.best_size(), ctx.workers_per_node(node_of, skip_ranks=gone), avoid=avoid)


def growth_target(ctx, world_size: int) -> Optional[int]:
    """The size to grow to now that capacity returned, if any (and workers for it warming)."""
    if not ctx.spec.checkpoint.every_steps:
        return None  # growing restarts from a checkpoint; without them it would lose progress
    slots = ctx.usable_slots()
    target = ctx.policies.elastic.grow_to(world_size, slots)
    if target is None:
        return None
    log.info("capacity for %d workers is back (%d usable slots): growing at the next step boundary", target, slots)
    return target if warm_standbys(ctx, target) else None  # else retried at the next check
