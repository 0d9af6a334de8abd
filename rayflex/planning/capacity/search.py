"""Which pp x dp x tp mesh, FSDP shard groups, schedule and microbatching to run: enumerate,
discard what does not fit, model the step time, rank, and explain.

Two levels, as in Alpa: the stage split is a dynamic program over contiguous block ranges
(``balanced_split``, the very function the workers use, so the stages modeled are the
stages built), and inside a stage tensor parallelism splits every block over ``tp`` ranks of
one node while FSDP2 shards over the dp ranks (or HSDP: shard groups of ``dp_shard``,
replicated). The candidates are :mod:`.layouts`' (every mesh ``rayflex.mesh.rules`` admits,
tp limited to what a node holds and the model can split), memory per rank is :mod:`.memory`'s
and the step time :mod:`.step_time`'s; :mod:`.explain` says why the winner won.

``best_parallel_config`` is the launcher's entry (``ParallelConfig(layout="auto")``), called
for every world size a run starts or restarts at.

Activation checkpointing: the run's ``MemoryConfig`` is priced as given, unless it is
``activation_checkpointing="auto"``: then every layout is tried with no recomputation, every
``ac_every``-th block (default 2) and every block (:func:`ac_options`), and the fastest that
fits is kept. Recomputation only adds time (a block's forward once more, and with tp its
forward all-reduces) and only saves memory, so a layout stops at its first option that
fits; a layout that fits with none keeps the one with the smallest peak (or, when what
no recomputation removes is already too much, the first: ``MemoryEstimate.fixed_bytes``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

from rayflex.errors import ConfigError
from rayflex.mesh.plan import MeshPlan
from rayflex.planning.capacity.cluster import ClusterDescription, DeviceSpec
from rayflex.planning.capacity.candidates import Candidate, SearchResult, ac_name, group_tiers
from rayflex.planning.capacity.explain import explain
from rayflex.planning.capacity.failures import FailureCost
from rayflex.planning.capacity.layouts import enumerate_layouts, tier_units, tp_degrees
from rayflex.planning.capacity.memory import (CapacityError, ModelDescription, Runtime,
                                              describe_model, estimate_memory, fmt_bytes, rank_exceeds)
from rayflex.planning.capacity.step_time import CommModel, rank_params, step_time
from rayflex.planning.cost_model import CostBreakdown
from rayflex.planning.topology import Topology

__all__ = ["Candidate", "ClusterDescription", "DeviceSpec", "ParallelChoice", "SearchResult", "ac_name", "ac_options",
           "group_tiers", "best_parallel_config", "describe_model", "enumerate_layouts", "evaluate_layout", "explain", "search"]

SCHEDULE_ORDER = ("none", "1f1b", "interleaved", "gpipe")
_rank_params = rank_params  # the name `rayflex plan` used


def evaluate_layout(model: ModelDescription, cluster: ClusterDescription, layout: MeshPlan, global_batch: int,
                    comm: CostBreakdown, ac=None) -> Candidate:
    """A layout's memory and modeled step time with its communication priced as ``comm``
    (the search's canonical placement, or a Plan's: ``step_time.placed_breakdown``).
    ``ac``: the MemoryConfig ``model``'s recompute flags come from, when the search chose it."""
    mem = estimate_memory(model, layout, cluster.runtime)
    t = step_time(model, layout, cluster.device.flops, cluster.device.mfu, global_batch, comm)
    extra = {} if ac is None else {"activation_checkpointing": ac.activation_checkpointing, "ac_every": ac.ac_every}
    return Candidate(layout, mem, mem.peak_bytes <= cluster.usable_bytes, cluster.usable_bytes, t.compute_s,
                     t.bubble_s, t.comm_s, t.tp_s, comm, model=model, **extra)


# ------------------------------------------------------------------------------ activation checkpointing
def ac_options(memory_config) -> tuple:
    """The MemoryConfigs ``activation_checkpointing="auto"`` tries, least recomputation first:
    "none", "every_k" at the config's ``ac_every`` (2 unless set; left out at 1, which is
    "full") and "full"; the rest of the config (compile, ...) as given."""
    out = [replace(memory_config, activation_checkpointing="none")]
    if memory_config.ac_every > 1:
        out.append(replace(memory_config, activation_checkpointing="every_k"))
    out.append(replace(memory_config, activation_checkpointing="full"))
    return tuple(out)


