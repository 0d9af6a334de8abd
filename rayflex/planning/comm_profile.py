"""The communication a run's mesh causes, and the placement plan that follows from it.

The communication profile comes from the model itself: parameter bytes per stage (FSDP
traffic inside each dp group) and activation bytes per microbatch (p2p traffic between
adjacent stages). The controller plans with :func:`plan_for` on every (re)start;
``Trainer.plan()`` and ``rayflex plan`` for a dry run against the live cluster or a
described topology.
"""

from __future__ import annotations

from typing import Optional

from rayflex.config import TrainSpec
from rayflex.mesh.plan import MeshPlan
from rayflex.planning.placement.planner import CommProfile, MeshShape, Plan, Planner
from rayflex.planning.topology import Topology

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
