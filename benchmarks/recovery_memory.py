"""The memory path of recovery (``python benchmarks/recovery.py --memory``).

Two measurements on one loopback cluster (2 nodes x 2 CPUs) with moto's S3 on 127.0.0.1
as the checkpoint store:

* ``restore``: one rank's state (``--memory-mb``, >= 200 MB so the difference is not noise)
  saved once through the replicating writer — into S3, its node's keeper and the other
  node's — then loaded again and again, the sources alternating in rounds: from S3, from
  the node's own memory copy, from the replica on the other node. Median and spread per
  source; every load is checked bit for bit against what was saved. The keepers' measured
  resident memory (peak over baseline) is compared with the node budget.
* ``fault_to_resumed``: the real training path, SIGKILL of a rank and removal of a node,
  each with and without memory replicas (alternating), from the fault to the first step
  the restarted run completes. The model is sized so a restore moves real bytes
  (``--memory-vocab``/``--memory-d-model``); storage is S3 in both.

The committed results: ``--steps 16 --every 4 --fault-at 11 --memory-rounds 3`` (the fault
three steps after a save: ``recovery_memory.json``) and ``--fault-at 8`` (during the save of
step 8: ``recovery_memory_fault_during_save.json``). ``--live`` adds a third path, live recovery
from the survivors' memory, and runs every path as HSDP 2 x 2 (the same workload otherwise;
``recovery_live.json``).
"""

from __future__ import annotations

import os
import statistics
import time

SOURCES = ("s3", "own_copy", "replica")


class RestoreRank:
    """One rank on a chosen node: saves a state once, then loads it from a chosen source."""

    def __init__(self, run: str, node_id: str, mb: int):
        import torch

        self.run, self.node_id = run, node_id
        g = torch.Generator().manual_seed(0)
        n = 64
        per = mb * 2**20 // 4 // n
        self.state = {f"layer{i}.w": torch.randn(per, generator=g) for i in range(n)}
        self.nbytes = sum(t.numel() * 4 for t in self.state.values())

    def save(self, uri: str) -> dict:
        import torch.distributed.checkpoint as dcp

        from rayflex.checkpoint.replicas.client import ReplicaClient
        from rayflex.checkpoint.replicas.dcp_io import ReplicatingWriter
        from rayflex.storage.fs import fsspec_kwargs

        writer = ReplicatingWriter(uri, step=1, client=ReplicaClient(self.run, self.node_id),
                                   single_file_per_rank=True, sync_files=False, **fsspec_kwargs(uri))
        t0 = time.perf_counter()
        dcp.save(self.state, storage_writer=writer)
        if not writer.off_node:  # every copy confirmed (own node and the peer) before the upload
            raise RuntimeError(f"not kept on both nodes: {writer.kept}")
        return {"save_s": time.perf_counter() - t0, "kept": writer.kept, "bytes": self.nbytes}

    def load(self, uri: str, source: str) -> dict:
        import torch
        import torch.distributed.checkpoint as dcp
        from rayflex.checkpoint.replicas.client import ReplicaClient
        from rayflex.checkpoint.replicas.dcp_io import MemoryFirstReader
        from rayflex.checkpoint.dcp_io import CheckpointReader
        from rayflex.storage.fs import fsspec_kwargs

        target = {k: torch.empty_like(v) for k, v in self.state.items()}
        client = ReplicaClient(self.run, self.node_id)
        t0 = time.perf_counter()
        if source == "s3":
            reader = CheckpointReader(uri, **fsspec_kwargs(uri), skip_instance_cache=True)
        else:
            holders, _ = client.locate(1, uri, ["__0_0.distcp"])
            mine = source == "own_copy"
            holders = {f: [h for h in hs if (h.node_id == self.node_id) == mine] for f, hs in holders.items()}
            reader = MemoryFirstReader(uri, step=1, holders=holders, client=client, **fsspec_kwargs(uri))
        dcp.load(target, storage_reader=reader)
        seconds = time.perf_counter() - t0
        report = getattr(reader, "report", {})
        if source != "s3" and report["files"]["storage"]:
            raise RuntimeError(f"{source}: read from storage: {report}")
        equal = all(torch.equal(target[k], self.state[k]) for k in self.state)
        return {"seconds": seconds, "bitwise_equal": equal}


