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
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence

from rayflex.errors import ConfigError
from rayflex.planning.capacity.cluster import ClusterDescription, DeviceSpec
from rayflex.planning.capacity.explain import ordinal, ac_name, explain
from rayflex.planning.capacity.layouts import enumerate_layouts, tier_units, tp_degrees
from rayflex.planning.capacity.memory import (GB, CapacityError, Layout, MemoryEstimate, ModelDescription, Runtime,
                                              describe_model, estimate_memory, fmt_bytes, rank_exceeds)
from rayflex.planning.capacity.step_time import CommModel, rank_params, step_time
from rayflex.planning.cost_model import CostBreakdown
from rayflex.planning.topology import Topology

__all__ = ["Candidate", "ClusterDescription", "DeviceSpec", "ParallelChoice", "SearchResult", "ac_name", "ac_options",
           "best_parallel_config", "describe_model", "enumerate_layouts", "evaluate_layout", "explain", "search"]

SCHEDULE_ORDER = ("none", "1f1b", "interleaved", "gpipe")
_rank_params = rank_params  # the name `rayflex plan` used


# ------------------------------------------------------------------------------ candidates
@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    fits: bool
    usable_bytes: float
    compute_s: float
    bubble_s: float
    comm_s: float  # FSDP (+ HSDP) + pipeline
    tp_s: float = 0.0  # TP all-reduces
    comm: Optional[CostBreakdown] = None  # the priced placement, term by term
    # The activation checkpointing it was priced with when the search chose it
    # (MemoryConfig(activation_checkpointing="auto")); None: the model's own, not searched.
    activation_checkpointing: Optional[str] = None
    ac_every: int = 2
    # The description it was evaluated with (its blocks' recompute flags are the AC above).
    model: Optional[ModelDescription] = field(default=None, repr=False, compare=False)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.tp_s + self.bubble_s + self.comm_s

    @property
    def peak_bytes(self) -> float:
        return self.memory.peak_bytes

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the pipelined time: ``(pp-1)/(v*m + pp-1)``."""
        work = self.compute_s + self.tp_s + self.bubble_s
        return self.bubble_s / work if work else 0.0

    def mesh_label(self) -> str:
        """``pp=2 x dp=4 x tp=8``, ``pp=1 x dp=64(2x32 hsdp) x tp=8``."""
        lay = self.layout
        dp = f"dp={lay.dp}" + (f"({lay.dp_replicate}x{lay.shard} hsdp)" if lay.dp_replicate > 1 else "")
        return " x ".join([f"pp={lay.pp}", dp] + ([f"tp={lay.tp}"] if lay.tp > 1 else []))

    def label(self) -> str:
        lay = self.layout
        ac = self.ac_label()
        if lay.pp == 1:
            return f"{self.mesh_label()} fsdp, micro {lay.micro_batch} x accum {lay.accum_steps}{ac}"
        v = f" v={lay.stages_per_rank}" if lay.stages_per_rank > 1 else ""
        return f"{self.mesh_label()} {lay.schedule}{v}, m={lay.microbatches} x {lay.micro_batch}{ac}"

    def ac_label(self) -> str:
        """``, AC full`` / ``, AC every 2nd`` when the search chose recomputation; else ""."""
        mode = self.activation_checkpointing
        if mode in (None, "none"):
            return ""
        return ", AC full" if mode == "full" else f", AC every {ordinal(self.ac_every)}"

    def to_dict(self) -> dict:
        lay = self.layout
        peak = self.memory.peak_rank
        out = {"pp": lay.pp, "dp": lay.dp, "tp": lay.tp, "dp_shard": lay.shard, "dp_replicate": lay.dp_replicate,
               "schedule": lay.schedule, "stages_per_rank": lay.stages_per_rank,
               "microbatches": lay.microbatches, "micro_batch": lay.micro_batch, "accum_steps": lay.accum_steps,
               "fits": self.fits, "peak_bytes": self.peak_bytes, "usable_bytes": self.usable_bytes,
               "peak_pp_rank": peak.pp_index, "peak_phase": peak.phase, "peak_breakdown": peak.to_dict(),
               "step_s": self.step_s, "compute_s": self.compute_s, "tp_s": self.tp_s, "bubble_s": self.bubble_s,
               "bubble_fraction": self.bubble_fraction, "comm_s": self.comm_s,
               "stage_blocks": [list(s) for s in lay.stage_blocks],
               "activation_checkpointing": self.activation_checkpointing, "ac_every": self.ac_every}
        if self.comm is not None:
            out["tiers"] = group_tiers(self.comm)
        return out


def group_tiers(comm: CostBreakdown) -> dict:
    """The worst link tier of each kind of group in a priced placement."""
    from rayflex.planning.topology import LinkTier

    def worst(levels):
        return LinkTier(max(levels)).name if levels else None

    return {"tp": worst(comm.tp_levels), "fsdp_shard": worst(comm.row_levels),
            "hsdp_replicate": worst(comm.replica_levels), "pipeline": worst(comm.boundary_levels)}


@dataclass(frozen=True)
class SearchResult:
    model: ModelDescription
    cluster: ClusterDescription
    world_size: int
    global_batch: int
    candidates: tuple  # every candidate, ranked: fitting first by step time
    skipped: tuple  # (what, why) for meshes (and tp degrees) the batch, node or model cannot take
    search_s: float = 0.0
    # With activation checkpointing searched: the options tried (MemoryConfigs, least
    # recomputation first) and the chosen layout priced with each of them, in that order.
    ac_options: tuple = ()
    ac_at_best: tuple = ()

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def fitting(self) -> list:
        return [c for c in self.candidates if c.fits]

    @property
    def ac_searched(self) -> bool:
        return bool(self.ac_options)

    def model_of(self, c: Candidate) -> ModelDescription:
        """The description ``c`` was evaluated with (its recompute flags)."""
        return c.model if c.model is not None else self.model

    def best_per_shape(self) -> list:
        """Best candidate of every (pp, tp, dp_shard, schedule, v): the table a user reads."""
        seen, out = set(), []
        for c in self.candidates:
            lay = c.layout
            key = (lay.pp, lay.tp, lay.shard, lay.schedule, lay.stages_per_rank)
            if key not in seen:
                seen.add(key)
                out.append(c)
        return out

    def table(self, rows: Optional[Sequence[Candidate]] = None) -> str:
        rows = list(rows if rows is not None else self.best_per_shape())
        width = max([44] + [len(c.label()) for c in rows])
        head = (f"{'':2}{'mesh':<{width}} {'fits':>4} {'mem/rank':>9} {'of':>8} {'step s':>9} {'compute':>8} "
                f"{'tp':>7} {'bubble':>8} {'comm':>8}")
        lines = [head]
        for c in rows:
            mark = "->" if c is self.best and c.fits else ""
            lines.append(f"{mark:2}{c.label():<{width}} {'yes' if c.fits else 'no':>4} {_gb(c.peak_bytes):>9} "
                         f"{_gb(c.usable_bytes):>8} {c.step_s:9.3f} {c.compute_s:8.3f} {c.tp_s:7.3f} "
                         f"{c.bubble_s:8.3f} {c.comm_s:8.3f}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"model": self.model.name, "total_params": self.model.total_params,
                "world_size": self.world_size, "global_batch": self.global_batch,
                "usable_bytes_per_device": self.cluster.usable_bytes, "search_s": self.search_s,
                "best": self.best.to_dict(), "candidates": [c.to_dict() for c in self.candidates],
                "skipped": [list(s) for s in self.skipped], "explanation": explain(self),
                "activation_checkpointing_searched": [ac_name(m.activation_checkpointing, m.ac_every)
                                                      for m in self.ac_options]}


def _gb(b: float) -> str:
    return f"{b / GB:.1f}GB" if b >= 0.1 * GB else f"{b / 1e6:.1f}MB"


def evaluate_layout(model: ModelDescription, cluster: ClusterDescription, layout: Layout, global_batch: int,
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
           activation_checkpointing: Optional[Sequence] = None) -> SearchResult:
    """Rank every mesh for ``model`` on ``cluster``; raise CapacityError if none fits.

    ``tp``: only these tensor-parallel degrees (default: every divisor of the node size the
    model can take); ``hsdp=False``: plain FSDP only. ``activation_checkpointing``: MemoryConfigs
    to try on every layout, least recomputation first (:func:`ac_options`); each replaces
    ``model``'s recompute flags, and a layout keeps its first that fits (the module
    docstring). None: ``model`` as described.
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
    candidates.sort(key=_rank_key)
    at_best = ()
    if options:
        lay = candidates[0].layout
        at_best = tuple(evaluate_layout(m, cluster, lay, global_batch, cm.breakdown(lay), ac)
                        for ac, m, cm in variants)
    result = SearchResult(model, cluster, world, global_batch, tuple(candidates), tuple(skipped),
                          time.perf_counter() - t0, options, at_best)
    if require_fit and not candidates[0].fits:
        raise CapacityError(_nothing_fits(result))
    return result


