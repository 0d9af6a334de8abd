"""The plain-torchrun peer of ``compare.py``: what a user writes without a framework.

    python -m torch.distributed.run --standalone --nproc-per-node 4 --max-restarts 3 \\
        benchmarks/compare_torchrun_worker.py --config cfg.json

FSDP2 (``fully_shard`` per block + root) over gloo, the same model, samples (``GlobalSampler``),
AdamW, cosine LR and grad clip as the rayflex and Ray Train runs; a synchronous torch DCP
checkpoint every ``every`` steps into ``ckpt_dir/step_XXXXXXXX`` (complete once DCP's
``.metadata`` exists, which rank 0 writes last); on (re)start every rank loads the newest
complete one. One JSON line per event goes to ``cfg["log"]``: a ``start`` line per rank
(pid, ``TORCHELASTIC_RESTART_COUNT``, step resumed from) and a ``step`` line per step from
rank 0 (wall time, loss, compute time, time blocked by the checkpoint).
"""

from __future__ import annotations

import time

T_ENTER = time.time()  # before importing torch: the process start, as near as the script sees it

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402


def latest_complete(ckpt_dir: str) -> tuple[int, str | None]:
    """(step, path) of the newest step directory DCP finished writing, else (0, None)."""
    if not os.path.isdir(ckpt_dir):
        return 0, None
    done = sorted(d for d in os.listdir(ckpt_dir)
                  if d.startswith("step_") and os.path.exists(os.path.join(ckpt_dir, d, ".metadata")))
    return (int(done[-1][5:]), os.path.join(ckpt_dir, done[-1])) if done else (0, None)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="JSON file: gpt, lr, betas, clip, min_lr_ratio, "
                                                    "global_batch, steps, every, keep, data, ckpt_dir, log")
    with open(ap.parse_args().config) as f:
        cfg = json.load(f)

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rayflex.data.dataset import GlobalSampler, TokenDataset
    from rayflex.models import GPTConfig, build_stage, gpt

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # torchrun's env:// rendezvous
    rank, world = dist.get_rank(), dist.get_world_size()
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    mesh = init_device_mesh("cpu", (world,))
    spec = gpt(GPTConfig(**cfg["gpt"]))
    model = build_stage(spec, list(range(spec.num_blocks)))
    for i in model.indices:
        fully_shard(model.blocks[str(i)], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=tuple(cfg["betas"]), weight_decay=0.0,
                            **cfg.get("adamw_kwargs", {}))  # {}: torch's default kernel

    # Rank 0 decides which checkpoint every rank loads (a save a kill interrupted has no .metadata).
    choice = [latest_complete(cfg["ckpt_dir"]) if rank == 0 else None]
    dist.broadcast_object_list(choice, src=0)
    start, path = choice[0]
    if path is not None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    def note(rec: dict) -> None:
        with open(cfg["log"], "a") as f:
            f.write(json.dumps(rec) + "\n")

    note({"event": "start", "rank": rank, "pid": os.getpid(), "restart": restart, "time": T_ENTER,
          "ready": time.time(), "resumed_from": start})
    ds = TokenDataset(cfg["data"])
    sampler = GlobalSampler(len(ds), cfg["global_batch"], 0, block_rows=ds.block_rows)  # rayflex's order
    seq, steps, every = cfg["gpt"]["seq_len"], cfg["steps"], cfg["every"]
    for step in range(start, steps):
        t0 = time.perf_counter()
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, step / max(1, steps))))  # rayflex's schedule
        for g in opt.param_groups:
            g["lr"] = cfg["lr"] * (cfg["min_lr_ratio"] + (1 - cfg["min_lr_ratio"]) * cosine)
        rows = ds.rows(sampler.indices(step, rank, world))
        x, y = rows[:, :seq], rows[:, 1:seq + 1]
        opt.zero_grad(set_to_none=True)
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        lv = loss.detach().clone()
        dist.all_reduce(lv)
        done, compute_s, ckpt_s = step + 1, time.perf_counter() - t0, None
        if done % every == 0 or done == steps:
            t1 = time.perf_counter()
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(cfg["ckpt_dir"], f"step_{done:08d}"))
            ckpt_s = time.perf_counter() - t1
            if rank == 0:  # retention: the newest ``keep`` complete checkpoints
                old = sorted(d for d in os.listdir(cfg["ckpt_dir"]) if d.startswith("step_"))[:-cfg["keep"]]
                for d in old:
                    shutil.rmtree(os.path.join(cfg["ckpt_dir"], d), ignore_errors=True)
        if rank == 0:
            note({"event": "step", "step": done, "time": time.time(), "loss": float(lv) / world,
                  "restart": restart, "compute_s": compute_s, "ckpt_blocked_s": ckpt_s})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
