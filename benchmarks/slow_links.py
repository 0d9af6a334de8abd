"""Training across a slow tier on the link bed: how each way of crossing it pays.

    sudo python benchmarks/slow_links.py [--rounds 3] [--steps 96] [--scale 1e-3]
        [--topology examples/topologies/bed_two_regions.yaml] [--options hsdp_fp32,diloco_h8,...]
        [--out benchmarks/results/slow_links.json]
    sudo python benchmarks/slow_links.py --phase loss [--seeds 2] [--steps 160]
        [--out benchmarks/results/slow_links_loss.json]

Four ranks on four one-slot nodes in two regions of the link bed (``rayflex.testing.linkbed``;
every pair of nodes shaped to its tier x ``--scale``): fast links inside a region, a slow
one between them. Every option trains the same model on the same data for ``--steps``
steps of the same global batch, so after step ``s`` every option has seen the same tokens:

* ``fsdp``: FSDP over all four ranks (every all-gather and reduce-scatter crosses regions);
* ``hsdp_fp32`` / ``hsdp_bf16``: FSDP inside each region, the replica all-reduce across them
  in fp32 / bf16 (``PrecisionConfig.reduce_dtype``);
* ``hsdp_int8``: the replica reduction in int8 with error feedback (``CommConfig(replicate="int8")``);
* ``diloco_h8`` / ``diloco_h32``: DiLoCo, the regions training apart for 8 / 32 steps;
* ``streaming_h32``: DiLoCo H=32 in 4 fragments synchronised in turn;
* ``streaming_h32_overlap``: the same, each fragment's pseudo-gradient sent 2 steps early;
* ``diloco_h32_int8``: DiLoCo H=32 with the pseudo-gradient sent in int8.

``--phase speed`` (the default): options alternate within each round. Per run: tokens/s
over the steps after the warm-up (tokens / the sum of their step times: a DiLoCo sync step
is slow, the others fast), the bytes tc counted per tier over those steps and per token,
the run's own count of bytes over the replicate tier. Once per round HSDP fp32 also runs
with every link at the topology's own speed (effectively free): ``1 - free / shaped`` is
the share of its step the slow tier costs.

``--phase loss``: the loss after the same tokens, which the links do not change (every
option computes the same whatever their speed), so every link runs free and the steps are
many: each option on ``--seeds`` datasets (each its own Markov chain), with a calmer
learning rate than the speed phase's (a loss spike early in a short run sends two runs
that differ by rounding onto different paths: a single run's final loss is then luck).
Per option: the mean over the last ``LOSS_WINDOW`` steps, per seed, and its ratio to
HSDP fp32's on the same seed.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGY = ROOT / "examples" / "topologies" / "bed_two_regions.yaml"
OPTIONS = {
    "fsdp": ({}, {}, {}),
    "hsdp_fp32": ({"dp_shard": 2}, {}, {}),
    "hsdp_bf16": ({"dp_shard": 2}, {}, {"reduce_dtype": "bf16"}),
    "hsdp_int8": ({"dp_shard": 2}, {"replicate": "int8"}, {}),
    "diloco_h8": ({"dp_shard": 2}, {"replicate": "diloco", "inner_steps": 8}, {}),
    "diloco_h32": ({"dp_shard": 2}, {"replicate": "diloco", "inner_steps": 32}, {}),
    "streaming_h32": ({"dp_shard": 2}, {"replicate": "diloco", "inner_steps": 32, "fragments": 4}, {}),
    # The same, each fragment sent 2 steps before its outer step (behind those steps' compute).
    "streaming_h32_overlap": ({"dp_shard": 2}, {"replicate": "diloco", "inner_steps": 32, "fragments": 4,
                                               "overlap_steps": 2}, {}),
    "diloco_h32_int8": ({"dp_shard": 2}, {"replicate": "diloco", "inner_steps": 32, "pseudo_grad": "int8"}, {}),
    # The outer step as plain averaging (lr 1, no momentum): what the outer optimizer adds.
    "diloco_h32_average": ({"dp_shard": 2}, {"replicate": "diloco", "inner_steps": 32, "outer_lr": 1.0,
                                            "outer_momentum": 0.0}, {}),
}
SPEED_OPTIONS = [o for o in OPTIONS if o != "diloco_h32_average"]
# (lr, warm-up steps) per phase; the speed phase's does not change its tokens/s.
OPTIMIZER = {"speed": (1e-2, 4), "loss": (3e-3, 16)}
BASELINE = "hsdp_fp32"
WARM_STEPS = 4
LOSS_WINDOW = 16
SEQ_LEN = 32
GLOBAL_BATCH = 8
SLOW_TIER = "cross_zone"

log = logging.getLogger("slow_links")


def _trainer(root: str, name: str, option: str, steps: int, phase: str = "speed", data: str = "tokens"):
    import rayflex as rf
    from rayflex.models import GPTConfig, gpt

    parallel, comm, precision = OPTIONS[option]
    return rf.Trainer(model=gpt(GPTConfig(vocab_size=128, seq_len=SEQ_LEN, d_model=64, n_layers=4, n_heads=2)),
                      data=rf.DataConfig(uri=f"file://{root}/{data}", seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH),
                      run=rf.RunConfig(name=name, storage=f"file://{root}/runs", steps=steps,
                                       optimizer=rf.OptimizerConfig(lr=OPTIMIZER[phase][0],
                                                                    warmup_steps=OPTIMIZER[phase][1])),
                      scaling=rf.ScalingConfig(num_workers=4),
                      parallel=rf.ParallelConfig(**parallel), comm=rf.CommConfig(**comm),
                      precision=rf.PrecisionConfig(**precision),
                      checkpoint=rf.CheckpointConfig(every_steps=0, resume=False))


def _run(bed, root: str, option: str, steps: int, tag: str, phase: str = "speed", data: str = "tokens") -> dict:
    from rayflex.testing.linkbed.links import subtract

    name = f"{option}-{tag}"
    handle = _trainer(root, name, option, steps, phase, data).submit()
    deadline = time.time() + 900
    while not handle.done() and handle.status()["step"] < WARM_STEPS:
        assert time.time() < deadline, handle.status()
        time.sleep(0.05)
    first, before = handle.status()["step"], bed.counters()
    result = handle.wait(timeout_s=900)
    traffic = subtract(bed.counters(), before)
    metrics = sorted(handle.metrics(), key=lambda m: m["step"])
    counted = [m for m in metrics if m["step"] > first]
    tokens = sum(m.get("tokens_per_s", 0) * m["step_time_s"] for m in counted)
    seconds = sum(m["step_time_s"] for m in counted)
    return {"option": option, "status": result.status, "steps": len(metrics),
            "tokens_per_s": tokens / seconds, "measured_steps": len(counted),
            "bytes_per_token": {k: v / tokens for k, v in traffic["by_tier"].items()},
            "replicate_bytes_per_token": sum(m.get("replicate_bytes", 0) for m in counted) / tokens,
            "sent_bytes_per_token": {role: sum(m.get("sent_bytes", {}).get(role, 0) for m in counted) / tokens
                                     for role in sorted({r for m in counted for r in m.get("sent_bytes", {})})},
            # A DiLoCo step that synchronised against the others: what overlap takes away.
            "sync_step_s": _median([m["step_time_s"] for m in counted if m.get("outer_synced")]),
            "other_step_s": _median([m["step_time_s"] for m in counted if not m.get("outer_synced")]),
            "losses": [m["loss"] for m in metrics],
            "final_loss": statistics.fmean(m["loss"] for m in metrics[-LOSS_WINDOW:]),
            "outer_syncs": sum(m.get("outer_synced", 0) for m in metrics)}


def measure_on_bed(bed) -> dict:
    """Runs in the bed's process (``--call``)."""
    from rayflex.data.dataset import write_synthetic_dataset

    root = os.environ["MEASURE_DIR"]
    steps, rounds = int(os.environ["MEASURE_STEPS"]), int(os.environ["MEASURE_ROUNDS"])
    options = os.environ["MEASURE_OPTIONS"].split(",")
    if os.environ.get("MEASURE_PHASE") == "loss":
        return _loss_on_bed(bed, root, options, steps, seeds=rounds)
    write_synthetic_dataset(f"file://{root}/tokens", num_samples=4096, seq_len=SEQ_LEN, vocab_size=128,
                            num_shards=2, seed=7)
    shaped = bed.plan.scale
    rows, free = [], []
    for rnd in range(rounds):
        bed.rescale(1.0)
        free.append({"round": rnd, **_run(bed, root, BASELINE, steps, f"free{rnd}")})
        bed.rescale(shaped)
        for i in range(len(options)):
            option = options[(i + rnd) % len(options)]
            rows.append({"round": rnd, **_run(bed, root, option, steps, f"r{rnd}")})
            log.warning("round %d %s: %.0f tokens/s, final loss %.3f", rnd, option, rows[-1]["tokens_per_s"],
                        rows[-1]["final_loss"])
    return {"rows": rows, "free": free, "scale": shaped}