def _evaluate_options(cluster: ClusterDescription, layout: Layout, global_batch: int, variants) -> Candidate:
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


def _rank_key(c: Candidate):
    lay = c.layout
    return (not c.fits, round(c.step_s, 9) if c.fits else c.peak_bytes, c.peak_bytes,
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
    """What ``ParallelConfig(layout="auto")`` needs; unpacks as
    ``(pp, schedule, microbatches, stages_per_rank, explanation)``. ``micro_batch`` is the
    accumulation micro-batch for pp == 1 (``DataConfig.micro_batch``); ``dp_shard`` is None
    for plain FSDP (shard over every dp rank). ``activation_checkpointing`` / ``ac_every``: the
    mode the run applies: the planner's pick when the run's MemoryConfig said "auto", else
    the run's own ("none" without a MemoryConfig)."""

    pp: int
    schedule: str
    microbatches: Optional[int]
    stages_per_rank: int
    explanation: str
    micro_batch: Optional[int] = None
    candidate: Optional[Candidate] = None
    tp: int = 1
    dp_shard: Optional[int] = None
    activation_checkpointing: str = "none"
    ac_every: int = 2

    def __iter__(self):
        return iter((self.pp, self.schedule, self.microbatches, self.stages_per_rank, self.explanation))


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
                         seq_len: int, *, precision_config=None, memory_config=None,
                         **search_kwargs) -> ParallelChoice:
    """The fastest mesh that fits, for the launcher and every elastic restart.

    ``cluster``: see :func:`as_cluster`. ``precision_config`` / ``memory_config``: the run's
    ``TrainSpec.precision`` / ``.memory`` (bf16 compute, activation checkpointing); None
    plans fp32 without recomputation. ``memory_config.activation_checkpointing == "auto"``
    searches the mode too (:func:`ac_options`). ``search_kwargs`` go to :func:`search`
    (``tp=[8]`` keeps a tp). Raises CapacityError when nothing fits.
    """
    cluster = as_cluster(cluster)
    auto_ac = memory_config is not None and memory_config.activation_checkpointing == "auto"
    model = describe_model(model_spec_or_description, seq_len).for_run(precision_config,
                                                                       None if auto_ac else memory_config)
    if auto_ac:
        search_kwargs.setdefault("activation_checkpointing", ac_options(memory_config))
    result = search(model, cluster, global_batch=global_batch, world_size=world_size, **search_kwargs)
    best = result.best
    lay = best.layout
    shard = lay.shard if lay.dp_replicate > 1 else None
    if best.activation_checkpointing is not None:
        ac = dict(activation_checkpointing=best.activation_checkpointing, ac_every=best.ac_every)
    elif memory_config is not None:
        ac = dict(activation_checkpointing=memory_config.activation_checkpointing, ac_every=memory_config.ac_every)
    else:
        ac = {}
    if lay.pp == 1:
        return ParallelChoice(1, "1f1b", None, 1, explain(result), micro_batch=lay.micro_batch, candidate=best,
                              tp=lay.tp, dp_shard=shard, **ac)
    return ParallelChoice(lay.pp, lay.schedule, lay.microbatches, lay.stages_per_rank, explain(result),
                          candidate=best, tp=lay.tp, dp_shard=shard, **ac)
