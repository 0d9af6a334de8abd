"""Which pp x dp mesh, schedule and microbatching to run: enumerate, discard what does not
fit, model the step time, rank, and explain.

Two levels, as in Alpa: the stage split is a dynamic program over contiguous block ranges
(``balanced_split``, the very function the workers use, so the stages modeled are the
stages built), and inside a stage FSDP2 shards over the dp ranks. Every candidate is
``(pp, schedule, stages_per_rank, microbatches)`` for pp > 1, or ``(pp=1, micro_batch)``
(gradient accumulation) without a pipeline; dp is what the world size leaves. Which
candidates exist is ``rayflex.mesh.rules``, the rules ``plan_mesh`` applies, so every
candidate is a mesh the workers build.

Step time (modeled, seconds, no overlap assumed so it is an upper bound):

* compute: ``6 * P_rank * tokens_rank / (flops * mfu)``, where ``P_rank`` is the largest
  parameter count any pp rank holds (the slowest stage sets the pace) and ``tokens_rank =
  global_batch * seq_len / dp``; for balanced stages this is ``6 * P * T / (world * flops
  * mfu)``.
* bubble: ``compute * (pp - 1) / (v * m)``: the pipeline runs ``m + pp - 1`` slots for ``m``
  microbatches of work (1F1B and GPipe alike), interleaving cuts the idle slots by ``v``
  (Narayanan et al. 2021). As a fraction of the pipelined time it is ``(pp-1)/(v*m+pp-1)``.
* comm: the placement cost model (``rayflex.planning.placement.planner``): FSDP all-gather and
  reduce-scatter of each stage over its dp group's slowest link, plus activations and
  their gradients across each stage boundary, on the better of two canonical layouts of
  the cluster (FSDP groups packed node by node, or pipelines packed node by node); the
  Planner refines the chosen mesh's placement afterwards. pp == 1 all-gathers each block
  in forward and again in backward for every accumulation pass: ``2k + 1`` collectives
  instead of the model's 3, so its bytes are scaled by ``(2k + 1) / 3``.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence, Union

from rayflex.errors import ConfigError
from rayflex.mesh import rules
from rayflex.mesh.stage_split import stage_split
from rayflex.planning.capacity.memory import (GB, CapacityError, Layout, MemoryEstimate, ModelDescription, Runtime,
                                              describe_model, estimate_memory, fmt_bytes)
from rayflex.planning.comm_profile import layout_comm_profile
from rayflex.planning.placement.planner import MeshShape, modeled_comm_seconds
from rayflex.planning.topology import Topology

SCHEDULE_ORDER = ("none", "1f1b", "interleaved", "gpipe")


# ------------------------------------------------------------------------------ the cluster
@dataclass(frozen=True, kw_only=True)
class DeviceSpec:
    """One accelerator: memory, dense peak FLOP/s in the compute dtype, achieved fraction."""

    memory_bytes: float
    flops: float
    mfu: float = 0.4
    name: str = "device"

    def __post_init__(self) -> None:
        for f in ("memory_bytes", "flops"):
            if not getattr(self, f) > 0:
                raise ConfigError(f"DeviceSpec.{f}", f"must be > 0, got {getattr(self, f)!r}",
                                  "give bytes and FLOP/s, e.g. memory_gb: 80, tflops: 989")
        if not 0 < self.mfu <= 1:
            raise ConfigError("DeviceSpec.mfu", f"must be in (0, 1], got {self.mfu!r}", "use e.g. 0.4")

    @classmethod
    def h100_80gb(cls, mfu: float = 0.4) -> "DeviceSpec":
        # H100 SXM: 80 GB HBM3, 989 TFLOP/s dense bf16
        return cls(memory_bytes=80 * GB, flops=989e12, mfu=mfu, name="H100-80GB")

    @classmethod
    def local_cpu(cls, workers: int) -> "DeviceSpec":
        """This host's memory shared by ``workers`` CPU ranks (about 20 GFLOP/s each)."""
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return cls(memory_bytes=total / max(1, workers), flops=20e9, mfu=1.0, name="cpu")


