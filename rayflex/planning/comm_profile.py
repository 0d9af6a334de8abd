"""The communication a run's mesh causes, and the placement plan that follows from it.

The communication profile comes from the model itself: parameter bytes per stage (FSDP
traffic inside each dp group, of one rank's tp shard), activation bytes per microbatch (p2p
traffic between adjacent stages) and, with tensor parallelism, the bytes of the tp group's
activation all-reduces (Megatron-style blocks: :data:`TP_ALLREDUCES`). The controller plans
with :func:`plan_for` on every (re)start; ``Trainer.plan()`` and ``rayflex plan`` for a dry
run against the live cluster or a described topology.

Every CommProfile is made by :func:`build_comm_profile`: the run's (per microbatch, from a
MeshPlan) here, the capacity search's (per step, from a layout) by
:func:`layout_comm_profile`.
"""

from __future__ import annotations

from typing import Optional, Sequence

from rayflex.config import TrainSpec
from rayflex.mesh.plan import MeshPlan
from rayflex.planning.placement.planner import CommProfile, Plan, Planner, naive_plan, shuffled_plan
from rayflex.planning.topology import Topology

# fp32 on the CPU path; the activation width is the model's hidden size.
BYTES_PER_VALUE = 4

# All-reduces of one microbatch's hidden states (b x s x h values) a tp rank issues per
# block, forward + backward, under the Megatron-style split the workers apply
# (rayflex.models.tp_plan): a transformer block's rowwise o_proj and MLP down projection
# each all-reduce their output in forward and their colwise partners' input gradients in
# backward (2 + 2); the vocab-split embedding all-reduces its output (forward only: token ids
# have no gradient); the vocab-split head all-reduces its input gradient in backward and
# all-gathers the logits in forward (``colwise_gather_output``), counted in :func:`
# block_tp_allreduces`. A recomputed block replays its forward in backward: its forward
# all-reduces once more.
TP_ALLREDUCES = {"embedding": 1, "transformer": 4, "head": 1, "other": 4}
RECOMPUTE_TP_ALLREDUCES = {"embedding": 1, "transformer": 2, "head": 0, "other": 2}


def block_tp_allreduces(kind: str, recompute: bool = False, vocab_per_hidden: float = 0.0) -> float:
    """Hidden-state all-reduces per microbatch a tp rank issues for one block of ``kind``, in
    all-reduce equivalents: the head's all-gather of ``vocab`` logits per token moves what an
    all-reduce of ``vocab / 2`` values does (a ring all-gather is half a ring all-reduce), so
    it counts ``vocab_per_hidden / 2``."""
    n = TP_ALLREDUCES[kind] + (RECOMPUTE_TP_ALLREDUCES[kind] if recompute else 0)
    return n + (vocab_per_hidden / 2 if kind == "head" else 0.0)


def spec_block_kinds(num_blocks: int) -> list[str]:
    """Block kinds of a rayflex ModelSpec: embedding first, head last (the model contract),
    transformer blocks between."""
    if num_blocks < 3:
        return ["other"] * num_blocks
    return ["embedding"] + ["transformer"] * (num_blocks - 2) + ["head"]


def build_comm_profile(stage_param_bytes: Sequence[float], activation_bytes: float,
                       microbatches: int, tp_allreduce_bytes: Sequence[float] = ()) -> CommProfile:
    """The one builder of a CommProfile: parameter bytes of each pipeline rank (one entry
    per pp rank, of one tp shard), bytes of one stage-boundary crossing, crossings per step,
    and (tp > 1) each pp rank's TP all-reduce bytes per step.

    FSDP reshards after forward exactly when there is no pipeline (``worker.parallelize``:
    a pipeline would gather every microbatch twice), so one stage means three collectives
    per step and several mean two.
    """
    return CommProfile(stage_param_bytes=tuple(stage_param_bytes), activation_bytes=float(activation_bytes),
                       microbatches=microbatches, reshard_after_forward=len(stage_param_bytes) == 1,
                       tp_allreduce_bytes=tuple(tp_allreduce_bytes))


