"""The capacity search's choice in words, with the numbers a reader can check by hand: the
mesh, its memory per rank against what does not fit, its modeled step time against the
fastest mesh of every other tensor-parallel degree and shard-group size, the link tier
each kind of group was priced at and, when the planner chose it
(``MemoryConfig(activation_checkpointing="auto")``), the activation checkpointing against the
other modes.
"""

from __future__ import annotations

from typing import Sequence

from rayflex.planning.capacity.memory import fmt_bytes
from rayflex.planning.capacity.replicate_tier import advise, describe
from rayflex.planning.capacity.step_time import layout_profile, rank_compute_params, rank_tp_allreduces
from rayflex.planning.topology import LinkTier

from rayflex.planning.capacity.candidates import Candidate, SearchResult, ac_name


def explain(result: "SearchResult") -> str:
    best = result.best
    lines = [_choice(result)] + _ac(result) + _failures(result) + [_memory(result), _step(result)]
    if best.comm is not None:
        lines.append(_tiers(best))
    lines += _replicate_tier(best)
    lines += _by_tp(result)
    lines += _by_shard(result)
    others = [c for c in result.best_per_shape() if c is not best]
    fit_others = [c for c in others if c.fits]
    if fit_others:
        nxt = fit_others[0]
        lines.append(f"Runner-up: {nxt.label()} at {nxt.step_s:.3f} s "
                     f"(+{(nxt.step_s / best.step_s - 1) * 100:.1f}%): {_why_slower(best, nxt)}.")
    lines += _data_parallel_alone(result)
    no_fit = [c for c in others if not c.fits]
    if no_fit:
        lines.append("Not fitting: " + "; ".join(
            f"{c.label()} needs {fmt_bytes(c.peak_bytes)}" for c in no_fit[:6]) + ".")
    return "\n".join(lines)


def summary(result: "SearchResult") -> str:
    """The short why ``rayflex plan`` prints under its choice: the fastest mesh of every tp
    degree and shard-group size, and where the chosen mesh's groups were priced."""
    best = result.best
    lines = ["why:"] + _ac(result) + _failures(result) + _by_tp(result) + _by_shard(result)
    if best.comm is not None:
        lines.append(_tiers(best))
    lines += _replicate_tier(best)
    others = [c for c in result.best_per_shape() if not c.fits]
    if others:
        low = min(others, key=lambda c: c.peak_bytes)
        lines.append(f"Memory: the choice needs {fmt_bytes(best.peak_bytes)} of {fmt_bytes(best.usable_bytes)} per "
                     f"rank; {len(others)} mesh shapes do not fit (smallest of them: {low.label()}, "
                     f"{fmt_bytes(low.peak_bytes)}). `--explain` has the breakdown.")
    return "\n".join(lines)


def _choice(result: "SearchResult") -> str:
    best, model = result.best, result.model
    lay = best.layout
    mesh = lay.describe()
    split = []
    if lay.tp > 1:
        split.append(f"every block split over {lay.tp} tensor-parallel ranks inside a node")
    if lay.dp_replicate > 1:
        split.append(f"HSDP: FSDP shard groups of {lay.dp_shard} ranks, {lay.dp_replicate} replicas all-reducing "
                     f"their gradient shards")
    extra = "; ".join(split)
    if lay.pp == 1:
        who = (f"FSDP over all {result.world_size} ranks" if lay.tp == 1 and lay.dp_replicate == 1
               else extra)
        return (f"Chose {mesh}: {who}, micro-batch {lay.micro_batch} x {lay.accum_steps} accumulation passes "
                f"({lay.micro_batch * model.seq_len} tokens per pass).")
    v = f" with {lay.stages_per_rank} virtual stages per rank" if lay.stages_per_rank > 1 else ""
    sizes = sorted({len(b) for b in lay.stage_blocks})
    span = "-".join(str(s) for s in (sizes[0], sizes[-1])) if len(sizes) > 1 else str(sizes[0])
    return (f"Chose {mesh}, {lay.schedule}{v}, {lay.microbatches} microbatches of {lay.micro_batch} sample(s) "
            f"({lay.micro_batch * model.seq_len} tokens); {lay.num_stages} stages of {span} blocks, split by "
            f"parameter count" + (f"; {extra}" if extra else "") + ".")


