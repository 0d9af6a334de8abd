"""Modeled step time of a candidate mesh: compute, tensor-parallel all-reduces, the pipeline
bubble and the placement model's communication (seconds, no overlap assumed, so an upper
bound).

* compute: ``6 * P_rank * tokens_rank / (flops * mfu)``, where ``P_rank`` is the largest
  parameter count any pp rank holds of one tp shard (the slowest stage sets the pace) and
  ``tokens_rank = global_batch * seq_len / dp`` (the tp ranks of a dp rank see the same
  tokens); for balanced stages this is ``6 * P * T / (world * flops * mfu)``. A block that
  recomputes in backward (activation checkpointing) replays its forward, ``2 * P_block``
  more per token: ``(6 * P_rank + 2 * R_rank) * tokens_rank / (flops * mfu)`` on the busiest
  pp rank, ``R_rank`` the parameters it recomputes (the embedding's lookup has no matmul to
  replay, so it costs nothing).
* tensor parallelism: 4 all-reduces of a microbatch's hidden states (``b * s * h`` values)
  per transformer block, 1 for the embedding and 1 for the head plus its all-gather of the
  logits (``comm_profile.block_tp_allreduces``; 2 more per recomputed block), each a ring
  over the tp group:
  ``2 * (tp-1)/tp * bytes / bw(the tp group's tier)``. A tp group sits on one node, so that
  is NVLink. Priced by the placement cost model, charged at the slowest stage.
* bubble: ``(compute + TP) * (pp - 1) / (v * m)``: the pipeline runs ``m + pp - 1`` slots for
  ``m`` microbatches of work (1F1B and GPipe alike), interleaving cuts the idle slots by ``v``
  (Narayanan et al. 2021); the TP all-reduces sit inside every slot. As a fraction of the
  pipelined time it is ``(pp-1)/(v*m+pp-1)``.
* comm: the placement cost model (``rayflex.planning.cost_model``): FSDP all-gather and
  reduce-scatter of each stage's shard over its shard group's slowest link, the HSDP
  all-reduce across replicas, plus activations and their gradients across each stage
  boundary, on the better of two canonical layouts of the cluster (units of tp slots packed
  in rank order node by node, or pipelines packed node by node); the Planner refines the
  chosen mesh's placement afterwards. pp == 1 all-gathers each block in forward and again in
  backward for every accumulation pass: ``2k + 1`` collectives instead of the model's 3, so
  its bytes are scaled by ``(2k + 1) / 3``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from rayflex.mesh.plan import MeshPlan
from rayflex.planning.capacity.memory import CapacityError, ModelDescription
from rayflex.planning.comm_profile import block_tp_allreduces, layout_comm_profile
from rayflex.planning.cost_model import (CommProfile, CostBreakdown, GroupLevels, NodeTree, TierCosts,
                                         canonical_unit_orders, modeled_comm, price, unit_levels)
from rayflex.planning.topology import Topology


def rank_params(model: ModelDescription, layout: MeshPlan) -> list[float]:
    """Parameters one rank of each pp rank holds (all its virtual stages, its tp shard)."""
    params = model.split_over_tp(layout.tp).block_params
    per_stage = [sum(params[i] for i in blocks) for blocks in layout.stage_blocks]
    return [sum(per_stage[s] for s in layout.local_stages(i)) for i in range(layout.pp)]


def rank_recomputed_params(model: ModelDescription, layout: MeshPlan) -> list[float]:
    """Parameters of the blocks each pp rank recomputes in backward (its tp shard), the
    embedding left out (a lookup: no matmul to replay); zeros without checkpointing."""
    if not any(model.recompute_mask):
        return [0.0] * layout.pp
    params = model.split_over_tp(layout.tp).block_params
    blocks = model.blocks
    per_stage = [sum(params[i] for i in stage if blocks[i].recompute and blocks[i].kind != "embedding")
                 for stage in layout.stage_blocks]
    return [sum(per_stage[s] for s in layout.local_stages(i)) for i in range(layout.pp)]


def rank_compute_params(model: ModelDescription, layout: MeshPlan) -> tuple[float, float]:
    """``(P, R)`` of the busiest pp rank: the parameters it runs and those it recomputes,
    the rank with the most ``6 * P + 2 * R`` (the FLOPs per token it pays)."""
    pairs = zip(rank_params(model, layout), rank_recomputed_params(model, layout))
    return max(pairs, key=lambda pr: 6 * pr[0] + 2 * pr[1])


def rank_tp_allreduces(model: ModelDescription, layout: MeshPlan) -> list[float]:
    """Hidden-state all-reduces (equivalents) per microbatch each pp rank's tp group runs
    (0 without tp)."""
    if layout.tp == 1:
        return [0] * layout.pp
    vocab = model.vocab_size / model.hidden_size
    per_stage = [sum(block_tp_allreduces(model.blocks[i].kind, model.blocks[i].recompute, vocab) for i in blocks)
                 for blocks in layout.stage_blocks]
    return [sum(per_stage[s] for s in layout.local_stages(i)) for i in range(layout.pp)]


def layout_profile(model: ModelDescription, layout: MeshPlan, global_batch: int) -> CommProfile:
    """The CommProfile of a candidate (per step), as ``rayflex plan`` places it."""
    return layout_comm_profile(rank_params(model, layout), model.precision.param_bytes,
                               global_batch // layout.dp * model.seq_len, model.hidden_size,
                               layout.stages_per_rank, layout.accum_steps,
                               tp_allreduces=rank_tp_allreduces(model, layout) if layout.tp > 1 else ())


class CommModel:
    """Modeled communication of a candidate on the better of the canonical layouts. Where
    the groups land depends on (pp, dp, tp, dp_shard) only, so the levels are found once per
    shape and priced for each candidate's bytes."""

    def __init__(self, model: ModelDescription, topology: Topology, world: int, global_batch: int):
        self.model, self.world, self.global_batch = model, world, global_batch
        # zones, then racks, then node ids: the order the canonical layouts fill
        nodes = sorted(topology.usable().nodes, key=lambda nd: (nd.zone or "", nd.rack or "", nd.node_id))
        slots = sum(nd.slots for nd in nodes)
        if slots < world:
            raise CapacityError(f"the cluster has {slots} usable slots, fewer than the {world} ranks asked for")
        self.nodes, self.bandwidths = nodes, topology.bandwidths
        self.trees: dict = {}
        self.levels: dict = {}
        self.cache: dict = {}
        self.shared: Optional[dict] = None  # tp == 1 breakdowns, shared by for_model's copies

    def for_model(self, model: ModelDescription) -> "CommModel":
        """The same cluster, world and batch for ``model`` (the same sizes, other blocks
        recomputed): shares the group levels and, without tp (where recomputation moves no
        bytes), the priced breakdowns."""
        other = object.__new__(CommModel)
        other.__dict__.update(self.__dict__)
        other.model = model
        other.cache = {}
        if self.shared is None:
            self.shared = {}
        other.shared = self.shared
        return other

    def breakdown(self, layout: MeshPlan) -> CostBreakdown:
        key = (layout.pp, layout.stages_per_rank, layout.accum_steps, layout.tp, layout.dp_shard)
        shared = self.shared
        if layout.tp == 1 and shared is not None:  # no TP all-reduces: recomputation moves no bytes
            if key not in shared:
                shared[key] = self._price(layout)
            return shared[key]
        if key not in self.cache:
            self.cache[key] = self._price(layout)
        return self.cache[key]

    def _price(self, layout: MeshPlan) -> CostBreakdown:
        costs = TierCosts(layout, layout_profile(self.model, layout, self.global_batch), self.bandwidths)
        return min((price(costs, lv) for lv in self._levels(layout)), key=lambda ev: ev.total)

    def _levels(self, mesh: MeshPlan) -> list[GroupLevels]:
        key = (mesh.pp, mesh.tp, mesh.dp_shard)
        if key not in self.levels:
            if mesh.tp not in self.trees:
                self.trees[mesh.tp] = NodeTree(self.nodes, unit=mesh.tp)
            tree = self.trees[mesh.tp]
            self.levels[key] = [unit_levels(tree, mesh, order) for order in canonical_unit_orders(tree, mesh.units)]
        return self.levels[key]