# ------------------------------------------------------------------------------ search
def search(model: ModelDescription, cluster: ClusterDescription, *, global_batch: int,
           world_size: Optional[int] = None, schedules: Sequence[str] = ("gpipe", "1f1b", "interleaved"),
           max_stages_per_rank: int = 4, max_microbatches: int = 0, require_fit: bool = True,
           tp: Optional[Iterable[int]] = None, hsdp: bool = True,
           activation_checkpointing: Optional[Sequence] = None,
           failures: Optional[FailureCost] = None) -> SearchResult:
    """Rank every mesh for ``model`` on ``cluster``; raise CapacityError if none fits.

    ``tp``: only these tensor-parallel degrees (default: every divisor of the node size the
    model can take); ``hsdp=False``: plain FSDP only. ``activation_checkpointing``: MemoryConfigs
    to try on every layout, least recomputation first (:func:`ac_options`); each replaces
    ``model``'s recompute flags, and a layout keeps its first that fits (the module
    docstring). None: ``model`` as described. ``failures``: rank fitting meshes by their step
    time stretched by what the expected failures take from training (:mod:`.failures`:
    a mesh with replicas recovers from live peers, one without trains steps again).
    """
    options = tuple(activation_checkpointing or ())
    t0 = time.perf_counter()
    world = world_size or cluster.slots
    if world < 1 or world > cluster.slots:
        raise CapacityError(f"world size {world} is outside the cluster's 1..{cluster.slots} usable slots")
    if global_batch < 1:
        raise ConfigError("global_batch", f"must be >= 1, got {global_batch}", "give the batch in samples")
    _check_state_fits(model, cluster, world)
    topology = cluster.topology
    comm = CommModel(model, topology, world, global_batch)
    variants = [(None, model, comm)]  # (AC option, the model with its recompute flags, its CommModel)
    if options:
        models = [model.with_checkpointing(ac) for ac in options]
        variants = [(ac, m, comm.for_model(m)) for ac, m in zip(options, models)]
    degrees, skipped = tp_degrees(model, topology, world, tp)
    tiers = {d: tier_units(topology, d) for d in degrees} if hsdp else {}
    candidates = []
    for item in enumerate_layouts(model, world, global_batch, schedules=schedules,
                                  max_stages_per_rank=max_stages_per_rank, max_microbatches=max_microbatches,
                                  tp_options=degrees, tiers=tiers):
        if isinstance(item, tuple):
            skipped.append(item[1:])
            continue
        candidates.append(_evaluate_options(cluster, item, global_batch, variants))
    if not candidates:
        raise CapacityError(f"no mesh of {world} ranks can take global batch {global_batch} for {model.name}: "
                            + "; ".join(f"{w}: {why}" for w, why in skipped))
    candidates.sort(key=lambda c: _rank_key(c, failures))
    at_best = ()
    if options:
        lay = candidates[0].layout
        at_best = tuple(evaluate_layout(m, cluster, lay, global_batch, cm.breakdown(lay), ac)
                        for ac, m, cm in variants)
    result = SearchResult(model, cluster, world, global_batch, tuple(candidates), tuple(skipped),
                          time.perf_counter() - t0, options, at_best, failures=failures)
    result = replace(result, explanation=explain(result))
    if require_fit and not candidates[0].fits:
        raise CapacityError(_nothing_fits(result))
    return result


def _evaluate_options(cluster: ClusterDescription, layout: MeshPlan, global_batch: int, variants) -> Candidate:
    """The layout's candidate: with one variant, it; with AC options (least recomputation
    first), the first that fits (recomputation only adds time), else the last (it only saves
    memory: the smallest peak). A layout whose memory without recomputation is already over
    the device in terms no recomputation removes (``MemoryEstimate.fixed_bytes``) is not
    tried further and keeps that candidate; an option in between is first asked of the pp
    rank that peaked without recomputation, and only estimated whole if that rank fits."""
    ac, m, cm = variants[0]
    first = evaluate_layout(m, cluster, layout, global_batch, cm.breakdown(layout), ac)
    if first.fits or len(variants) == 1 or first.memory.fixed_bytes > cluster.usable_bytes:
        return first
    worst = first.memory.peak_rank.pp_index
    for ac, m, cm in variants[1:-1]:
        if rank_exceeds(m, layout, worst, cluster.usable_bytes, cluster.runtime):
            continue
        c = evaluate_layout(m, cluster, layout, global_batch, cm.breakdown(layout), ac)
        if c.fits:
            return c
    ac, m, cm = variants[-1]
    return evaluate_layout(m, cluster, layout, global_batch, cm.breakdown(layout), ac)


def _rank_key(c: Candidate, failures: Optional[FailureCost] = None):
    lay = c.layout
    step_s = failures.effective_step_s(lay, c.step_s) if failures is not None else c.step_s
    return (not c.fits, round(step_s, 9) if c.fits else c.peak_bytes, c.peak_bytes,
            SCHEDULE_ORDER.index(lay.schedule), lay.pp, lay.tp, lay.dp_replicate)