def _failures(result: "SearchResult") -> list[str]:
    """With failures priced (``search(failures=...)``): what they cost the choice, and the
    fastest fitting mesh of the other kind (with replicas / without) at its price."""
    f = result.failures
    best = result.best
    if f is None or not best.fits:
        return []

    def priced(c) -> str:
        return (f"{c.label()} {c.step_s:.3f} s/step, {f.lost_fraction(c.layout, c.step_s):.1%} of the time lost to "
                f"failures -> {f.effective_step_s(c.layout, c.step_s):.3f} s")

    other = next((c for c in result.fitting if f.live(c.layout) != f.live(best.layout)), None)
    line = f"Failures: {f.describe()}. Chose {priced(best)}"
    if other is not None:
        kind = "with replicas (live recovery)" if f.live(other.layout) else "without replicas"
        line += f"; the fastest mesh {kind}: {priced(other)}"
    return [line + "."]


def _memory(result: "SearchResult") -> str:
    best, dev = result.best, result.cluster.device
    lay, r = best.layout, best.memory.peak_rank
    held = []
    if lay.tp > 1:
        held.append(f"1/{lay.tp} of every block (tensor parallelism)")
    held.append(f"1/{lay.dp_shard} of its stage's parameter, gradient and optimizer state"
                + (f" (HSDP shards over {lay.dp_shard}, not dp={lay.dp})" if lay.dp_replicate > 1 else ""))
    return (f"Memory: a rank holds {' and '.join(held)}; the fullest is pp rank {r.pp_index} "
            f"({r.phase.replace('_', '/')}) at {fmt_bytes(r.peak_bytes)} of {fmt_bytes(best.usable_bytes)} usable "
            f"({fmt_bytes(dev.memory_bytes)} minus {result.cluster.memory_margin:.0%}): {r.breakdown()}"
            + (f"; activations are {r.activation_microbatches:.1f} microbatch(es) of this rank's blocks in "
               f"flight" + (f" plus {fmt_bytes(r.inference_graph)} kept by the first stage's shape-inference "
                            f"graph" if r.inference_graph else "")
               if r.phase == "forward_backward" else "") + ".")


def _ac(result: "SearchResult") -> list[str]:
    """Which activation checkpointing the search chose and why: the chosen layout with each
    other mode (does it fit, what it costs), and the fastest mesh that fits with less
    recomputation. Nothing when the mode was the run's own."""

    best = result.best
    if not result.ac_searched or not best.fits:
        return []
    names = [(m.activation_checkpointing, m.ac_every) for m in result.ac_options]
    chosen = names.index((best.activation_checkpointing, best.ac_every))
    cap = fmt_bytes(best.usable_bytes)
    why = []
    for i, (c, (mode, every)) in enumerate(zip(result.ac_at_best, names)):
        if i == chosen:
            continue
        word = f"'{ac_name(mode, every)}'"
        if not c.fits:
            why.append(f"{word} does not fit this mesh ({fmt_bytes(c.peak_bytes)} > {cap})")
        elif i < chosen:  # cannot happen when memory falls with recomputation; said if it does
            why.append(f"{word} fits ({fmt_bytes(c.peak_bytes)}) at {c.step_s / best.step_s - 1:+.1%} step time")
        else:
            why.append(f"{word} fits ({fmt_bytes(c.peak_bytes)}) but costs {c.step_s / best.step_s - 1:+.1%} "
                       f"step time (recompute)")
    if chosen > 0:  # the fastest mesh with less recomputation, if any fits
        less = set(names[:chosen])
        lighter = [c for c in result.fitting if (c.activation_checkpointing, c.ac_every) in less]
        if lighter:
            c = lighter[0]
            why.append(f"the fastest mesh that fits with less recomputation, {c.label()}, is "
                       f"{c.step_s / best.step_s - 1:+.1%}")
        else:
            why.append("no mesh fits with less recomputation")
    head = f"Activation checkpointing (auto): {ac_name(*names[chosen])}"
    if chosen == 0:
        head += f": this mesh fits without recomputation ({fmt_bytes(best.peak_bytes)} of {cap})"
    return [head + (" — " + "; ".join(why) if why else "") + "."]