def layout_comm_profile(rank_params: Sequence[float], bytes_per_value: float, per_rank_tokens: int,
                        hidden_size: int, stages_per_rank: int, accum_steps: int,
                        tp_allreduces: Sequence[float] = ()) -> CommProfile:
    """The capacity search's profile of a layout (``rayflex plan`` places its choice with it).

    ``rank_params``: parameters of one rank of each pp rank (its tp shard). Per step rather
    than per microbatch: a crossing carries the rank's whole batch (``per_rank_tokens`` x
    ``hidden_size`` values), once per virtual stage. Without a pipeline, each of
    ``accum_steps`` passes gathers the parameters in forward and in backward and the
    gradients are reduced once: ``2a + 1`` of the three collectives the profile charges.
    ``tp_allreduces``: per pp rank, the hidden-state all-reduces of one microbatch
    (:func:`block_tp_allreduces` summed over its blocks); each moves the microbatch's hidden
    states, so per step they move ``count x per_rank_tokens x hidden_size`` values.
    """
    pp = len(rank_params)
    scale = (2 * accum_steps + 1) / 3 if pp == 1 else 1.0
    step_hidden = per_rank_tokens * hidden_size * bytes_per_value
    return build_comm_profile([p * bytes_per_value * scale for p in rank_params],
                              activation_bytes=step_hidden, microbatches=stages_per_rank,
                              tp_allreduce_bytes=[n * step_hidden for n in tp_allreduces])


def comm_profile(spec: TrainSpec, mesh: MeshPlan) -> CommProfile:
    """The run's profile of ``mesh``: per microbatch, as the workers will run it (a rank
    holds 1/tp of every block: the Megatron-style split shards embedding, blocks and head).
    The blocks recomputed are the mesh's (``MeshPlan.memory_config``: the planner's pick under
    ``MemoryConfig(activation_checkpointing="auto")``), else the spec's."""
    memory = mesh.memory_config(spec.memory)
    counts = spec.model.param_counts()
    kinds = spec_block_kinds(len(counts))
    hidden = spec.model.hidden_size or 1
    vocab_per_hidden = counts[-1] / hidden / hidden  # the head's weight is vocab x hidden
    # A pp rank holds stages_per_rank stages; its FSDP traffic is theirs together.
    stage_bytes = [0.0] * mesh.pp
    allreduces = [0.0] * mesh.pp
    for stage, blocks in enumerate(mesh.stage_blocks):
        stage_bytes[stage % mesh.pp] += sum(counts[i] for i in blocks) * BYTES_PER_VALUE / mesh.tp
        allreduces[stage % mesh.pp] += sum(block_tp_allreduces(kinds[i], memory.checkpointed(i),
                                                               vocab_per_hidden) for i in blocks)
    activation = mesh.micro_batch * spec.data.seq_len * hidden * BYTES_PER_VALUE
    passes = mesh.microbatches * mesh.accum_steps
    tp_bytes = [n * activation * passes for n in allreduces] if mesh.tp > 1 else []
    return build_comm_profile(stage_bytes, activation_bytes=activation, microbatches=passes,
                              tp_allreduce_bytes=tp_bytes)


def plan_for(spec: TrainSpec, mesh: MeshPlan, topology: Optional[Topology] = None) -> Plan:
    """The placement plan for ``mesh`` on ``topology`` (default: the connected cluster): each
    tp group on one node, FSDP/HSDP groups and pipelines placed by the cost model."""
    if topology is None:
        topology = Topology.from_ray(cpus_per_worker=spec.scaling.cpus_per_worker or 1.0,
                                     use_gpu=spec.scaling.use_gpu)
    profile, labels = comm_profile(spec, mesh), dict(spec.scaling.node_labels) or None
    how, _, seed = spec.scaling.placement.partition(":")
    if how == "node_order":
        return naive_plan(topology, mesh, profile, require_labels=labels)
    if how == "shuffled":
        return shuffled_plan(topology, mesh, profile, int(seed), require_labels=labels)
    return Planner(topology).plan(mesh, profile, require_labels=labels)