def _check_state_fits(model: ModelDescription, cluster: ClusterDescription, world: int) -> None:
    """Parameters, gradients and optimizer states alone must fit the whole cluster."""
    p = model.precision
    per_param = p.sharded_bytes * (2 + p.optimizer_states)
    need = model.total_params * per_param
    have = world * cluster.usable_bytes
    if need > have:
        raise CapacityError(
            f"{model.name} cannot fit on {world} devices: its {model.total_params / 1e9:.2f}B parameters need "
            f"{per_param} B each for the parameter, its gradient and {p.optimizer_states} optimizer states "
            f"= {fmt_bytes(need)}, but {world} x {fmt_bytes(cluster.usable_bytes)} usable = {fmt_bytes(have)} "
            f"(before any activation). Fix: at least {math.ceil(need / cluster.usable_bytes)} devices of this kind.")


def _nothing_fits(result: SearchResult) -> str:
    c = result.candidates[0]
    r = c.memory.peak_rank
    tps = sorted({x.layout.tp for x in result.candidates})
    return (f"no mesh of {result.world_size} ranks fits {result.model.name} "
            f"({result.model.total_params / 1e9:.2f}B params, seq {result.model.seq_len}, global batch "
            f"{result.global_batch}) in {fmt_bytes(c.usable_bytes)} usable per device"
            + (f" (tried tp={', '.join(map(str, tps))})" if tps != [1] else "")
            + (" with activation checkpointing " + ", ".join(
                f"'{ac_name(m.activation_checkpointing, m.ac_every)}'" for m in result.ac_options)
               if result.ac_searched else "")
            + f". The smallest peak is {fmt_bytes(c.peak_bytes)} ({c.label()}, pp rank {r.pp_index}, {r.phase}): "
            f"{r.breakdown()}. Fix: more devices, a smaller seq_len or micro-batch"
            + ("." if result.ac_searched or all(result.model_of(c).recompute_mask) else
               ", or activation recomputation (MemoryConfig(activation_checkpointing='full'), or 'auto' with "
               "layout='auto')."))


# ------------------------------------------------------------------------------ for the launcher
@dataclass(frozen=True)
class ParallelChoice:
    """What ``ParallelConfig(layout="auto")`` needs: the chosen ``mesh`` (its degrees, schedule,
    microbatches or accumulation micro-batch), why, and the activation checkpointing the run
    applies (``activation_checkpointing`` / ``ac_every``: the planner's pick when the run's
    MemoryConfig said "auto", else the run's own; "none" without a MemoryConfig)."""

    mesh: MeshPlan
    explanation: str
    candidate: Optional[Candidate] = None
    activation_checkpointing: str = "none"
    ac_every: int = 2


def as_cluster(cluster) -> ClusterDescription:
    """A ClusterDescription from one, a path to its YAML, a dict, or a Topology (then the
    devices are this host's CPUs)."""
    if isinstance(cluster, (str, Path)):
        return ClusterDescription.from_file(cluster)
    if isinstance(cluster, Mapping):
        return ClusterDescription.from_dict(cluster)
    if isinstance(cluster, Topology):
        return ClusterDescription(topology=cluster, device=DeviceSpec.local_cpu(cluster.usable().total_slots),
                                  runtime=Runtime.cpu())
    return cluster


def best_parallel_config(model_spec_or_description, cluster, world_size: int, global_batch: int,
                         seq_len: int, *, precision_config=None, memory_config=None, comm_config=None,
                         **search_kwargs) -> ParallelChoice:
    """The fastest mesh that fits, for the launcher and every elastic restart.

    ``cluster``: see :func:`as_cluster`. ``precision_config`` / ``memory_config``: the run's
    ``TrainSpec.precision`` / ``.memory`` (bf16 compute, activation checkpointing); ``comm_config``
    its ``.comm`` (DiLoCo's and int8's shard-sized state per rank); None
    plans fp32 without recomputation. ``memory_config.activation_checkpointing == "auto"``
    searches the mode too (:func:`ac_options`). ``search_kwargs`` go to :func:`search`
    (``tp=[8]`` keeps a tp). Raises CapacityError when nothing fits.
    """
    cluster = as_cluster(cluster)
    auto_ac = memory_config is not None and memory_config.activation_checkpointing == "auto"
    model = describe_model(model_spec_or_description, seq_len).for_run(precision_config,
                                                                       None if auto_ac else memory_config,
                                                                       comm_config)
    if auto_ac:
        search_kwargs.setdefault("activation_checkpointing", ac_options(memory_config))
    result = search(model, cluster, global_batch=global_batch, world_size=world_size, **search_kwargs)
    best = result.best
    if best.activation_checkpointing is not None:
        ac = dict(activation_checkpointing=best.activation_checkpointing, ac_every=best.ac_every)
    elif memory_config is not None:
        ac = dict(activation_checkpointing=memory_config.activation_checkpointing, ac_every=memory_config.ac_every)
    else:
        ac = {}
    return ParallelChoice(best.layout, result.explanation, candidate=best, **ac)