def _step(result: "SearchResult") -> str:
    best, dev = result.best, result.cluster.device
    model = result.model_of(best)
    lay = best.layout
    tokens_rank = result.global_batch // lay.dp * model.seq_len
    rank_p, rank_r = rank_compute_params(model, lay)
    flops = (f"(6 x {rank_p / 1e9:.3g}B + 2 x {rank_r / 1e9:.3g}B recomputed) params" if rank_r else
             f"6 x {rank_p / 1e9:.3g}B params")
    parts = [f"compute {best.compute_s:.3f} s ({flops} on the busiest rank x "
             f"{tokens_rank} tokens per rank / ({dev.flops / 1e12:.0f} TFLOP/s x {dev.mfu:.0%}))"]
    if lay.tp > 1:
        parts.append(f"TP all-reduce {best.tp_s:.3f} s ({_tp_words(result, best)})")
    parts.append(f"bubble {best.bubble_s:.3f} s" + (
        f" ((compute + TP) x (pp-1)/(v*m) = {lay.pp - 1}/{lay.stages_per_rank * lay.microbatches})"
        if lay.pp > 1 else " (no pipeline)"))
    parts.append(f"comm {best.comm_s:.3f} s (" + _comm_words(best) + ")")
    return f"Step time {best.step_s:.3f} s (modeled) = " + " + ".join(parts) + "."


def _tp_words(result: "SearchResult", c: "Candidate") -> str:
    lay, model = c.layout, result.model_of(c)
    count = max(rank_tp_allreduces(model, lay))
    per = layout_profile(model, lay, result.global_batch).activation_bytes
    tier = LinkTier(max(c.comm.tp_levels)).name if c.comm is not None else "SAME_NODE"
    link = "NVLink" if tier == LinkTier.SAME_NODE.name else tier
    return (f"{count:.4g} all-reduces of a microbatch's hidden states on the busiest stage, "
            f"{fmt_bytes(count * per)} per step, ring over {lay.tp} ranks on {link}")


def _comm_words(c: "Candidate") -> str:
    if c.comm is None:
        return "placement cost model"
    ev = c.comm
    terms = [f"FSDP {sum(ev.fsdp_s):.3f} s"]
    if c.layout.dp_replicate > 1:
        terms.append(f"HSDP all-reduce {sum(ev.replica_s):.3f} s")
    if c.layout.pp > 1:
        terms.append(f"pipeline {sum(ev.p2p_s):.3f} s")
    return " + ".join(terms) + ", placement cost model"


def _replicate_tier(c: "Candidate") -> list[str]:
    """Under an HSDP choice: which CommConfig keeps the replicas' tier off the step's critical path."""
    if c.comm is None or c.layout.dp_replicate < 2:
        return []
    return [describe(advise(c.compute_s, sum(c.comm.replica_s)))]


def _tiers(c: "Candidate") -> str:
    ev, lay = c.comm, c.layout
    parts = []
    if lay.tp > 1:
        parts.append(f"tp groups of {lay.tp} on one node ({LinkTier(max(ev.tp_levels)).name})")
    if lay.dp_shard > 1:
        parts.append(f"FSDP {'shard ' if lay.dp_replicate > 1 else ''}groups of {lay.dp_shard} ranks: worst "
                     f"{LinkTier(max(ev.row_levels)).name}")
    if lay.dp_replicate > 1:
        parts.append(f"HSDP replicate groups of {lay.dp_replicate}: worst {LinkTier(max(ev.replica_levels)).name}")
    if lay.pp > 1:
        parts.append(f"stage boundaries: worst {LinkTier(max(ev.boundary_levels)).name}")
    if not parts:
        return "Placement: a single rank per stage group, nothing to place."
    return ("Placement priced (canonical layout; `rayflex plan --explain` shows the planner's): "
            + "; ".join(parts) + ".")


def _by_tp(result: "SearchResult") -> list[str]:
    """The fastest fitting mesh of every tp degree, or why that degree has none."""
    best = result.best
    degrees = sorted({c.layout.tp for c in result.candidates})
    skipped = [(what, why) for what, why in result.skipped if what.startswith("tp=")]
    if len(degrees) == 1 and not skipped:
        return []
    lines = ["By tensor-parallel degree (the fastest mesh of each that fits):"]
    for tp in sorted(degrees, key=lambda d: (d != best.layout.tp, d)):
        cands = [c for c in result.candidates if c.layout.tp == tp]
        fitting = [c for c in cands if c.fits]
        where = " inside the node" if tp > 1 else ""
        if not fitting:
            low = min(cands, key=lambda c: c.peak_bytes)
            lines.append(f"  tp={tp}{where}: nothing fits; the smallest peak is {fmt_bytes(low.peak_bytes)} "
                         f"({low.label()}) > {fmt_bytes(low.usable_bytes)}")
            continue
        c = fitting[0]
        mark = "chosen" if c is best else f"+{(c.step_s / best.step_s - 1) * 100:.1f}%"
        cost = (f"TP all-reduce over NVLink costs {c.tp_s:.3f} s" if tp > 1 else "no TP all-reduce")
        lines.append(f"  tp={tp}{where}: {c.label()}, {fmt_bytes(c.peak_bytes)} per rank, {c.step_s:.3f} s "
                     f"({mark}): {cost}, bubble {c.bubble_s:.3f} s, comm {c.comm_s:.3f} s, "
                     f"compute {c.compute_s:.3f} s")
    for what, why in skipped:
        lines.append(f"  {what}: not searched: {why}")
    return lines