@dataclass(frozen=True, kw_only=True)
class ClusterDescription:
    """A described cluster: topology (nodes, slots, labels, bandwidths) plus its devices."""

    topology: Topology
    device: DeviceSpec
    memory_margin: float = 0.10  # fraction of device memory the plan keeps free
    runtime: Runtime = field(default_factory=Runtime.gpu)

    def __post_init__(self) -> None:
        if not 0 <= self.memory_margin < 1:
            raise ConfigError("ClusterDescription.memory_margin", f"must be in [0, 1), got {self.memory_margin!r}",
                              "use e.g. 0.1 to keep 10% of device memory free")

    @property
    def usable_bytes(self) -> float:
        return self.device.memory_bytes * (1 - self.memory_margin)

    @property
    def slots(self) -> int:
        return self.topology.usable().total_slots

    @classmethod
    def uniform(cls, *, nodes: int, devices_per_node: int, device: DeviceSpec, nodes_per_rack: int = 0,
                racks_per_zone: int = 0, memory_margin: float = 0.10, runtime: Runtime | None = None,
                bandwidth_gbps: Mapping[str, float] | None = None) -> "ClusterDescription":
        """``nodes`` identical nodes; ``nodes_per_rack`` share a fast domain (0: each node alone)."""
        spec: dict = {"nodes": [_node(i, devices_per_node, nodes_per_rack, racks_per_zone) for i in range(nodes)]}
        if bandwidth_gbps:
            spec["bandwidth_gbps"] = dict(bandwidth_gbps)
        return cls(topology=Topology.from_dict(spec), device=device, memory_margin=memory_margin,
                   runtime=runtime or Runtime.gpu())

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ClusterDescription":
        """``{device: {memory_gb, tflops, mfu?, name?}, memory_margin?, overhead_gb?,
        nodes: [...] (Topology format) | uniform: {nodes, devices_per_node, nodes_per_rack?,
        racks_per_zone?}, bandwidth_gbps?}``."""
        if not isinstance(d, Mapping):
            raise ConfigError("cluster", "expected a mapping", "see docs/capacity.md for the format")
        dev = d.get("device")
        if not isinstance(dev, Mapping) or "memory_gb" not in dev or "tflops" not in dev:
            raise ConfigError("cluster.device", f"needs memory_gb and tflops, got {dev!r}",
                              "write device: {memory_gb: 80, tflops: 989, mfu: 0.4}")
        device = DeviceSpec(memory_bytes=float(dev["memory_gb"]) * GB, flops=float(dev["tflops"]) * 1e12,
                            mfu=float(dev.get("mfu", 0.4)), name=str(dev.get("name", "device")))
        runtime = Runtime.gpu(overhead_bytes=float(d.get("overhead_gb", 2.0)) * GB)
        margin = float(d.get("memory_margin", 0.10))
        if "uniform" in d:
            u = dict(d["uniform"])
            unknown = set(u) - {"nodes", "devices_per_node", "nodes_per_rack", "racks_per_zone"}
            if unknown:
                raise ConfigError("cluster.uniform", f"unknown keys {sorted(unknown)}",
                                  "use nodes, devices_per_node, nodes_per_rack, racks_per_zone")
            return cls.uniform(device=device, memory_margin=margin, runtime=runtime,
                               bandwidth_gbps=d.get("bandwidth_gbps"), **u)
        topo = {k: d[k] for k in ("nodes", "bandwidth_gbps", "bandwidth_bytes_per_s") if k in d}
        return cls(topology=Topology.from_dict(topo), device=device, memory_margin=margin, runtime=runtime)

    @classmethod
    def from_file(cls, path: Union[str, Path]) -> "ClusterDescription":
        path = Path(path)
        if not path.exists():
            raise ConfigError("--cluster", f"no such file {str(path)!r}", "give a cluster description YAML")
        text = path.read_text()
        if path.suffix.lower() in (".yaml", ".yml"):
            import yaml

            return cls.from_dict(yaml.safe_load(text))
        import json

        return cls.from_dict(json.loads(text))

    @classmethod
    def local_cpu(cls, workers: int) -> "ClusterDescription":
        """One node with ``workers`` CPU slots sharing this host's memory."""
        return cls(topology=Topology.from_dict({"nodes": [{"id": "local", "slots": workers}]}),
                   device=DeviceSpec.local_cpu(workers), runtime=Runtime.cpu())

    def describe(self) -> str:
        n = len(self.topology.usable().nodes)
        return (f"{n} nodes, {self.slots} x {self.device.name} ({fmt_bytes(self.device.memory_bytes)}, "
                f"{self.device.flops / 1e12:.0f} TFLOP/s at {self.device.mfu:.0%} MFU), "
                f"{self.memory_margin:.0%} memory margin -> {fmt_bytes(self.usable_bytes)} usable per device")


