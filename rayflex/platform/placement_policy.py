"""Where a run's ranks go: from a TrainSpec and its mesh plan to a topology-aware Plan.

The controller calls :func:`place_run` on every (re)start; ``Trainer.plan()`` and
``rayflex plan`` call :func:`plan_for` for a dry run against the live cluster or a
described topology. The communication profile comes from the model itself: parameter
bytes per stage (FSDP traffic inside each dp group) and activation bytes per microbatch
(p2p traffic between adjacent stages).
"""

from __future__ import annotations

import time

from typing import Any, Optional

from rayflex.actors.parallel import MeshPlan
from rayflex.config import TrainSpec
from rayflex.platform.placement import CommProfile, MeshShape, Plan, Planner
from rayflex.platform.topology import Topology

# fp32 on the CPU path; the activation width is the model's hidden size.
BYTES_PER_VALUE = 4


def comm_profile(spec: TrainSpec, mesh: MeshPlan) -> CommProfile:
    counts = spec.model.param_counts()
    # A pp rank holds stages_per_rank stages; its FSDP traffic is theirs together.
    stage_bytes = [0.0] * mesh.pp
    for stage, blocks in enumerate(mesh.stage_blocks):
        stage_bytes[stage % mesh.pp] += sum(counts[i] for i in blocks) * BYTES_PER_VALUE
    hidden = spec.model.hidden_size or 1
    activation = mesh.micro_batch * spec.data.seq_len * hidden * BYTES_PER_VALUE
    return CommProfile(stage_param_bytes=stage_bytes, activation_bytes=float(activation),
                       microbatches=mesh.microbatches * mesh.accum_steps,
                       reshard_after_forward=mesh.pp == 1)


def plan_for(spec: TrainSpec, mesh: MeshPlan, topology: Optional[Topology] = None) -> Plan:
    """The placement plan for ``mesh`` on ``topology`` (default: the connected cluster)."""
    if topology is None:
        topology = Topology.from_ray(cpus_per_worker=spec.scaling.cpus_per_worker or 1.0,
                                     use_gpu=spec.scaling.use_gpu)
    return Planner(topology).plan(MeshShape(pp=mesh.pp, dp=mesh.dp), comm_profile(spec, mesh),
                                  require_labels=dict(spec.scaling.node_labels) or None)


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
        self._slots: list[dict] = []  # {"node", "pg", "bundle", "actor": actor-id or None}
        self._pgs: list[tuple[str, Any]] = []

    # ----------------------------------------------------------------- bookkeeping
    def _free(self, node: str) -> list[dict]:
        return [s for s in self._slots if s["node"] == node and s["actor"] is None]

    def vacate(self, actor_id: str) -> None:
        for s in self._slots:
            if s["actor"] == actor_id:
                s["actor"] = None

    def slot_of(self, actor_id: str) -> Optional[dict]:
        return next((s for s in self._slots if s["actor"] == actor_id), None)

    def node_of_actor(self, actor_id: str) -> Optional[str]:
        return next((s["node"] for s in self._slots if s["actor"] == actor_id), None)

    def _reserve(self, node: str, count: int, timeout_s: Optional[float] = None) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        from rayflex.constants import knob
        from rayflex.errors import PlacementError
        from rayflex.platform.topology import NODE_ID_LABEL

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
        self._slots += [{"node": node, "pg": pg, "bundle": i, "actor": None} for i in range(count)]

    def release_unused(self) -> None:
        """Remove placement groups none of whose bundles holds an actor (nodes the plan
        no longer uses, or that vanished), returning their resources to the cluster."""
        from ray.util.placement_group import remove_placement_group

        for node, pg in list(self._pgs):
            slots = [s for s in self._slots if s["pg"] is pg]
            if any(s["actor"] is not None for s in slots):
                continue
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already gone with its node
                pass
            self._pgs.remove((node, pg))
            self._slots = [s for s in self._slots if s["pg"] is not pg]

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
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

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
                members[rank] = PlacementGroupSchedulingStrategy(placement_group=slot["pg"],
                                                                 placement_group_bundle_index=slot["bundle"])
                slot["actor"] = ("pending", rank)
        for actor_ids in by_node.values():
            for actor_id in actor_ids:
                extra.append(survivors[actor_id])
                self.vacate(actor_id)
        return members, extra

    def reserve_standby(self, node: str) -> tuple[dict, Any]:
        """A bundle on ``node`` for a worker started ahead of need: (slot, strategy)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not self._free(node):
            # Short: a standby is an optimization, and the controller's loop waits on this.
            self._reserve(node, 1, timeout_s=5.0)
        slot = self._free(node)[0]
        slot["actor"] = ("standby", id(slot))
        return slot, PlacementGroupSchedulingStrategy(placement_group=slot["pg"],
                                                      placement_group_bundle_index=slot["bundle"])

    @staticmethod
    def bind_slot(slot: dict, actor_id: str) -> None:
        slot["actor"] = actor_id

    def bind(self, rank: int, actor_id: str) -> None:
        """Record which actor took the bundle reserved for ``rank``."""
        for s in self._slots:
            if s["actor"] == ("pending", rank):
                s["actor"] = actor_id