def _loss_on_bed(bed, root: str, options: list, steps: int, seeds: int) -> dict:
    from rayflex.data.dataset import write_synthetic_dataset

    bed.rescale(1.0)  # the loss does not depend on the links' speed
    rows = []
    for seed in range(seeds):
        data = f"tokens{seed}"
        write_synthetic_dataset(f"file://{root}/{data}", num_samples=4096, seq_len=SEQ_LEN, vocab_size=128,
                                num_shards=2, seed=100 + seed)
        for i in range(len(options)):
            option = options[(i + seed) % len(options)]
            rows.append({"seed": seed, **_run(bed, root, option, steps, f"s{seed}", "loss", data)})
            log.warning("seed %d %s: final loss %.3f", seed, option, rows[-1]["final_loss"])
    return {"rows": rows, "free": [], "scale": 1.0}


def summarise_loss(bed: dict, options: list, steps: int) -> dict:
    rows = bed["result"]["rows"]
    seeds = sorted({r["seed"] for r in rows})
    base = {r["seed"]: r["final_loss"] for r in rows if r["option"] == BASELINE}
    out: dict = {}
    for option in options:
        mine = {r["seed"]: r for r in rows if r["option"] == option}
        ratios = [mine[s]["final_loss"] / base[s] for s in seeds if s in mine and s in base]
        out[option] = {"final_loss_by_seed": [mine[s]["final_loss"] for s in seeds if s in mine],
                       "final_loss_over_hsdp_fp32_by_seed": ratios,
                       "final_loss_over_hsdp_fp32": _spread(ratios) if ratios else None,
                       "losses_seed0": mine[seeds[0]]["losses"] if seeds[0] in mine else None}
    out["tokens_compared"] = steps * GLOBAL_BATCH * SEQ_LEN
    out["loss_window_steps"] = LOSS_WINDOW
    out["within_2pct"] = [o for o in options if out[o]["final_loss_over_hsdp_fp32"]
                          and out[o]["final_loss_over_hsdp_fp32"]["max"] <= 1.02]
    return out


