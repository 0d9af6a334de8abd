"""Setup memory of a rank loading Hugging Face weights at dp=4: rayflex's meta-device build
filled block by block from the safetensors files, vs every rank loading the whole model
with ``from_pretrained`` and then sharding it (the peer), in the same run.

    python benchmarks/hf_load_memory.py [--rounds 2] [--workdir DIR] [--out results/hf_load_memory.json]

A random-weight Llama (24 layers, hidden 1024, ~374M parameters; nothing is downloaded)
is saved once with ``save_pretrained`` as ~500 MB safetensors shards. Each load then runs
in 4 fresh gloo processes on CPU (dp=4, pp=1), rounds alternating the systems (A B A B):

* ``rayflex``: ``causal_lm(dir, init_from=dir)`` (made here, pickled to the ranks as the
  driver hands it to workers) through ``build_sharded_stages`` with the worker's own
  ``shard_stage`` call (no pipeline: ``pipelined=False``, default precision and memory).
* ``naive``: ``AutoModelForCausalLM.from_pretrained(dir)`` in full on each rank, then
  ``fully_shard`` on each decoder layer and the model (the same mesh and recipe).

A rank's setup memory is its peak RSS during the load minus its RSS just before (after
imports, the process group and the mesh); the peak is the kernel's VmHWM, reset at the
baseline through ``/proc/self/clear_refs``, and a thread samples ``/proc/self/status``
every 5 ms for the split into anonymous and file-backed (mmap'd safetensors) pages. The
modeled bound is this rank's shard bytes (its quarter of the fp32 parameters) plus the
largest single block. After the load every rank compares each of its local shards with
its slice of the safetensors tensor, bitwise. Prints JSON: per system the per-rank peaks
per round, the median and spread of the largest rank, peak/bound, and the machine load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine, setup_logging  # noqa: E402

MB = 1 << 20
SYSTEMS = ("rayflex", "naive")
CLAIM_RATIO = 1.3


def llama_config(args):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                       num_hidden_layers=args.layers, num_attention_heads=args.heads,
                       num_key_value_heads=args.heads, max_position_embeddings=2048,
                       tie_word_embeddings=False)


# ------------------------------------------------------------------------------ weights
def _save(config, root: str, max_shard_size: str) -> None:
    """Random HF-initialised weights (seeded), saved as sharded fp32 safetensors."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(root, max_shard_size=max_shard_size)


def ensure_weights(config, root: str, max_shard_size: str) -> None:
    """Save once (in a child process, so this one never holds the model); a directory
    already holding this config's weights is reused."""
    import multiprocessing as mp

    marker = os.path.join(root, "hf_load_memory.config.json")
    wanted = {"config": config.to_dict(), "max_shard_size": max_shard_size}
    if os.path.isfile(marker) and os.path.isfile(os.path.join(root, "model.safetensors.index.json")):
        with open(marker) as f:
            if json.load(f) == json.loads(json.dumps(wanted)):
                return
    os.makedirs(root, exist_ok=True)
    proc = mp.get_context("spawn").Process(target=_save, args=(config, root, max_shard_size))
    proc.start()
    proc.join(600)
    if proc.exitcode != 0:
        if proc.is_alive():
            proc.kill()
        raise RuntimeError(f"saving the weights into {root} failed (exit code {proc.exitcode})")
    with open(marker, "w") as f:
        json.dump(wanted, f)


# ------------------------------------------------------------------------------ one rank
def _status_kb() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key = line.split(":", 1)[0]
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(line.split()[1])
    return out