def restore_benchmark(lc, storage: str, mb: int, rounds: int, log, budget_mb: float) -> dict:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from rayflex.planning.topology import Topology
    from rayflex.checkpoint.replicas.keepers import KeeperSet

    run = "restore-bench"
    nodes = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
    # A tight budget (the file's 2x arrival peak plus a little): the measured peak must stay under it.
    keepers = KeeperSet(run, copies=1, budget_bytes=int(budget_mb * 2**20))
    keepers.cover(set(nodes), Topology.from_ray())
    rank = ray.remote(num_cpus=1)(RestoreRank).options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=lc.head_id, soft=False)).remote(run, lc.head_id, mb)
    uri = f"{storage}/restore-bench/step_00000001"
    try:
        saved = ray.get(rank.save.remote(uri))
        log(f"restore: saved {saved['bytes'] / 2**20:.0f} MiB in {saved['save_s']:.1f}s (kept: {saved['kept']})")
        times: dict = {s: [] for s in SOURCES}
        equal = True
        for r in range(rounds):
            order = SOURCES if r % 2 == 0 else tuple(reversed(SOURCES))
            for source in order:
                got = ray.get(rank.load.remote(uri, source))
                times[source].append(got["seconds"])
                equal = equal and got["bitwise_equal"]
            log(f"restore round {r}: " + ", ".join(f"{s} {times[s][-1]:.2f}s" for s in SOURCES))
        stats = keepers.stats()
    finally:
        ray.kill(rank)
        keepers.clear()
    med = {s: statistics.median(v) for s, v in times.items()}
    memory = {node: {"budget_bytes": st["budget_bytes"], "peak_held_bytes": st["peak_held_bytes"],
                     # measured: the keeper's private memory (USS) at its highest, over its start
                     "peak_private_over_baseline_bytes": st["peak_private_bytes"] - st["baseline_private_bytes"],
                     "peak_rss_over_baseline_bytes": st["peak_rss_bytes"] - st["baseline_rss_bytes"],
                     "within_budget": st["peak_private_bytes"] - st["baseline_private_bytes"] <= st["budget_bytes"]}
              for node, st in stats.items() if "error" not in st}
    return {"state_bytes_per_rank": saved["bytes"], "rounds": rounds, "seconds": times,
            "median_s": med, "spread_s": {s: [min(v), max(v)] for s, v in times.items()},
            "own_copy_over_s3": med["own_copy"] / med["s3"], "replica_over_s3": med["replica"] / med["s3"],
            "bitwise_equal": equal, "keeper_memory": memory,
            "goal_memory_le_0.2_s3": max(med["own_copy"], med["replica"]) <= 0.2 * med["s3"],
            "goal_within_budget": all(m["within_budget"] for m in memory.values())}


# The recovery paths: (memory replicas, live recovery). ``--live`` adds the survivors' memory;
# every path then runs HSDP 2 x 2, so only where the restart reads its state differs.
PATHS = {"storage": (0, False), "memory": (1, False), "live": (0, True)}


