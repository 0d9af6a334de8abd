"""The communication a run's mesh causes, and the placement plan that follows from it.

The communication profile comes from the model itself: parameter bytes per stage (FSDP
traffic inside each dp group) and activation bytes per microbatch (p2p traffic between
adjacent stages). The controller plans with :func:`plan_for` on every (re)start;
``Trainer.plan()`` and ``rayflex plan`` for a dry run against the live cluster or a
described topology.

Every CommProfile is made by :func:`build_comm_profile`: the run's (per microbatch, from a
MeshPlan) here, the capacity search's (per step, from a layout) by
:func:`layout_comm_profile`.
"""

from __future__ import annotations

from typing import Optional, Sequence

from rayflex.config import TrainSpec
from rayflex.mesh.plan import MeshPlan
from rayflex.planning.placement.planner import CommProfile, MeshShape, Plan, Planner
from rayflex.planning.topology import Topology

# fp32 on the CPU path; the activation width is the model's hidden size.
BYTES_PER_VALUE = 4


def build_comm_profile(stage_param_bytes: Sequence[float], activation_bytes: float,
                       microbatches: int) -> CommProfile:
    """The one builder of a CommProfile: parameter bytes of each pipeline rank (one entry
    per pp rank), bytes of one stage-boundary crossing, and crossings per step.

    FSDP reshards after forward exactly when there is no pipeline (``worker.parallelize``:
    a pipeline would gather every microbatch twice), so one stage means three collectives
    per step and several mean two.
    """
    return CommProfile(stage_param_bytes=tuple(stage_param_bytes), activation_bytes=float(activation_bytes),
                       microbatches=microbatches, reshard_after_forward=len(stage_param_bytes) == 1)


def layout_comm_profile(rank_params: Sequence[float], bytes_per_value: float, per_rank_tokens: int,
                        hidden_size: int, stages_per_rank: int, accum_steps: int) -> CommProfile:
    """The capacity search's profile of a layout (``rayflex plan`` places its choice with it).

    Per step rather than per microbatch: a crossing carries the rank's whole batch
    (``per_rank_tokens`` x ``hidden_size`` values), once per virtual stage. Without a
    pipeline, each of ``accum_steps`` passes gathers the parameters in forward and in
    backward and the gradients are reduced once: ``2a + 1`` of the three collectives the
    profile charges.
    """
    pp = len(rank_params)
    scale = (2 * accum_steps + 1) / 3 if pp == 1 else 1.0
    return build_comm_profile([p * bytes_per_value * scale for p in rank_params],
                              activation_bytes=per_rank_tokens * hidden_size * bytes_per_value,
                              microbatches=stages_per_rank)


def comm_profile(spec: TrainSpec, mesh: MeshPlan) -> CommProfile:
    """The run's profile of ``mesh``: per microbatch, as the workers will run it."""
    counts = spec.model.param_counts()
    # A pp rank holds stages_per_rank stages; its FSDP traffic is theirs together.
    stage_bytes = [0.0] * mesh.pp
    for stage, blocks in enumerate(mesh.stage_blocks):
        stage_bytes[stage % mesh.pp] += sum(counts[i] for i in blocks) * BYTES_PER_VALUE
    hidden = spec.model.hidden_size or 1
    activation = mesh.micro_batch * spec.data.seq_len * hidden * BYTES_PER_VALUE
    return build_comm_profile(stage_bytes, activation_bytes=activation,
                              microbatches=mesh.microbatches * mesh.accum_steps)


def plan_for(spec: TrainSpec, mesh: MeshPlan, topology: Optional[Topology] = None) -> Plan:
    """The placement plan for ``mesh`` on ``topology`` (default: the connected cluster)."""
    if topology is None:
        topology = Topology.from_ray(cpus_per_worker=spec.scaling.cpus_per_worker or 1.0,
                                     use_gpu=spec.scaling.use_gpu)
    return Planner(topology).plan(MeshShape(pp=mesh.pp, dp=mesh.dp), comm_profile(spec, mesh),
                                  require_labels=dict(spec.scaling.node_labels) or None)