def _node(i: int, slots: int, per_rack: int, racks_per_zone: int) -> dict:
    labels = {}
    if per_rack:
        rack = i // per_rack
        labels["rack"] = f"rack{rack}"
        if racks_per_zone:
            labels["zone"] = f"zone{rack // racks_per_zone}"
    return {"id": f"node{i:04d}", "slots": slots, "labels": labels}


# ------------------------------------------------------------------------------ candidates
@dataclass(frozen=True)
class Candidate:
    layout: Layout
    memory: MemoryEstimate
    fits: bool
    usable_bytes: float
    compute_s: float
    bubble_s: float
    comm_s: float

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.comm_s

    @property
    def peak_bytes(self) -> float:
        return self.memory.peak_bytes

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the pipelined time: ``(pp-1)/(v*m + pp-1)``."""
        work = self.compute_s + self.bubble_s
        return self.bubble_s / work if work else 0.0

    def label(self) -> str:
        lay = self.layout
        if lay.pp == 1:
            return f"pp=1 x dp={lay.dp} fsdp, micro {lay.micro_batch} x accum {lay.accum_steps}"
        v = f" v={lay.stages_per_rank}" if lay.stages_per_rank > 1 else ""
        return f"pp={lay.pp} x dp={lay.dp} {lay.schedule}{v}, m={lay.microbatches} x {lay.micro_batch}"

    def to_dict(self) -> dict:
        lay = self.layout
        peak = self.memory.peak_rank
        return {"pp": lay.pp, "dp": lay.dp, "schedule": lay.schedule, "stages_per_rank": lay.stages_per_rank,
                "microbatches": lay.microbatches, "micro_batch": lay.micro_batch, "accum_steps": lay.accum_steps,
                "fits": self.fits, "peak_bytes": self.peak_bytes, "usable_bytes": self.usable_bytes,
                "peak_pp_rank": peak.pp_index, "peak_phase": peak.phase, "peak_breakdown": peak.to_dict(),
                "step_s": self.step_s, "compute_s": self.compute_s, "bubble_s": self.bubble_s,
                "bubble_fraction": self.bubble_fraction, "comm_s": self.comm_s,
                "stage_blocks": [list(s) for s in lay.stage_blocks]}


@dataclass(frozen=True)
class SearchResult:
    model: ModelDescription
    cluster: ClusterDescription
    world_size: int
    global_batch: int
    candidates: tuple  # every candidate, ranked: fitting first by step time
    skipped: tuple  # (what, why) for meshes the batch or the model cannot take
    search_s: float = 0.0

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def fitting(self) -> list:
        return [c for c in self.candidates if c.fits]

    def best_per_shape(self) -> list:
        """Best candidate of every (pp, schedule, v): the table a user reads."""
        seen, out = set(), []
        for c in self.candidates:
            key = (c.layout.pp, c.layout.schedule, c.layout.stages_per_rank)
            if key not in seen:
                seen.add(key)
                out.append(c)
        return out

    def table(self, rows: Optional[Sequence[Candidate]] = None) -> str:
        rows = list(rows if rows is not None else self.best_per_shape())
        head = (f"{'':2}{'mesh':<44} {'fits':>4} {'mem/rank':>9} {'of':>8} {'step s':>9} {'compute':>8} "
                f"{'bubble':>8} {'comm':>8}")
        lines = [head]
        for c in rows:
            mark = "->" if c is self.best and c.fits else ""
            lines.append(f"{mark:2}{c.label():<44} {'yes' if c.fits else 'no':>4} {_gb(c.peak_bytes):>9} "
                         f"{_gb(c.usable_bytes):>8} {c.step_s:9.3f} {c.compute_s:8.3f} "
                         f"{c.bubble_s:8.3f} {c.comm_s:8.3f}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"model": self.model.name, "total_params": self.model.total_params,
                "world_size": self.world_size, "global_batch": self.global_batch,
                "usable_bytes_per_device": self.cluster.usable_bytes, "search_s": self.search_s,
                "best": self.best.to_dict(), "candidates": [c.to_dict() for c in self.candidates],
                "skipped": [list(s) for s in self.skipped], "explanation": explain(self)}


def _gb(b: float) -> str:
    return f"{b / GB:.1f}GB" if b >= 0.1 * GB else f"{b / 1e6:.1f}MB"


def enumerate_layouts(model: ModelDescription, world: int, global_batch: int, *,
                      schedules: Sequence[str] = ("gpipe", "1f1b", "interleaved"), max_stages_per_rank: int = 4,
                      max_microbatches: int = 0):
    """Every mesh rayflex can run for this world size and batch; yields Layouts and
    ``("skip", what, why)`` for meshes it cannot. Which meshes are runnable, and their
    batch arithmetic, is ``rayflex.mesh.rules``: the same rules ``plan_mesh`` applies."""
    n = model.num_blocks
    for pp in rules.divisors(world):
        dp = world // pp
        problem = rules.mesh_base_problem(world, pp, global_batch, n)
        if problem is not None:
            yield ("skip", f"pp={pp}" if pp > n else f"pp={pp} x dp={dp}", problem.problem)
            continue
        per_rank = global_batch // dp
        if pp == 1:
            for micro in rules.divisors(per_rank):
                split = rules.split_batch(world, rules.MeshLayout(pp=1), global_batch, micro_batch=micro)
                yield Layout(pp=1, dp=dp, schedule="none", microbatches=1, micro_batch=split.micro_batch,
                             accum_steps=split.accum_steps, stage_blocks=stage_split(model.block_params, 1))
            continue
        shapes = [(s, 1) for s in schedules if s in ("gpipe", "1f1b")]
        if rules.INTERLEAVED in schedules:
            shapes += [(rules.INTERLEAVED, v) for v in range(2, max_stages_per_rank + 1)
                       if rules.stages_problem(pp * v, n) is None]
        if not shapes:
            yield ("skip", f"pp={pp} x dp={dp}", f"none of the schedules {', '.join(schedules)} can cut "
                   f"{n} blocks into stages for pp={pp}")
            continue
        fed = False
        for schedule, v in shapes:
            ms = rules.microbatch_options(pp, per_rank, schedule, max_microbatches)
            fed = fed or bool(ms)
            if not ms:
                continue
            split = stage_split(model.block_params, pp * v)
            for m in ms:
                pipe = rules.MeshLayout(pp=pp, schedule=schedule, stages_per_rank=v, microbatches=m)
                batch = rules.split_batch(world, pipe, global_batch, num_blocks=n)
                yield Layout(pp=pp, dp=dp, schedule=schedule, microbatches=batch.microbatches,
                             micro_batch=batch.micro_batch, stages_per_rank=v, stage_blocks=split)
        if not fed:
            yield ("skip", f"pp={pp} x dp={dp}", f"per-rank batch {per_rank} cannot feed {pp} stages "
                   f"(microbatches must be >= pp and divide it)")


# ------------------------------------------------------------------------------ step time
def _rank_params(model: ModelDescription, layout: Layout) -> list[int]:
    per_stage = [sum(model.block_params[i] for i in blocks) for blocks in layout.stage_blocks]
    return [sum(per_stage[s] for s in layout.local_stages(i)) for i in range(layout.pp)]


def _canonical_nodes(topology: Topology, world: int) -> list[str]:
    """One node id per slot, nodes grouped by zone then rack, ``world`` slots."""
    nodes = sorted(topology.usable().nodes, key=lambda nd: (nd.zone or "", nd.rack or "", nd.node_id))
    slots = [nd.node_id for nd in nodes for _ in range(nd.slots)]
    if len(slots) < world:
        raise CapacityError(f"the cluster has {len(slots)} usable slots, fewer than the {world} ranks asked for")
    return slots[:world]


class _CommModel:
    """Modeled communication seconds per (pp, v, accumulation) on canonical layouts."""

    def __init__(self, model: ModelDescription, cluster: ClusterDescription, world: int, global_batch: int):
        self.model, self.cluster, self.world, self.global_batch = model, cluster, world, global_batch
        self.slots = _canonical_nodes(cluster.topology, world)
        self.cache: dict = {}

    def seconds(self, layout: Layout) -> float:
        key = (layout.pp, layout.stages_per_rank, layout.accum_steps)
        if key not in self.cache:
            self.cache[key] = self._compute(layout)
        return self.cache[key]

    def _compute(self, layout: Layout) -> float:
        model = self.model
        pp, dp = layout.pp, layout.dp
        profile = layout_comm_profile(_rank_params(model, layout), model.precision.param_bytes,
                                      self.global_batch // dp * model.seq_len, model.hidden_size,
                                      layout.stages_per_rank, layout.accum_steps)
        mesh = MeshShape(pp, dp)
        dp_major = self.slots
        pipe_major = [""] * self.world
        for i, node in enumerate(self.slots):  # slot i hosts pipeline i // pp at stage (i mod pp)
            d, s = divmod(i, pp)
            pipe_major[s * dp + d] = node
        topo = self.cluster.topology
        return min(modeled_comm_seconds(topo, mesh, profile, dp_major),
                   modeled_comm_seconds(topo, mesh, profile, pipe_major))


def step_time(model: ModelDescription, layout: Layout, device: DeviceSpec, global_batch: int,
              comm_s: float) -> tuple[float, float, float]:
    """(compute, bubble, comm) seconds of one step; see the module docstring."""
    tokens_rank = global_batch // layout.dp * model.seq_len
    compute = 6 * max(_rank_params(model, layout)) * tokens_rank / (device.flops * device.mfu)
    bubble = compute * (layout.pp - 1) / (layout.stages_per_rank * layout.microbatches) if layout.pp > 1 else 0.0
    return compute, bubble, comm_s


# ------------------------------------------------------------------------------ search
def search(model: ModelDescription, cluster: ClusterDescription, *, global_batch: int,
           world_size: Optional[int] = None, schedules: Sequence[str] = ("gpipe", "1f1b", "interleaved"),
           max_stages_per_rank: int = 4, max_microbatches: int = 0, require_fit: bool = True) -> SearchResult:
    """Rank every mesh for ``model`` on ``cluster``; raise CapacityError if none fits."""
    import time

    t0 = time.perf_counter()
    world = world_size or cluster.slots
    if world < 1 or world > cluster.slots:
        raise CapacityError(f"world size {world} is outside the cluster's 1..{cluster.slots} usable slots")
    if global_batch < 1:
        raise ConfigError("global_batch", f"must be >= 1, got {global_batch}", "give the batch in samples")
    _check_state_fits(model, cluster, world)
    comm = _CommModel(model, cluster, world, global_batch)
    usable = cluster.usable_bytes
    candidates, skipped = [], []
    for item in enumerate_layouts(model, world, global_batch, schedules=schedules,
                                  max_stages_per_rank=max_stages_per_rank, max_microbatches=max_microbatches):
        if isinstance(item, tuple):
            skipped.append(item[1:])
            continue
        mem = estimate_memory(model, item, cluster.runtime)
        compute, bubble, comm_s = step_time(model, item, cluster.device, global_batch, comm.seconds(item))
        candidates.append(Candidate(item, mem, mem.peak_bytes <= usable, usable, compute, bubble, comm_s))
    if not candidates:
        raise CapacityError(f"no mesh of {world} ranks can take global batch {global_batch} for {model.name}: "
                            + "; ".join(f"{w}: {why}" for w, why in skipped))
    candidates.sort(key=_rank_key)
    result = SearchResult(model, cluster, world, global_batch, tuple(candidates), tuple(skipped),
                          time.perf_counter() - t0)
    if require_fit and not candidates[0].fits:
        raise CapacityError(_nothing_fits(result))
    return result


def _rank_key(c: Candidate):
    return (not c.fits, round(c.step_s, 9) if c.fits else c.peak_bytes, c.peak_bytes,
            SCHEDULE_ORDER.index(c.layout.schedule), c.layout.pp)


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
    return (f"no mesh of {result.world_size} ranks fits {result.model.name} "
            f"({result.model.total_params / 1e9:.2f}B params, seq {result.model.seq_len}, global batch "
            f"{result.global_batch}) in {fmt_bytes(c.usable_bytes)} usable per device. The smallest peak is "
            f"{fmt_bytes(c.peak_bytes)} ({c.label()}, pp rank {r.pp_index}, {r.phase}): {r.breakdown()}. "
            f"Fix: more devices, a smaller seq_len or micro-batch, or activation recomputation "
            f"(MemoryConfig(activation_checkpointing='full')).")


# ------------------------------------------------------------------------------ explanation
def explain(result: SearchResult) -> str:
    """The choice in words, with the numbers a reader can check by hand."""
    best, model, dev = result.best, result.model, result.cluster.device
    lay, r = best.layout, best.memory.peak_rank
    lines = []
    if lay.pp == 1:
        lines.append(f"Chose pp=1 x dp={lay.dp}: FSDP over all {result.world_size} ranks, micro-batch "
                     f"{lay.micro_batch} x {lay.accum_steps} accumulation passes "
                     f"({lay.micro_batch * model.seq_len} tokens per pass).")
    else:
        v = f" with {lay.stages_per_rank} virtual stages per rank" if lay.stages_per_rank > 1 else ""
        sizes = sorted({len(b) for b in lay.stage_blocks})
        lines.append(f"Chose pp={lay.pp} x dp={lay.dp}, {lay.schedule}{v}, {lay.microbatches} microbatches of "
                     f"{lay.micro_batch} sample(s) ({lay.micro_batch * model.seq_len} tokens); {lay.num_stages} "
                     f"stages of {'-'.join(str(s) for s in (sizes[0], sizes[-1]) if s) if len(sizes) > 1 else sizes[0]}"
                     f" blocks, split by parameter count.")
    lines.append(f"Memory: the fullest rank is pp rank {r.pp_index} ({r.phase.replace('_', '/')}) at "
                 f"{fmt_bytes(r.peak_bytes)} of {fmt_bytes(best.usable_bytes)} usable "
                 f"({fmt_bytes(dev.memory_bytes)} minus {result.cluster.memory_margin:.0%}): {r.breakdown()}"
                 + (f"; activations are {r.activation_microbatches:.1f} microbatch(es) of this rank's blocks in "
                    f"flight" + (f" plus {fmt_bytes(r.inference_graph)} kept by the first stage's shape-inference "
                                 f"graph" if r.inference_graph else "")
                    if r.phase == "forward_backward" else "") + ".")
    tokens_rank = result.global_batch // lay.dp * model.seq_len
    rank_p = max(_rank_params(model, lay))
    lines.append(f"Step time {best.step_s:.3f} s (modeled) = compute {best.compute_s:.3f} s "
                 f"(6 x {rank_p / 1e9:.3g}B params on the busiest rank x {tokens_rank} tokens per rank / "
                 f"({dev.flops / 1e12:.0f} TFLOP/s x {dev.mfu:.0%})) + bubble {best.bubble_s:.3f} s"
                 + (f" (compute x (pp-1)/(v*m) = {lay.pp - 1}/{lay.stages_per_rank * lay.microbatches})"
                    if lay.pp > 1 else " (no pipeline)")
                 + f" + comm {best.comm_s:.3f} s (placement cost model).")
    others = [c for c in result.best_per_shape() if c is not best]
    fit_others = [c for c in others if c.fits]
    if fit_others:
        nxt = fit_others[0]
        lines.append(f"Runner-up: {nxt.label()} at {nxt.step_s:.3f} s "
                     f"(+{(nxt.step_s / best.step_s - 1) * 100:.1f}%): {_why_slower(best, nxt)}.")
    dp_only = [c for c in result.candidates if c.layout.pp == 1]
    if lay.pp > 1:
        if dp_only:
            d = min(dp_only, key=lambda c: c.peak_bytes)
            if not d.fits:
                dr = d.memory.peak_rank
                lines.append(f"Data parallelism alone (pp=1 x dp={d.layout.dp}) does not fit: its best needs "
                             f"{fmt_bytes(d.peak_bytes)} > {fmt_bytes(d.usable_bytes)} ({d.label()}, "
                             f"{dr.phase.replace('_', '/')}: {dr.breakdown()})" + _setup_note(dp_only) + ".")
            else:
                best_dp = min((c for c in dp_only if c.fits), key=lambda c: c.step_s)
                lines.append(f"Data parallelism alone fits ({best_dp.label()}, {fmt_bytes(best_dp.peak_bytes)}) "
                             f"but is modeled at {best_dp.step_s:.3f} s: {_why_slower(best, best_dp)}.")
        else:
            why = next((w for what, w in result.skipped if what.startswith("pp=1 ")), "not enumerable")
            lines.append(f"Data parallelism alone is not possible here: {why}.")
    no_fit = [c for c in others if not c.fits]
    if no_fit:
        lines.append("Not fitting: " + "; ".join(
            f"{c.label()} needs {fmt_bytes(c.peak_bytes)}" for c in no_fit[:6]) + ".")
    return "\n".join(lines)


def _setup_note(cands: Sequence[Candidate]) -> str:
    """When setup is what breaks the smallest mesh, what its training step alone would need."""
    if min(cands, key=lambda c: c.peak_bytes).memory.peak_rank.phase != "setup":
        return ""
    c = min(cands, key=lambda c: c.memory.peak_rank.forward_backward_bytes)
    return (f"; even with a meta-device setup its training step needs "
            f"{fmt_bytes(c.memory.peak_rank.forward_backward_bytes)} at best ({c.label()})")


def _why_slower(best: Candidate, other: Candidate) -> str:
    diffs = [("compute", other.compute_s - best.compute_s), ("bubble", other.bubble_s - best.bubble_s),
             ("comm", other.comm_s - best.comm_s)]
    name, delta = max(diffs, key=lambda d: d[1])
    return f"{delta:.3f} s more {name}"


# ------------------------------------------------------------------------------ for the launcher
@dataclass(frozen=True)
class ParallelChoice:
    """What ``ParallelConfig(pp="auto")`` needs; unpacks as
    ``(pp, schedule, microbatches, stages_per_rank, explanation)``. ``micro_batch`` is the
    accumulation micro-batch for pp == 1 (``DataConfig.micro_batch``)."""

    pp: int
    schedule: str
    microbatches: Optional[int]
    stages_per_rank: int
    explanation: str
    micro_batch: Optional[int] = None
    candidate: Optional[Candidate] = None

    def __iter__(self):
        return iter((self.pp, self.schedule, self.microbatches, self.stages_per_rank, self.explanation))


def best_parallel_config(model_spec_or_description, cluster, world_size: int, global_batch: int,
                         seq_len: int, *, precision_config=None, memory_config=None,
                         **search_kwargs) -> ParallelChoice:
    """The fastest mesh that fits, for the launcher and every elastic restart.

    ``cluster``: a ClusterDescription, a path to its YAML, a dict, or a Topology (then the
    devices are this host's CPUs). ``precision_config`` / ``memory_config``: the run's
    ``TrainSpec.precision`` / ``.memory`` (bf16 compute, activation checkpointing); None
    plans fp32 without recomputation. Raises CapacityError when nothing fits.
    """
    if isinstance(cluster, (str, Path)):
        cluster = ClusterDescription.from_file(cluster)
    elif isinstance(cluster, Mapping):
        cluster = ClusterDescription.from_dict(cluster)
    elif isinstance(cluster, Topology):
        cluster = ClusterDescription(topology=cluster, device=DeviceSpec.local_cpu(cluster.usable().total_slots),
                                     runtime=Runtime.cpu())
    model = describe_model(model_spec_or_description, seq_len).for_run(precision_config, memory_config)
    result = search(model, cluster, global_batch=global_batch, world_size=world_size, **search_kwargs)
    best = result.best
    lay = best.layout
    if lay.pp == 1:
        return ParallelChoice(1, "1f1b", None, 1, explain(result), micro_batch=lay.micro_batch, candidate=best)
    return ParallelChoice(lay.pp, lay.schedule, lay.microbatches, lay.stages_per_rank, explain(result),
                          candidate=best)