def fault_benchmark(lc, run_rayflex, data: str, storage: str, args, log) -> dict:
    """fault -> first resumed step for kill and node loss, per recovery path, the paths in
    a rotating order round by round."""
    cases: dict = {}
    kinds = args.memory_fault_kinds.split(",")
    paths = list(PATHS) if getattr(args, "live", False) else ["storage", "memory"]
    if getattr(args, "paths", None):
        paths = [p for p in args.paths.split(",") if p in PATHS]
    for fault in kinds:
        for r in range(args.memory_rounds):
            for path in paths[r % len(paths):] + paths[:r % len(paths)]:  # rotating order
                replicas, live = PATHS[path]
                key = f"{fault}/{path}"
                name = f"{path}-{fault.replace('_', '-')}-{r}"
                log(f"--- fault path {key} round {r}")
                got = run_rayflex(lc, fault, data, storage, name, args, memory_replicas=replicas, live_recovery=live,
                                  dp_shard=2 if getattr(args, "live", False) else None)
                got["after_run"] = lc.settle()
                if fault == "remove_node":
                    lc.restore(args.memory_nodes)
                loaded = got.get("checkpoint_loaded") or {}
                cases.setdefault(key, []).append({k: got.get(k) for k in (
                    "fault_to_resumed_step_s", "fault_to_kept_resumed_step_s", "detection_s", "restart_setup_s",
                    "steps_lost", "restart_phases_s", "recovery_chosen", "detect_to_setup_start_s",
                    "timeline_s")} | {
                    "load_s": loaded.get("load_s"), "sources": loaded.get("sources"), "loaded_from": loaded.get("uri"),
                    "status": got.get("final", {}).get("status")})
    out: dict = {"runs": cases, "median_fault_to_resumed_step_s": {}, "spread_fault_to_resumed_step_s": {},
                 "steps_lost": {}, "ratio_memory_over_storage": {}}
    for fault in kinds:
        meds, spreads = {}, {}
        for path in paths:
            vals = [c["fault_to_kept_resumed_step_s"] for c in cases[f"{fault}/{path}"]
                    if c["fault_to_kept_resumed_step_s"] is not None]
            meds[path] = statistics.median(vals) if vals else None
            spreads[path] = [min(vals), max(vals)] if vals else None
            out["steps_lost"][f"{fault}/{path}"] = [c["steps_lost"] for c in cases[f"{fault}/{path}"]]
        out["median_fault_to_resumed_step_s"][fault] = meds
        out["spread_fault_to_resumed_step_s"][fault] = spreads
        out["ratio_memory_over_storage"][fault] = (meds["memory"] / meds["storage"]
                                                   if meds.get("memory") and meds.get("storage") else None)
        if "live" in paths and "memory" in paths:
            out.setdefault("ratio_live_over_memory", {})[fault] = (meds["live"] / meds["memory"]
                                                                   if meds["live"] and meds["memory"] else None)
    if "storage" in paths and "memory" in paths:
        out["goal_30pct_lower"] = all(r is not None and r <= 0.7 for r in out["ratio_memory_over_storage"].values())
    if "live" in paths and "memory" in paths:
        out["goal_live_0_steps_lost"] = all(n == 0 for f in kinds for n in out["steps_lost"][f"{f}/live"])
        out["goal_live_le_0.8_memory"] = all(r is not None and r <= 0.8 for r in out["ratio_live_over_memory"].values())
    return out


def memory_main(args, log, run_rayflex, LoopbackCluster) -> dict:
    import tempfile

    from checkpoint import start_s3

    from rayflex.data.dataset import write_synthetic_dataset

    storage, server = start_s3()
    os.environ.pop("RAY_ADDRESS", None)
    lc = LoopbackCluster(nodes=args.memory_nodes, cpus=2, object_store_bytes=args.memory_object_store_mb * 2**20)
    tmp = tempfile.mkdtemp(prefix="rayflex-recovery-memory-")
    try:
        import ray

        # --live compares the fault paths only (the restore from memory vs S3 is recovery_memory.json's).
        restore = (None if getattr(args, "live", False) else
                   restore_benchmark(lc, storage, args.memory_mb, args.memory_rounds_restore, log,
                                     budget_mb=2.25 * args.memory_mb))
        # Ray sizes each node's object store from /dev/shm: a result larger than it passes
        # through Ray's disk fallback (what this machine measures; a GPU node has GBs).
        out = {"restore": restore, "object_store_bytes_per_node":
               ray.cluster_resources().get("object_store_memory", 0) / args.memory_nodes}
        if args.memory_faults:
            data = write_synthetic_dataset(f"file://{tmp}/data", num_samples=512, seq_len=args.memory_seq,
                                           vocab_size=args.memory_vocab, num_shards=2, seed=7)
            out["fault_to_resumed"] = fault_benchmark(lc, run_rayflex, data, storage, args, log)
        return out
    finally:
        import shutil

        lc.close()
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
