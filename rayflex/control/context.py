"""RunContext: what every state of one run shares.

The services (clock, cluster, recorder, ledger, the policies it was given), the resources the run
holds until teardown (the bundle reservation, the standby pool, the preemption watcher,
the live worker group) and run-long facts: the nodes excluded by a preemption notice, the
nodes that stopped answering (``control/unreachable.py``) and whether a stop was asked
for. Data one state hands to the next is not here: it travels
in the state's payload (``control/states.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from typing import Any, Optional

from rayflex.config import TrainSpec
from rayflex.control.ledger import StepLedger
from rayflex.control.recorder import Recorder
from rayflex.control.cadence import CheckpointCadence
from rayflex.control.seams import Cluster, Reservation, StandbyPool, WorkerGroup
from rayflex.control.node_health import NodeHealth
from rayflex.control.unreachable import UnreachableNodes
from rayflex.faults.policy import Policies, best_world_size
from rayflex.mesh.plan import plan_mesh

log = logging.getLogger(__name__)


class RunContext:
    def __init__(self, spec: TrainSpec, cluster: Cluster, clock, policies: Optional[Policies] = None):
        self.spec, self.cluster, self.clock = spec, cluster, clock
        self.recorder = Recorder(spec.run, clock)
        self.ledger = StepLedger(spec.data, spec.checkpoint, self.recorder)
        self.policies = policies or Policies.for_spec(spec)
        self.cadence = (CheckpointCadence(spec.checkpoint, spec.run.steps, clock)
                        if spec.checkpoint.auto_interval else None)
        self.excluded: set[str] = set()  # nodes with a preemption notice: about to vanish
        self.pending_notices: list = []  # seen while an attempt started; its first poll acts on them
        self.unreachable = UnreachableNodes(cluster)  # frozen nodes Ray still lists
        # nodes checked before growth; held out until they pass (failed checks, evicted stragglers)
        self.health = NodeHealth(cluster, clock, self.policies.health,
                                 gpus_per_slot=1 if spec.scaling.use_gpu else 0)
        # a failed attempt's nodes Ray may declare dead later: node -> (its ranks, watched until)
        self.vanishing: dict[str, tuple[list[int], float]] = {}
        self.stop_requested = threading.Event()
        self.stop_reason = ""
        # Held until teardown.
        self.reservation: Optional[Reservation] = None
        self.standby: Optional[StandbyPool] = None
        self.watcher: Any = None
        self.keepers: Any = None  # memory replicas' keepers (CheckpointConfig.memory_replicas)
        self.group: Optional[WorkerGroup] = None  # the live attempt's workers (status, fault injection, teardown)
        self.plan: Any = None  # the live attempt's mesh
        # layout="auto": the first attempt's tp, which restarts keep while it fits (the node
        # shape fixed it; docs/parallelism.md).
        self.launch_tp: Optional[int] = None
        # CommConfig(replicate="auto"): the first attempt's pick, which every restart keeps.
        self.launch_replicate: Optional[tuple] = None

    @property
    def warm_restarts(self) -> bool:
        return self.spec.elastic.restart_while_warming

    def record(self, event):
        return self.recorder.record(event)

    # ----------------------------------------------------------------- capacity
    def usable_topology(self, avoid: frozenset | set = frozenset()):
        """The cluster's topology without excluded, held-out (and ``avoid``) nodes."""
        from rayflex.planning.topology import Topology

        topology = self.cluster.topology()
        for node in self.unreachable.refresh({n.node_id for n in topology.nodes}):
            log.warning("node %s answers again: usable for placement", node[:12])
        skip = self.left_out | set(avoid)
        if skip:
            topology = Topology(tuple(n for n in topology.nodes if n.node_id not in skip), topology.bandwidths)
        return topology

    @property
    def left_out(self) -> set[str]:
        """Nodes no placement uses now: a spot notice, not answering, or held out."""
        return self.excluded | self.unreachable.nodes | set(self.health.held_out)

    def usable_slots(self, topology=None) -> int:
        topology = topology if topology is not None else self.usable_topology()
        labels = self.spec.scaling.node_labels
        return sum(n.slots for n in topology.usable().nodes
                   if all(n.labels.get(k) == v for k, v in labels.items()))

    def best_size(self, topology=None) -> int:
        """The world size a restart would pick with the slots usable now (0: none)."""
        return best_world_size(self.spec, self.usable_slots(topology)) or 0

    def plan_at(self, size: int, topology):
        """(mesh, how the layout was chosen, placement) for ``size`` ranks on ``topology``.
        With layout="auto" the capacity planner picks the fastest mesh that fits, at every
        (re)start, keeping the launch tp while a mesh with it fits."""
        from rayflex.planning.capacity.auto import resolve_parallel
        from rayflex.planning.comm_profile import plan_for

        resolved = resolve_parallel(self.spec, size, topology, launch_tp=self.launch_tp,
                                    launch_replicate=self.launch_replicate)
        mesh = plan_mesh(self.spec.model, resolved.parallel, resolved.data, size,
                         memory=resolved.memory, replicate_choice=resolved.replicate_choice)
        return mesh, resolved, plan_for(self.spec, mesh, topology)  # PlacementError names what is missing

    @staticmethod
    def only_slots(topology, slots: dict[str, int]):
        """``topology`` cut down to ``slots`` (node -> workers)."""
        from rayflex.planning.topology import Topology

        return Topology(tuple(dataclasses.replace(n, slots=slots[n.node_id])
                              for n in topology.nodes if slots.get(n.node_id)), topology.bandwidths)

    # ----------------------------------------------------------------- resources
    def ensure_reservation(self):
        if self.reservation is None:
            self.reservation = self.cluster.reservation()
        return self.reservation

    def ensure_standby(self):
        if self.standby is None:
            self.standby = self.cluster.standby_pool(self.ensure_reservation(), lambda: self.plan)
        return self.standby

    def ensure_keepers(self):
        if self.keepers is None:
            self.keepers = self.cluster.replica_keepers()
        return self.keepers

    def workers_per_node(self, node_of: dict[int, str], skip_ranks=()) -> dict[str, int]:
        out: dict[str, int] = {}
        for rank, node in node_of.items():
            if rank not in skip_ranks:
                out[node] = out.get(node, 0) + 1
        return out

    def request_capacity(self) -> None:
        self.cluster.request_capacity()

    def alive_nodes(self) -> set[str]:
        return self.cluster.alive_nodes()

    def note_attempt(self, group, plan: Optional[Any]) -> None:
        self.group, self.plan = group, plan if plan is not None else self.plan
        if self.launch_tp is None and self.plan is not None:
            self.launch_tp = self.plan.tp
        if self.launch_replicate is None and self.plan is not None and self.plan.replicate_choice:
            self.launch_replicate = self.plan.replicate_choice