def _median(values: list):
    return statistics.median(values) if values else None


def _spread(values: list) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(bed: dict, options: list, steps: int) -> dict:
    rows = bed["result"]["rows"]
    by = {o: [r for r in rows if r["option"] == o] for o in options}
    out: dict = {}
    for option, runs in by.items():
        out[option] = {
            "tokens_per_s": _spread([r["tokens_per_s"] for r in runs]),
            "slow_tier_bytes_per_token": _spread([r["bytes_per_token"].get(SLOW_TIER, 0.0) for r in runs]),
            "replicate_bytes_per_token": _spread([r["replicate_bytes_per_token"] for r in runs]),
            "sent_bytes_per_token": {role: _spread([r.get("sent_bytes_per_token", {}).get(role, 0) for r in runs])
                                     for role in sorted({k for r in runs for k in r.get("sent_bytes_per_token", {})})},
            "final_loss": _spread([r["final_loss"] for r in runs]),
            "outer_syncs": runs[0]["outer_syncs"],
            "sync_step_s": (_spread([r["sync_step_s"] for r in runs])
                            if all(r.get("sync_step_s") is not None for r in runs) else None),
            "other_step_s": _spread([r["other_step_s"] for r in runs if r.get("other_step_s") is not None]),
            "losses_round0": runs[0]["losses"],
        }
    base = out.get(BASELINE)
    if base is not None:
        for option, cell in out.items():
            rounds_ratio = []
            for rnd in sorted({r["round"] for r in rows}):
                mine = [r for r in by[option] if r["round"] == rnd]
                theirs = [r for r in by[BASELINE] if r["round"] == rnd]
                if mine and theirs:
                    rounds_ratio.append(mine[0]["tokens_per_s"] / theirs[0]["tokens_per_s"])
            cell["tokens_per_s_over_hsdp_fp32_by_round"] = _spread(rounds_ratio)
            bpt = cell["slow_tier_bytes_per_token"]["median"]
            cell["slow_tier_bytes_fewer_than_hsdp_fp32"] = (base["slow_tier_bytes_per_token"]["median"] / bpt
                                                            if bpt else None)
        free = [r["tokens_per_s"] for r in bed["result"]["free"]]
        shaped = [r["tokens_per_s"] for r in by[BASELINE]]
        # The share of HSDP fp32's step the slow tier costs (same rounds, free links vs shaped).
        out["hsdp_fp32_slow_tier_share"] = _spread([1 - s / f for s, f in zip(shaped, free)])
        out["hsdp_fp32_free_links_tokens_per_s"] = _spread(free)
    cells = {o: c for o, c in out.items() if o in options and o != BASELINE}
    if base is not None and cells:
        best = max(cells, key=lambda o: cells[o]["tokens_per_s_over_hsdp_fp32_by_round"]["median"])
        out["goals"] = {
            "best_option": best,
            "best_tokens_per_s_over_hsdp_fp32": cells[best]["tokens_per_s_over_hsdp_fp32_by_round"]["median"],
            "best_at_least_3x": cells[best]["tokens_per_s_over_hsdp_fp32_by_round"]["median"] >= 3,
            "best_slow_tier_bytes_fewer": cells[best]["slow_tier_bytes_fewer_than_hsdp_fp32"],
            "best_bytes_at_least_8x_fewer": (cells[best]["slow_tier_bytes_fewer_than_hsdp_fp32"] or 0) >= 8,
            # The loss after the same tokens: ``--phase loss`` (several seeds, a calmer schedule).
        }
    return out


