"""The capacity search's answer as data: a priced candidate mesh, and the ranked result.

Kept apart from the search itself so that :mod:`.explain` (which reads these) and
:mod:`.search` (which makes them and asks :mod:`.explain` for the words) import one way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from rayflex.mesh.plan import MeshPlan
from rayflex.planning.capacity.cluster import ClusterDescription
from rayflex.planning.capacity.memory import GB, MemoryEstimate, ModelDescription
from rayflex.planning.cost_model import CostBreakdown


# ------------------------------------------------------------------------------ candidates
@dataclass(frozen=True)
class Candidate:
    layout: MeshPlan
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
        """``pp=2 x dp=4 x tp=8``, ``pp=1 x dp=64 (2x32 hsdp) x tp=8``."""
        return self.layout.describe()

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
        out = {"pp": lay.pp, "dp": lay.dp, "tp": lay.tp, "dp_shard": lay.dp_shard, "dp_replicate": lay.dp_replicate,
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
    explanation: str = ""  # why the best won (:mod:`.explain`), filled in by ``search``
    failures: Any = None  # the FailureCost the ranking priced (None: step time alone)

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
            key = (lay.pp, lay.tp, lay.dp_shard, lay.schedule, lay.stages_per_rank)
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
                "skipped": [list(s) for s in self.skipped], "explanation": self.explanation,
                "activation_checkpointing_searched": [ac_name(m.activation_checkpointing, m.ac_every)
                                                      for m in self.ac_options]}


def _gb(b: float) -> str:
    return f"{b / GB:.1f}GB" if b >= 0.1 * GB else f"{b / 1e6:.1f}MB"


def ac_name(mode: Optional[str], every: int = 2) -> str:
    """``none`` / ``every 2nd block`` / ``full``: a mode in words."""
    if mode in (None, "none"):
        return "none"
    if mode == "full":
        return "full"
    if mode == "every_k":
        return f"every {ordinal(every)} block"
    return mode


def ordinal(k: int) -> str:
    suffix = "th" if 10 <= k % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"