def _by_shard(result: "SearchResult") -> list[str]:
    """The chosen mesh with every other FSDP shard-group size (plain FSDP vs HSDP)."""
    best = result.best
    lay = best.layout

    def same_mesh(c):
        o = c.layout
        return (o.pp, o.tp, o.schedule, o.stages_per_rank, o.microbatches, o.micro_batch) == (
            lay.pp, lay.tp, lay.schedule, lay.stages_per_rank, lay.microbatches, lay.micro_batch)

    alts = [c for c in result.candidates if same_mesh(c) and c is not best]
    if not alts:
        return []
    lines = [f"FSDP shard groups at this mesh ({'HSDP' if lay.dp_replicate > 1 else 'plain FSDP'} chosen):"]
    for c in [best] + sorted(alts, key=lambda c: -c.layout.dp_shard):
        o = c.layout
        name = (f"plain FSDP over dp={o.dp}" if o.dp_replicate == 1 else
                f"HSDP {o.dp_replicate} x {o.dp_shard}") + c.ac_label()
        tiers = ""
        if c.comm is not None:
            tiers = f" (shard groups {LinkTier(max(c.comm.row_levels)).name}" + (
                f", replicas {LinkTier(max(c.comm.replica_levels)).name}" if o.dp_replicate > 1 else "") + ")"
        fits = "fits" if c.fits else "does not fit"
        lines.append(f"  {name}{tiers}: comm {c.comm_s:.3f} s, step {c.step_s:.3f} s, "
                     f"{fmt_bytes(c.peak_bytes)} per rank, {fits}")
    return lines


def _data_parallel_alone(result: "SearchResult") -> list[str]:
    best = result.best
    lay = best.layout
    if (lay.pp, lay.tp, lay.dp_replicate) == (1, 1, 1):
        return []
    dp_only = [c for c in result.candidates if (c.layout.pp, c.layout.tp, c.layout.dp_replicate) == (1, 1, 1)]
    if not dp_only:
        why = next((w for what, w in result.skipped if what.startswith("pp=1 ")), "not enumerable")
        return [f"Data parallelism alone is not possible here: {why}."]
    d = min(dp_only, key=lambda c: c.peak_bytes)
    if not d.fits:
        dr = d.memory.peak_rank
        return [f"Data parallelism alone (pp=1 x dp={d.layout.dp}) does not fit: its best needs "
                f"{fmt_bytes(d.peak_bytes)} > {fmt_bytes(d.usable_bytes)} ({d.label()}, "
                f"{dr.phase.replace('_', '/')}: {dr.breakdown()})" + _setup_note(dp_only) + "."]
    best_dp = min((c for c in dp_only if c.fits), key=lambda c: c.step_s)
    return [f"Data parallelism alone fits ({best_dp.label()}, {fmt_bytes(best_dp.peak_bytes)}) "
            f"but is modeled at {best_dp.step_s:.3f} s: {_why_slower(best, best_dp)}."]


def _setup_note(cands: Sequence["Candidate"]) -> str:
    """When setup is what breaks the smallest mesh, what its training step alone would need."""
    if min(cands, key=lambda c: c.peak_bytes).memory.peak_rank.phase != "setup":
        return ""
    c = min(cands, key=lambda c: c.memory.peak_rank.forward_backward_bytes)
    return (f"; even with a meta-device setup its training step needs "
            f"{fmt_bytes(c.memory.peak_rank.forward_backward_bytes)} at best ({c.label()})")


def _why_slower(best: "Candidate", other: "Candidate") -> str:
    diffs = [("compute", other.compute_s - best.compute_s), ("TP all-reduce", other.tp_s - best.tp_s),
             ("bubble", other.bubble_s - best.bubble_s), ("comm", other.comm_s - best.comm_s)]
    name, delta = max(diffs, key=lambda d: d[1])
    return f"{delta:.3f} s more {name}"
