"""The communication a training step cannot hide behind compute: what a placement adds to a step.

The cost model (``cost_model.py``) prices every collective in full: seconds of link time per
step, which is what the placement planner minimises (the link occupancy a placement causes,
known before any compute is). A step's time is its compute plus only the part of that
link time that sits on the step's critical path. :func:`exposed_comm` takes the cost
model's term-by-term seconds (a :class:`CostBreakdown` at the bandwidths that ran) and the
step's compute, and keeps what is exposed, term by term, from the mechanism:

* **FSDP all-gathers** gate the compute that needs the parameters. Without a pipeline a
  step gathers every block in forward and again in backward (``reshard_after_forward``), and
  the old model's full charge of the shard group's collectives held within 8% on the link
  bed: kept. The shard group's reduce-scatter shares its link with those backward gathers,
  so it is charged in full too. With a pipeline each stage gathers once per step, at its
  first forward, on the fill's critical path: the stages' gathers add up.
* **Data-parallel reductions without a pipeline** (DDP, HSDP's replica all-reduce) are issued
  per FSDP unit as backward produces each unit's gradients (FSDP2's post-backward hook,
  units in reverse order): a unit's all-reduce runs while backward computes the units before
  it. With ``n`` units of equal compute and all-reduce time ``T`` behind a backward of ``B``
  seconds, the last all-reduce ends ``max(T / n, T - B (n - 1) / n)`` after backward does
  (a flow shop of ``n`` jobs: the last unit's share at least, everything that does not fit in
  the remaining backward at most).
* **Reductions with a pipeline** run after a stage's last microbatch (torch.pipelining's
  ``perform_reduce_grad``, the schedule's REDUCE_GRAD after every backward), not during
  its backward. Stages reduce concurrently (disjoint groups, their own links), and stage
  ``s`` finishes its last backward ``s`` microbatch backwards (plus the gradient transfers
  between) before stage 0 does: exposed is ``max_s(R_s - slack_s)``.
* **Pipeline send/recv**: with ``p`` stages and ``m`` microbatches (1F1B or GPipe: ``m + p - 1``
  microbatch slots per stage per step), a transfer overlaps the other microbatches' compute;
  on the critical path are the first microbatch's activation crossing every boundary (fill)
  and the last microbatch's gradient crossing back (drain): ``2 * sum_b tau_b``, ``tau_b``
  one microbatch's transfer over boundary ``b``. When a transfer takes longer than a
  microbatch's compute on a stage the pipeline runs at the link's pace: each of the other
  ``m - 1`` microbatches adds ``tau_max - t_mb``.
* **Tensor parallelism**: its all-reduces sit inside each block's compute and wait for it:
  charged in full (the slowest stage's), as the cost model does.

Where each number comes from (nothing is fitted to step-time measurements):

* the link seconds: the cost model's bytes over the bandwidths of the tiers (on the link
  bed, its calibration measured send/recv at 0.98-1.00x of them,
  ``benchmarks/results/linkbed_calibrate.json``);
* ``compute_s``: the step's compute with free links; on the link bed the same layout's step
  measured on unshaped links in the same run (it holds the pipeline's bubble and every
  fixed cost, so it is an upper bound on the compute communication can hide behind);
* backward = 2/3 of the compute (a backward computes two matmuls per forward one: the
  ``6 P`` FLOPs per token of the capacity model, ``2 P`` forward and ``4 P`` backward);
* per-microbatch compute of a stage = ``compute_s / (v m + p - 1)``: the schedule's slots
  per step (``v`` virtual stages per rank, 1 but for interleaving);
* the number of reduction units: the FSDP units of a stage (``fully_shard`` per block,
  ``rayflex.worker.parallelize.shard_stage``), taken as of equal compute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from rayflex.mesh.plan import MeshPlan
from rayflex.planning.cost_model import CommProfile, CostBreakdown

BACKWARD_SHARE = 2.0 / 3.0  # backward FLOPs over forward + backward (4P of 6P per token)


@dataclass(frozen=True)
class ExposedComm:
    """Seconds per step of each term that the step cannot hide behind compute."""

    all_gather_s: float
    reduction_s: float  # FSDP reduce-scatter + the data-parallel all-reduce
    p2p_s: float
    tp_s: float

    @property
    def total(self) -> float:
        return self.all_gather_s + self.reduction_s + self.p2p_s + self.tp_s

    def to_dict(self) -> dict:
        return {"all_gather_s": self.all_gather_s, "reduction_s": self.reduction_s, "p2p_s": self.p2p_s,
                "tp_s": self.tp_s, "total_s": self.total}


def hidden_reduction(allreduce_s: float, backward_s: float, units: int) -> float:
    """What a per-unit reduction issued during backward leaves after it: ``units`` reductions
    of ``allreduce_s / units`` each, the k-th ready once backward has done k of its
    ``units`` equal parts, run one at a time on the link (a flow shop). At least the last
    unit's share (its gradient is ready only when backward ends), at most everything that
    does not fit in the backward left after the first unit."""
    if allreduce_s <= 0:
        return 0.0
    units = max(1, units)
    return max(allreduce_s / units, allreduce_s - backward_s * (units - 1) / units)


def pipeline_p2p(transfer_s: Sequence[float], microbatch_s: float, microbatches: int) -> float:
    """Exposed send/recv of a pipeline: ``transfer_s[b]`` one microbatch's crossing of
    boundary ``b`` (activations forward; their gradients, the same bytes, backward),
    ``microbatch_s`` a microbatch's forward + backward on a stage. Fill and drain cross every
    boundary once each way; a transfer slower than a microbatch's compute sets the pace of
    the other ``microbatches - 1``."""
    if not transfer_s:
        return 0.0
    pace = max(0.0, max(transfer_s) - microbatch_s) * (microbatches - 1)
    return 2 * sum(transfer_s) + pace


def pipeline_reduction(reduce_s: Sequence[float], transfer_s: Sequence[float], microbatch_s: float) -> float:
    """Exposed gradient reductions of a pipeline: stage ``s`` reduces (``reduce_s[s]``) after
    its last backward, which ends ``sum_{b<s} (backward + transfer_b)`` before stage 0's; the
    stages reduce concurrently, so the step waits for the latest."""
    backward = BACKWARD_SHARE * microbatch_s
    slack, latest = 0.0, 0.0
    for s, r in enumerate(reduce_s):
        if s:
            slack += backward + transfer_s[s - 1]
        latest = max(latest, r - slack)
    return latest


def exposed_comm(mesh: MeshPlan, profile: CommProfile, breakdown: CostBreakdown, compute_s: float,
                 units: int = 1, stages_per_rank: int = 1) -> ExposedComm:
    """The exposed part of each of ``breakdown``'s terms (module docstring).

    ``breakdown``: the cost model's seconds for the placement at the bandwidths that ran
    (``cost_model.modeled_comm``); ``compute_s``: the step with free links; ``units``: the
    FSDP units (blocks) of a stage, the reductions' granularity without a pipeline;
    ``stages_per_rank``: virtual stages per rank (interleaved schedules).
    """
    n = profile.fsdp_collectives
    fsdp = list(breakdown.fsdp_s)
    replica = list(breakdown.replica_s) or [0.0] * len(fsdp)
    gathers = [f * (n - 1) / n for f in fsdp]
    scatters = [f / n for f in fsdp]
    passes = profile.microbatches
    if mesh.pp == 1:
        backward = BACKWARD_SHARE * compute_s / passes  # the reductions ride on the last pass only
        reduction = sum(scatters) + sum(hidden_reduction(r, backward, units) for r in replica)
        return ExposedComm(sum(gathers), reduction, 0.0, breakdown.tp_total)
    microbatch = compute_s / (stages_per_rank * passes + mesh.pp - 1)
    transfer = [p / (2 * passes) for p in breakdown.p2p_s]  # the cost model's 2 A M / bw per boundary
    reduction = pipeline_reduction([s + r for s, r in zip(scatters, replica)], transfer, microbatch)
    return ExposedComm(sum(gathers), reduction, pipeline_p2p(transfer, microbatch, passes), breakdown.tp_total)


def step_seconds(mesh: MeshPlan, profile: CommProfile, breakdown: CostBreakdown, compute_s: float,
                 units: int = 1, stages_per_rank: int = 1) -> float:
    """A step's modeled seconds: compute plus the communication it cannot hide."""
    return compute_s + exposed_comm(mesh, profile, breakdown, compute_s, units, stages_per_rank).total