def main(argv=None) -> None:
    from common import emit, machine, on_linkbed

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=("speed", "loss"), default="speed")
    parser.add_argument("--rounds", type=int, default=3, help="speed: alternating rounds")
    parser.add_argument("--seeds", type=int, default=2, help="loss: datasets (Markov chains) per option")
    parser.add_argument("--steps", type=int, default=96)
    parser.add_argument("--scale", type=float, default=1e-3)
    parser.add_argument("--topology", default=str(TOPOLOGY))
    parser.add_argument("--options", default=None, help="default: every option of the phase")
    parser.add_argument("--out", default=None)
    parser.add_argument("--resummarise", metavar="JSON", default=None,
                        help="recompute a speed JSON's summary from its runs (no bed) and write it back")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    if args.resummarise:
        data = json.loads(Path(args.resummarise).read_text())
        options = sorted({r["option"] for r in data["runs"]}, key=list(OPTIONS).index)
        data["summary"] = summarise({"result": {"rows": data["runs"], "free": data["free_links"]}}, options,
                                    data["steps"])
        Path(args.out or args.resummarise).write_text(json.dumps(data, indent=2, default=float) + "\n")
        return
    options = args.options.split(",") if args.options else (SPEED_OPTIONS if args.phase == "speed" else list(OPTIONS))
    unknown = [o for o in options if o not in OPTIONS]
    if unknown:
        raise SystemExit(f"unknown options {unknown}: choose from {', '.join(OPTIONS)}")
    if BASELINE not in options:
        options.insert(0, BASELINE)
    with tempfile.TemporaryDirectory(prefix="rayflex-slow-links-") as tmp:
        t0 = time.time()
        bed = on_linkbed(args.topology, args.scale, "slow_links:measure_on_bed",
                         {"MEASURE_DIR": tmp, "MEASURE_STEPS": str(args.steps), "MEASURE_PHASE": args.phase,
                          "MEASURE_ROUNDS": str(args.seeds if args.phase == "loss" else args.rounds),
                          "MEASURE_OPTIONS": ",".join(options)}, tmp)
    summary = summarise(bed, options, args.steps) if args.phase == "speed" else summarise_loss(bed, options, args.steps)
    emit({"benchmark": "slow_links", "phase": args.phase, "machine": machine(),
          "command": " ".join(["python", *sys.argv]), "rounds": args.rounds, "seeds": args.seeds,
          "steps": args.steps, "scale": args.scale, "optimizer": OPTIMIZER[args.phase],
          "topology": os.path.relpath(args.topology, ROOT), "wall_s": round(time.time() - t0, 1),
          "summary": summary, "runs": bed["result"]["rows"],
          "free_links": bed["result"]["free"], "traffic_total": bed["traffic"]["by_tier"]}, args.out)


if __name__ == "__main__":
    main()
