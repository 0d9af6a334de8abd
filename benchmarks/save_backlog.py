"""Saves due every step on a state whose upload takes many steps: what training waits for.

    python benchmarks/save_backlog.py [--gb-per-rank 2] [--ranks 2] [--steps 12] [--step-s 0.25]
                                      [--rounds 2] [--policies defer,wait] [--uploads thread,process]
                                      [--dir /var/tmp] [--out benchmarks/results/save_backlog.json]

Each rank (a process; gloo) holds ``--gb-per-rank`` GB of float32 tensors and runs a loop of
``--steps`` steps: ``--step-s`` seconds of compute (matmuls), then the step boundary a rayflex
worker has — one all-reduce that agrees whether some rank's previous save is still being
written — then ``rayflex.checkpoint.save_timing`` with a save due at every step, and
``AsyncCheckpointer.save`` (local disk) when it says so. Per policy
(``CheckpointConfig.when_busy``: ``defer``, the default, and ``wait``) and uploader
(``CheckpointConfig.upload``: ``thread``, the default, or ``process``), in alternating rounds:
the time each step was blocked by checkpointing (the save call: its staging copy, and with
``wait`` the previous upload), the saves taken and deferred, and the steps' wall time. The
floor is the memory copy itself: the same bytes ``copy_``'d into kept host buffers, timed
in the same round. The goal: with ``defer`` no step blocks more than 2x that floor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine, rank_state, run_ranks, setup_logging  # noqa: E402

POLICIES = ("defer", "wait")


def _compute(seconds: float, a, b) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ b


def _rank(rank: int, world: int, port: int, cfg: dict, results) -> None:
    import torch
    import torch.distributed as dist

    from rayflex.checkpoint.checkpointer import AsyncCheckpointer
    from rayflex.checkpoint.save_timing import save_timing

    tensors, state = rank_state(rank, world, port, cfg["gb_per_rank"])
    copies = [torch.empty_like(t) for t in tensors]  # the floor's destination, kept like staging
    for t, c in zip(tensors, copies):  # touched once: a first copy also pays the page faults
        c.copy_(t)
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    step_no = 1
    # One checkpointer for the whole run, as a run keeps its own (staging buffers and save
    # plans built by an untimed first save); the policy is only the workers' decision. Its own
    # gloo group, as a worker's has: the background save's collectives must not interleave
    # with the step's all-reduce on the default group.
    checkpointers = {}
    for upload in cfg["uploads"]:
        ckpt = AsyncCheckpointer(f"file://{cfg['dir']}/warmup-{upload}", rank=rank, use_async=True, keep=1,
                                 upload=upload, group=dist.new_group(backend="gloo"))
        ckpt.save(state, step=step_no)
        ckpt.wait()
        checkpointers[upload] = ckpt
    step_no += 1
    rows = []
    for rnd in range(cfg["rounds"]):
        for policy, upload in [(p, u) for p in cfg["policies"] for u in cfg["uploads"]]:
            ckpt = checkpointers[upload]
            ckpt.root = f"file://{cfg['dir']}/{policy}-{upload}"
            dist.barrier()
            t0 = time.perf_counter()
            for t, c in zip(tensors, copies):
                c.copy_(t)
            floor_s = time.perf_counter() - t0
            dist.barrier()
            blocked, deferred, saved, pending = [], 0, 0, False
            start = time.perf_counter()
            for _ in range(cfg["steps"]):
                _compute(cfg["step_s"], a, b)
                flag = torch.tensor([float(ckpt.busy())])
                dist.all_reduce(flag)
                timing = save_timing(due=True, required=False, busy=bool(flag[0] > 0), pending=pending,
                                     when_busy=policy)
                pending = timing.pending
                deferred += timing.deferred_now
                t_save = time.perf_counter()
                if timing.save:
                    reports = ckpt.save(state, step=step_no)
                    saved += 1
                    assert not any(r.get("error") for r in reports), reports
                blocked.append(time.perf_counter() - t_save)
                step_no += 1
            loop_s = time.perf_counter() - start
            ckpt.wait()  # the round's last upload ends outside the timed steps
            worst = torch.tensor([max(blocked), floor_s])
            dist.all_reduce(worst, op=dist.ReduceOp.MAX)
            if rank == 0:
                rows.append({"round": rnd, "policy": policy, "upload": upload, "floor_copy_s": float(worst[1]),
                             "blocked_s": blocked, "max_blocked_s": float(worst[0]), "saves": saved,
                             "deferred": deferred, "steps": cfg["steps"], "loop_s": loop_s})
                print(f"[save_backlog] round {rnd + 1}: {policy}, {upload} upload: {saved} saves, max blocked "
                      f"{float(worst[0]):.3f}s (copy floor {float(worst[1]):.3f}s), loop {loop_s:.1f}s",
                      file=sys.stderr, flush=True)
    for ckpt in checkpointers.values():
        ckpt.close()
    if rank == 0:
        results.put({"bytes_per_rank": sum(t.numel() * 4 for t in tensors), "rows": rows})
    dist.destroy_process_group()


def _summary(rows: list[dict], step_s: float) -> dict:
    """Per policy (the thread upload's, as before) and, with another upload, per ``policy/upload``."""
    out = {}
    cells = sorted({(r["policy"], r.get("upload", "thread")) for r in rows})
    for policy, upload in cells:
        mine = [r for r in rows if r["policy"] == policy and r.get("upload", "thread") == upload]
        ratio = [r["max_blocked_s"] / r["floor_copy_s"] for r in mine]
        out[policy] = {
            "max_blocked_over_copy_floor": {"median": statistics.median(ratio), "min": min(ratio), "max": max(ratio),
                                            "rounds": ratio},
            "median_blocked_s_per_step": statistics.median(b for r in mine for b in r["blocked_s"]),
            "saves_per_round": [r["saves"] for r in mine], "deferred_per_round": [r["deferred"] for r in mine],
            "step_slowdown": statistics.median(r["loop_s"] / (r["steps"] * step_s) for r in mine),
            "step_slowdown_by_round": [r["loop_s"] / (r["steps"] * step_s) for r in mine],
        }
        if upload != "thread":
            out[f"{policy}/{upload}"] = out.pop(policy)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gb-per-rank", type=float, default=2.0)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--step-s", type=float, default=0.25, help="compute per step, seconds")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--policies", default=",".join(POLICIES), help="CheckpointConfig.when_busy values")
    ap.add_argument("--uploads", default="thread", help="CheckpointConfig.upload values: thread,process")
    ap.add_argument("--dir", default=None, help="where the files go (default: a new directory under /var/tmp)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    setup_logging()

    root = tempfile.mkdtemp(prefix="rayflex-backlog-", dir=args.dir or "/var/tmp")
    cfg = {"gb_per_rank": args.gb_per_rank, "rounds": args.rounds, "steps": args.steps, "step_s": args.step_s,
           "dir": root, "policies": args.policies.split(","), "uploads": args.uploads.split(",")}
    try:
        got = run_ranks(_rank, args.ranks, cfg)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary = _summary(got["rows"], args.step_s)
    emit({"benchmark": "save_backlog", "machine": machine(), "command": " ".join(sys.argv),
          "workload": {"ranks": args.ranks, "bytes_per_rank": got["bytes_per_rank"], "steps": args.steps,
                       "step_compute_s": args.step_s, "rounds": args.rounds, "save_due": "every step",
                       "storage": f"local disk ({root.rsplit('/', 1)[0]})", "uploads": cfg["uploads"]},
          "results": summary,
          "goal": {"defer_max_blocked_within_2x_copy_floor":
                   summary["defer"]["max_blocked_over_copy_floor"]["max"] <= 2.0} if "defer" in summary else None,
          "rows": got["rows"]},
         args.out)


if __name__ == "__main__":
    main()
