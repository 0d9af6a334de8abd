"""rayflex vs a plain torch.multiprocessing + gloo FSDP2 script: same model, data, batch,
steps and world size, measured in the same run by compare.py's method (``rounds.py``:
the median wall-clock gap between finished steps after warm-up; the systems alternate in
``--rounds`` rounds; medians, spreads and the round-by-round ratio's spread).

    python benchmarks/overhead.py [--steps 40] [--rounds 5] [--out F]
    python benchmarks/overhead.py --recorder [--steps 40] [--rounds 4]

Prints JSON: tokens/s of each, their ratio (goal >= 0.95; compare.py's rayflex-vs-torchrun
ratio should fall inside this one's spread) and rayflex's time from ``fit()`` to the first
finished step. ``--recorder``: rayflex with the collective flight
recorder on (the default, ``ElasticConfig.flight_recorder=2000``) vs off, alternating
in rounds; the ratio's median and spread over the rounds (goal >= 0.98).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine, setup_logging  # noqa: E402
from rounds import SKIP, alternate, median_or_none, over_rounds, paired_ratios, step_figures  # noqa: E402

SEQ, BATCH, WORKERS = 64, 32, 4
TOKENS_PER_STEP = BATCH * SEQ
KEYS = ("tokens_per_s", "median_step_s", "time_to_first_step_s", "final_loss")


def model_spec():
    from rayflex.models import GPTConfig, gpt

    return gpt(GPTConfig(vocab_size=256, seq_len=SEQ, d_model=128, n_layers=4, n_heads=4))


def _plain_rank(rank: int, world: int, port: int, data_uri: str, steps: int, out) -> None:
    """One rank of the peer: init gloo, fully_shard each block, AdamW, same samples."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rayflex.data.dataset import GlobalSampler, TokenDataset
    from rayflex.models.spec import build_stage

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    mesh = init_device_mesh("cpu", (world,))
    spec = model_spec()
    model = build_stage(spec, list(range(spec.num_blocks)))
    for i in model.indices:
        fully_shard(model.blocks[str(i)], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ds = TokenDataset(data_uri)
    sampler = GlobalSampler(len(ds), BATCH, 0, block_rows=ds.block_rows)  # rayflex's order (DataConfig defaults)
    finished = {}
    for step in range(steps):
        rows = ds.rows(sampler.indices(step, rank, world))
        x, y = rows[:, :SEQ], rows[:, 1:SEQ + 1]
        opt.zero_grad(set_to_none=True)
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        lv = loss.detach().clone()
        dist.all_reduce(lv)  # the peer also reports a global loss each step
        finished[step + 1] = time.time()
    out.put((rank, finished))
    dist.destroy_process_group()


def run_plain(data_uri: str, steps: int) -> dict:
    import torch.multiprocessing as mp

    from rayflex.local_ray import free_ports

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_ports(1)[0]
    t0 = time.time()
    procs = [ctx.Process(target=_plain_rank, args=(r, WORKERS, port, data_uri, steps, q)) for r in range(WORKERS)]
    for p in procs:
        p.start()
    per_rank = dict(q.get(timeout=900) for _ in procs)
    for p in procs:
        p.join(60)
    # A step is finished once its last rank finished it (the loss all-reduce makes them close).
    finished = {s: max(per_rank[r][s] for r in per_rank) for s in per_rank[0]}
    return step_figures(finished, set(), t0, TOKENS_PER_STEP)


def run_rayflex(data_uri: str, storage: str, steps: int, name: str, flight_recorder: int = 2000) -> dict:
    import rayflex as rf

    trainer = rf.Trainer(model=model_spec(), data=rf.DataConfig(uri=data_uri, seq_len=SEQ, global_batch=BATCH),
                         run=rf.RunConfig(name=name, storage=storage, steps=steps,
                                          optimizer=rf.OptimizerConfig(lr=3e-3, grad_clip=1.0)),
                         scaling=rf.ScalingConfig(num_workers=WORKERS),
                         checkpoint=rf.CheckpointConfig(resume=False),
                         elastic=rf.ElasticConfig(flight_recorder=flight_recorder))
    t0 = time.time()
    result = trainer.fit(progress=False)
    out = step_figures({m["step"]: m["time"] for m in result.metrics}, set(), t0, TOKENS_PER_STEP)
    out.update(final_loss=result.final_loss,
               median_worker_step_time_s=median_or_none(m["step_time_s"] for m in result.metrics[SKIP:]))
    return out


def recorder_overhead(data: str, storage: str, steps: int, rounds: int) -> None:
    """Flight recorder on vs off, alternating (on, off, on, off, ...)."""
    on_runs, off_runs = [], []
    for i in range(rounds):
        first, second = ((on_runs, 2000), (off_runs, 0)) if i % 2 == 0 else ((off_runs, 0), (on_runs, 2000))
        for runs, entries in (first, second):
            runs.append(run_rayflex(data, storage, steps, f"recorder-{entries}-{i}", flight_recorder=entries))
            print(f"round {i}: flight_recorder={entries} {runs[-1]}", file=sys.stderr)
    ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(on_runs, off_runs)]
    emit({"benchmark": "flight_recorder_overhead", "machine": machine(),
          "workload": {"model": "gpt-4x128", "seq_len": SEQ, "global_batch": BATCH, "workers": WORKERS,
                       "steps": steps, "rounds": rounds, "order": "alternating, the first system swapped each round"},
          "results": {"recorder_on": {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in on_runs),
                                      "rounds": [r["tokens_per_s"] for r in on_runs]},
                      "recorder_off": {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in off_runs),
                                       "rounds": [r["tokens_per_s"] for r in off_runs]}},
          "ratios": {"on_over_off_tokens_per_s": statistics.median(ratios), "per_round": ratios,
                     "spread": [min(ratios), max(ratios)]}})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--recorder", action="store_true", help="flight recorder on vs off instead of vs plain torch")
    args = ap.parse_args()
    setup_logging()
    from rayflex.data.dataset import write_synthetic_dataset
    from rayflex.local_ray import ensure_ray

    tmp = tempfile.mkdtemp(prefix="rayflex-bench-")
    data = write_synthetic_dataset(f"file://{tmp}/data", num_samples=4096, seq_len=SEQ)
    ensure_ray(WORKERS)
    if args.recorder:
        recorder_overhead(data, f"file://{tmp}/runs", args.steps, args.rounds)
        return
    runs = alternate(["rayflex", "plain_torch"], args.rounds, lambda system, r: (
        run_rayflex(data, f"file://{tmp}/runs", args.steps, f"overhead-{r}") if system == "rayflex"
        else run_plain(data, args.steps)))
    for system, rs in runs.items():
        for r, got in enumerate(rs):
            print(f"round {r}: {system} {got}", file=sys.stderr)
    shutil.rmtree(tmp, ignore_errors=True)
    results = {system: over_rounds(rs, KEYS) for system, rs in runs.items()}
    by_round = paired_ratios(runs["rayflex"], runs["plain_torch"], ["tokens_per_s"])["tokens_per_s"]
    emit({"benchmark": "overhead", "machine": machine(),
          "command": shlex.join(["python", "benchmarks/overhead.py", *sys.argv[1:]]),
          "workload": {"model": "gpt-4x128", "seq_len": SEQ, "global_batch": BATCH, "workers": WORKERS,
                       "steps": args.steps, "rounds": args.rounds, "nodes": 1,
                       "order": "alternating: rayflex, plain torch, rayflex, ...",
                       "step_time": f"median wall-clock gap between finished steps after step {SKIP} "
                                    "(benchmarks/rounds.py, the method compare.py uses)"},
          "results": results,
          "ratios": {"rayflex_over_plain_torch_tokens_per_s": results["rayflex"]["tokens_per_s"]
                     / results["plain_torch"]["tokens_per_s"],
                     "by_round": by_round}}, out=args.out)

if __name__ == "__main__":
    main()
