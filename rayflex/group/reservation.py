"""The placement-group reservation of a run: its bundles per node and the actor in each."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Optional

from rayflex.config import TrainSpec
from rayflex.planning.placement.planner import Plan


@dataclass(eq=False)
class Slot:
    """One bundle of the run's reservation and who holds it: an actor sitting in it, a
    rank whose actor is being spawned into it, or a standby being started there."""

    node: str
    pg: Any
    bundle: int
    actor_id: Optional[str] = None
    pending_rank: Optional[int] = None
    for_standby: bool = False

    @property
    def free(self) -> bool:
        return self.actor_id is None and self.pending_rank is None and not self.for_standby

    @property
    def held(self) -> bool:
        return not self.free

    def strategy(self):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=self.bundle)


class RunPlacement:
    """The bundles a run holds, per node, and which worker actor sits in each.

    Bundles are reserved one placement group per (node, reservation), pinned to the node
    with the ``ray.io/node-id`` label selector (a hard constraint that also tells apart
    nodes sharing an IP). Across elastic restarts the reservation is kept: a surviving
    actor stays in its bundle and takes a new rank; a dead actor's bundle is reused by its
    replacement; more bundles are reserved only where the new plan needs more than the node
    already holds, and groups of vanished or unused nodes are released.
    """

    def __init__(self, spec: TrainSpec):
        self.spec = spec
        self.resources = spec.scaling.worker_resources()
        self._slots: list[Slot] = []
        self._pgs: list[tuple[str, Any]] = []

    # ----------------------------------------------------------------- bookkeeping
    def _free(self, node: str) -> list[Slot]:
        return [s for s in self._slots if s.node == node and s.free]

    def vacate(self, actor_id: str) -> None:
        for s in self._slots:
            if s.actor_id == actor_id:
                s.actor_id = None

    def slot_of(self, actor_id: str) -> Optional[Slot]:
        return next((s for s in self._slots if s.actor_id == actor_id), None)

    def node_of_actor(self, actor_id: str) -> Optional[str]:
        slot = self.slot_of(actor_id)
        return slot.node if slot is not None else None

    def _reserve(self, node: str, count: int, timeout_s: Optional[float] = None) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        from rayflex.constants import knob
        from rayflex.errors import PlacementError
        from rayflex.planning.topology import NODE_ID_LABEL

        pg = placement_group([dict(self.resources) for _ in range(count)], strategy="STRICT_PACK",
                             name=f"rayflex-{self.spec.run.name}-{node[:8]}-{len(self._pgs)}-{time.time_ns() % 10**6}",
                             bundle_label_selector=[{NODE_ID_LABEL: node} for _ in range(count)])
        timeout = knob("PLACEMENT_TIMEOUT_S") if timeout_s is None else timeout_s
        ready, _ = ray.wait([pg.ready()], timeout=timeout)
        if not ready:
            remove_placement_group(pg)
            raise PlacementError(f"could not reserve {count} bundle(s) of {self.resources} on node {node} "
                                 f"within {timeout:.0f}s: the node may be gone, draining or short of resources")
        self._pgs.append((node, pg))
        self._slots += [Slot(node=node, pg=pg, bundle=i) for i in range(count)]

    def release_unused(self) -> None:
        """Remove placement groups none of whose bundles holds an actor (nodes the plan
        no longer uses, or that vanished), returning their resources to the cluster."""
        from ray.util.placement_group import remove_placement_group

        for node, pg in list(self._pgs):
            slots = [s for s in self._slots if s.pg is pg]
            if any(s.held for s in slots):
                continue
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
            self._pgs.remove((node, pg))
            self._slots = [s for s in self._slots if s.pg is not pg]

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for _, pg in self._pgs:
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001
                pass
        self._pgs, self._slots = [], []

    # ----------------------------------------------------------------- assignment
    def assign(self, plan: Plan, survivors: dict[str, Any]) -> tuple[list[Any], list[Any]]:
        """Per rank, a surviving actor to reuse or a strategy to spawn one; plus the
        survivors the plan has no place for (to be killed). ``survivors``: actor id -> handle,
        each still sitting in its bundle."""
        members: list[Any] = [None] * len(plan.rank_to_node)
        by_node: dict[str, list[str]] = {}
        for actor_id in survivors:
            node = self.node_of_actor(actor_id)
            if node is not None:
                by_node.setdefault(node, []).append(actor_id)
        extra: list[Any] = []
        for node, ranks in plan.node_ranks().items():
            here = by_node.pop(node, [])
            for rank, actor_id in zip(ranks, here):
                members[rank] = survivors[actor_id]
            for actor_id in here[len(ranks):]:
                extra.append(survivors[actor_id])
                self.vacate(actor_id)
            need = ranks[len(here):]
            missing = len(need) - len(self._free(node))
            if missing > 0:
                self._reserve(node, missing)
            for rank, slot in zip(need, self._free(node)):
                members[rank] = slot.strategy()
                slot.pending_rank = rank
        for actor_ids in by_node.values():
            for actor_id in actor_ids:
                extra.append(survivors[actor_id])
                self.vacate(actor_id)
        return members, extra

    def reserve_standby(self, node: str) -> tuple[Slot, Any]:
        """A bundle on ``node`` for a worker started ahead of need: (slot, strategy)."""
        from rayflex.constants import knob

        if not self._free(node):
            # Short: a standby is an optimization, and the controller's loop waits on this.
            self._reserve(node, 1, timeout_s=knob("STANDBY_RESERVE_TIMEOUT_S"))
        slot = self._free(node)[0]
        slot.for_standby = True
        return slot, slot.strategy()

    @staticmethod
    def bind_slot(slot: Slot, actor_id: str) -> None:
        slot.actor_id, slot.pending_rank, slot.for_standby = actor_id, None, False

    def bind(self, rank: int, actor_id: str) -> None:
        """Record which actor took the bundle reserved for ``rank``."""
        for s in self._slots:
            if s.pending_rank == rank:
                self.bind_slot(s, actor_id)
