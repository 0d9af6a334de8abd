"""Where a run's ranks go: from a TrainSpec and its mesh plan to a topology-aware Plan.

The controller calls :func:`place_run` on every (re)start; ``Trainer.plan()`` and
``rayflex plan`` call :func:`plan_for` for a dry run against the live cluster or a
described topology. The communication profile comes from the model itself: parameter
bytes per stage (FSDP traffic inside each dp group) and activation bytes per microbatch
(p2p traffic between adjacent stages).
"""

from __future__ import annotations

from typing import Any, Optional

from rayflex.actors.parallel import MeshPlan
from rayflex.config import TrainSpec
from rayflex.platform.placement import CommProfile, MeshShape, Plan, PlacementManager, Planner
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


def place_run(spec: TrainSpec, mesh: MeshPlan) -> tuple[PlacementManager, list[Any], dict]:
    """Plan, reserve bundles pinned to the planned nodes, and return the per-rank
    scheduling strategies plus what the PlanChosen event records."""
    plan = plan_for(spec, mesh)
    manager = PlacementManager(plan, spec.scaling.worker_resources(), name=f"rayflex-{spec.run.name}")
    manager.place()
    strategies = [manager.scheduling_strategy(r) for r in range(mesh.world_size)]
    info = {"modeled_comm_s": plan.modeled_comm_s, "naive_comm_s": plan.naive_comm_s,
            "explanation": plan.explanation, "planned_rank_to_node": list(plan.rank_to_node)}
    return manager, strategies, info