def placed_breakdown(model: ModelDescription, layout: MeshPlan, global_batch: int, topology: Topology,
                     rank_to_node: Sequence[str]) -> CostBreakdown:
    """The modeled communication of a candidate at an explicit placement (a Plan's)."""
    return modeled_comm(topology, layout, layout_profile(model, layout, global_batch), rank_to_node)


@dataclass(frozen=True)
class StepTime:
    compute_s: float
    tp_s: float
    bubble_s: float
    comm_s: float  # FSDP + HSDP + pipeline (TP is tp_s)

    @property
    def total(self) -> float:
        return self.compute_s + self.tp_s + self.bubble_s + self.comm_s


def step_time(model: ModelDescription, layout: MeshPlan, flops: float, mfu: float, global_batch: int,
              comm: Optional[CostBreakdown]) -> StepTime:
    """The step's modeled seconds, term by term (module docstring)."""
    tokens_rank = global_batch // layout.dp * model.seq_len
    params, recomputed = rank_compute_params(model, layout)
    compute = (6 * params + 2 * recomputed) * tokens_rank / (flops * mfu)
    tp_s = comm.tp_total if comm is not None else 0.0
    comm_s = (comm.total - tp_s) if comm is not None else 0.0
    bubble = ((compute + tp_s) * (layout.pp - 1) / (layout.stages_per_rank * layout.microbatches)
              if layout.pp > 1 else 0.0)
    return StepTime(compute, tp_s, bubble, comm_s)