def _reset_peak() -> bool:
    """Make VmHWM start again from the current RSS (Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class RssSampler:
    """Samples this process's RSS every ``period_s`` in a thread: the largest VmRSS seen,
    with its anonymous / file-backed split, and the largest of each on its own."""

    def __init__(self, period_s: float = 0.005):
        self.period_s = period_s
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self.at_peak: dict[str, int] = {}
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            s = _status_kb()
            self.samples += 1
            if s["VmRSS"] > self.peak["VmRSS"]:
                self.at_peak = s
            for k in self.peak:
                self.peak[k] = max(self.peak[k], s[k])
            self._stop.wait(self.period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def _load_rayflex(spec, plan, rank, dp_mesh):
    import torch

    from rayflex.models.hf import to_hf_key
    from rayflex.worker.meta_init import build_sharded_stages
    from rayflex.worker.parallelize import shard_stage

    last = plan.num_stages - 1

    def shard(s, module):  # TrainWorker.setup's call, without a pipeline, default precision/memory
        return shard_stage(module, dp_mesh, pipelined=plan.pp > 1, last=s == last)

    stages = build_sharded_stages(spec, plan, rank, torch.device("cpu"), shard=shard)
    return stages, [(to_hf_key(spec, name), p) for _, m in stages for name, p in m.named_parameters()]


def _load_naive(root, dp_mesh):
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(root, local_files_only=True, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    for layer in model.model.layers:
        fully_shard(layer, mesh=dp_mesh, reshard_after_forward=True)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=True)
    return model, list(model.named_parameters())


def _check_shards(named, root: str, rank: int, world: int) -> dict:
    """Each local shard equals its rows of the safetensors tensor, bit for bit (Shard(0):
    ``torch.chunk``'s rows, read with ``get_slice`` so only this rank's rows are read)."""
    import torch
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, Shard

    with open(os.path.join(root, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    files: dict[str, list] = {}
    for key, param in named:
        files.setdefault(weight_map[key], []).append((key, param))
    checked, elements, bad = 0, 0, []
    for name, items in files.items():
        with safe_open(os.path.join(root, name), framework="pt", device="cpu") as f:
            for key, param in items:
                if not isinstance(param, DTensor) or tuple(param.placements) != (Shard(0),):
                    bad.append(f"{key}: not a Shard(0) DTensor")
                    continue
                rows = param.shape[0]
                chunk = -(-rows // world)
                lo, hi = min(rank * chunk, rows), min((rank + 1) * chunk, rows)
                want = f.get_slice(key)[lo:hi]
                local = param.to_local().detach()
                if local.shape != want.shape or not torch.equal(local.view(torch.int32), want.view(torch.int32)):
                    bad.append(key)
                checked += 1
                elements += local.numel()
    return {"tensors_checked": checked, "elements_checked": elements, "mismatched": bad[:8],
            "bitwise_equal": not bad and checked == len(named)}


def _rank(rank: int, world: int, port: int, system: str, spec, root: str, out, timeout_s: float) -> None:
    import faulthandler
    import gc
    import resource
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import rayflex as rf
    import rayflex.models.hf  # noqa: F401 - both systems start with transformers and rayflex imported
    import transformers.models.llama.modeling_llama  # noqa: F401
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.parallelize import build_device_mesh, data_parallel_mesh

    faulthandler.dump_traceback_later(timeout_s, exit=True)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    plan = plan_mesh(spec, rf.ParallelConfig(), rf.DataConfig(uri="file:///unused", global_batch=world), world)
    dp_mesh = data_parallel_mesh(build_device_mesh(plan, "cpu"), plan)
    gc.collect()
    dist.barrier()
    base = _status_kb()
    maxrss_before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    reset = _reset_peak()
    t0 = time.perf_counter()
    with RssSampler() as sampler:
        if system == "rayflex":
            held, named = _load_rayflex(spec, plan, rank, dp_mesh)
        else:
            held, named = _load_naive(root, dp_mesh)
        gc.collect()
    load_s = time.perf_counter() - t0
    end = _status_kb()
    maxrss_after_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_kb = max(end["VmHWM"], sampler.peak["VmRSS"]) if reset else maxrss_after_kb
    shard_bytes = sum(p.to_local().numel() * p.element_size() for _, p in named)
    check = _check_shards(named, root, rank, world)
    dist.barrier()
    out.put((rank, {
        "setup_mb": (peak_kb - base["VmRSS"]) / 1024, "baseline_rss_mb": base["VmRSS"] / 1024,
        "peak_rss_mb": peak_kb / 1024, "after_mb": (end["VmRSS"] - base["VmRSS"]) / 1024,
        "sampled_peak_mb": (sampler.peak["VmRSS"] - base["VmRSS"]) / 1024,
        "sampled_at_peak": {"anon_mb": (sampler.at_peak.get("RssAnon", 0) - base["RssAnon"]) / 1024,
                            "file_mb": (sampler.at_peak.get("RssFile", 0) - base["RssFile"]) / 1024},
        "sampled_peak_file_mb": (sampler.peak["RssFile"] - base["RssFile"]) / 1024,
        "samples": sampler.samples, "maxrss_before_mb": maxrss_before_kb / 1024,
        "maxrss_after_mb": maxrss_after_kb / 1024, "peak_reset": reset, "shard_mb": shard_bytes / MB,
        "load_s": load_s, "check": check}))
    faulthandler.cancel_dump_traceback_later()
    del held, named
    dist.destroy_process_group()


def run_load(system: str, world: int, spec, root: str, timeout_s: float) -> list[dict]:
    """One load in ``world`` fresh processes; a rank that dies or outlives ``timeout_s``
    (it then prints its stack: faulthandler) fails the run at once instead of a silent wait."""
    import multiprocessing as mp
    import queue

    from rayflex.local_ray import free_ports

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_ports(1)[0]
    procs = [ctx.Process(target=_rank, args=(r, world, port, system, spec, root, out, timeout_s))
             for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s + 30
    try:
        while len(got) < world:
            try:
                rank, answer = out.get(timeout=2)
                got[rank] = answer
                continue
            except queue.Empty:
                pass
            dead = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in got]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(f"{system} load: ranks {sorted(got)} answered, exited without answering "
                                   f"(rank, exit code): {dead}, within {timeout_s:.0f} s; see the ranks' stderr")
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world)]


# ------------------------------------------------------------------------------ driver
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--max-shard-size", default="500MB")
    ap.add_argument("--workdir", default=None, help="where the weights are saved (kept; reused if they match)")
    ap.add_argument("--rank-timeout", type=float, default=420, help="seconds a rank may take (then it fails)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    setup_logging()
    load_before = os.getloadavg()

    from rayflex.models.hf import causal_lm

    config = llama_config(args)
    tmp = None if args.workdir else tempfile.TemporaryDirectory(prefix="hf_load_memory-")
    root = os.path.abspath(args.workdir or tmp.name)
    try:
        t0 = time.perf_counter()
        ensure_weights(config, root, args.max_shard_size)
        save_s = time.perf_counter() - t0
        with open(os.path.join(root, "model.safetensors.index.json")) as f:
            n_files = len(set(json.load(f)["weight_map"].values()))
        spec = causal_lm(root, init_from=root)  # checks keys and shapes against the files
        counts = spec.param_counts()
        params = sum(counts)
        print(f"llama {args.layers}x{args.hidden} (ffn {args.intermediate}, vocab {args.vocab}): {params:,} "
              f"parameters, {params * 4 / MB:.1f} MB fp32, {n_files} safetensors files in {root}", file=sys.stderr)
        runs: dict[str, list[list[dict]]] = {s: [] for s in SYSTEMS}
        for r in range(args.rounds):
            for system in SYSTEMS:
                ranks = run_load(system, args.world, spec, root, args.rank_timeout)
                runs[system].append(ranks)
                print(f"round {r} {system}: setup MB per rank {[round(x['setup_mb']) for x in ranks]}, "
                      f"load {max(x['load_s'] for x in ranks):.1f} s", file=sys.stderr)
    finally:
        if tmp is not None:
            tmp.cleanup()

    largest_block_bytes = max(counts) * 4
    shard_bytes = [runs["rayflex"][0][r]["shard_mb"] * MB for r in range(args.world)]
    bound_mb = [(b + largest_block_bytes) / MB for b in shard_bytes]

    def summary(system: str) -> dict:
        rounds = runs[system]
        per_rank = [statistics.median(ranks[r]["setup_mb"] for ranks in rounds) for r in range(args.world)]
        worst = [max(x["setup_mb"] for x in ranks) for ranks in rounds]  # the rank that must fit
        worst_ratio = [max(x["setup_mb"] / bound_mb[r] for r, x in enumerate(ranks)) for ranks in rounds]
        return {
            "setup_mb_median": statistics.median(worst), "setup_mb_min": min(worst), "setup_mb_max": max(worst),
            "setup_mb_per_rank_median": [round(x, 1) for x in per_rank],
            "setup_mb_per_round_per_rank": [[round(x["setup_mb"], 1) for x in ranks] for ranks in rounds],
            "ratio_to_bound_per_rank_median": [round(x / b, 3) for x, b in zip(per_rank, bound_mb)],
            "ratio_to_bound_median": statistics.median(worst_ratio),
            "ratio_to_bound_min": min(worst_ratio), "ratio_to_bound_max": max(worst_ratio),
            "baseline_rss_mb_per_round_per_rank": [[round(x["baseline_rss_mb"], 1) for x in ranks]
                                                   for ranks in rounds],
            "peak_rss_mb_per_round_per_rank": [[round(x["peak_rss_mb"], 1) for x in ranks] for ranks in rounds],
            "sampled_peak_mb_per_round_per_rank": [[round(x["sampled_peak_mb"], 1) for x in ranks]
                                                   for ranks in rounds],
            "sampled_at_peak_anon_file_mb_rank0": [[round(ranks[0]["sampled_at_peak"]["anon_mb"], 1),
                                                    round(ranks[0]["sampled_at_peak"]["file_mb"], 1)]
                                                   for ranks in rounds],
            "sampled_peak_file_mb_max": round(max(x["sampled_peak_file_mb"] for ranks in rounds for x in ranks), 1),
            "after_load_mb_median": statistics.median(x["after_mb"] for ranks in rounds for x in ranks),
            "load_s_median": statistics.median(max(x["load_s"] for x in ranks) for ranks in rounds),
            "shard_mb": [round(x["shard_mb"], 1) for x in rounds[0]],
            "peak_reset": all(x["peak_reset"] for ranks in rounds for x in ranks),
            "bitwise_equal": all(x["check"]["bitwise_equal"] for ranks in rounds for x in ranks),
            "tensors_checked_per_rank": rounds[0][0]["check"]["tensors_checked"],
            "mismatched": sorted({k for ranks in rounds for x in ranks for k in x["check"]["mismatched"]}),
        }

    result = {s: summary(s) for s in SYSTEMS}
    ok = result["rayflex"]["ratio_to_bound_median"] <= CLAIM_RATIO
    emit({"benchmark": "hf_load_memory", "machine": machine(), "loadavg_before": list(load_before),
          "loadavg_after": list(os.getloadavg()), "world": args.world, "dp": args.world, "pp": 1,
          "rounds": args.rounds, "order": "A B per round (rayflex, naive)",
          "model": {"family": "llama", "layers": args.layers, "hidden": args.hidden,
                    "intermediate": args.intermediate, "heads": args.heads, "vocab": args.vocab,
                    "tie_word_embeddings": False, "dtype": "float32"},
          "params": params, "safetensors_files": n_files, "max_shard_size": args.max_shard_size,
          "save_s": save_s, "full_model_mb": params * 4 / MB, "largest_block_mb": largest_block_bytes / MB,
          "layer_block_mb": counts[1] * 4 / MB, "shard_mb_per_rank": [round(b / MB, 1) for b in shard_bytes],
          "bound_mb_per_rank": [round(b, 1) for b in bound_mb],
          "bound": "this rank's shard bytes + the largest single block's bytes (fp32)",
          "rayflex": result["rayflex"], "naive": result["naive"],
          "rayflex_over_naive": result["rayflex"]["setup_mb_median"] / result["naive"]["setup_mb_median"],
          "claim": f"rayflex peak <= {CLAIM_RATIO} x (shard + largest block) on every rank",
          "claim_holds": ok and result["rayflex"]["bitwise_equal"]}, args.out)


if __name__ == "__main__":
    main()
