"""CPU cost of starting one training worker, with the cyclic GC paused during the start (as
rayflex does) vs left on (the peer: what every start cost before), alternating in rounds.

    python benchmarks/worker_start.py [--rounds 7] [--out benchmarks/results/worker_start.json]

Each sample is a fresh interpreter doing what a Ray worker process does for rayflex: import
ray, construct ``TrainWorkerActor`` from a pickled (summarized) spec and plan, then
``setup`` at world size 1 (process group, FSDP2 build, the first DTensor). CPU seconds
(user + system of that process) per phase. On a 2-core machine the suite starts ~180 of
these, so every 0.1 CPU-s here is ~18 CPU-s of ``make test``.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine, setup_logging  # noqa: E402

# One sample, in its own interpreter: argv = [mode, spec.pkl].
_SAMPLE = r"""
import contextlib, json, os, pickle, sys, time
mode, spec_path = sys.argv[1], sys.argv[2]
t0 = time.process_time()
import ray  # noqa: F401 - a Ray worker process has it before any rayflex code runs
t_ray = time.process_time()
import rayflex.worker.actor as actor
if mode == "gc_on":
    actor.cyclic_gc_paused = contextlib.nullcontext
with open(spec_path, "rb") as f:
    spec, plan = pickle.load(f)
a = actor.TrainWorkerActor(0, spec, plan)
t_ctor = time.process_time()
a.setup("127.0.0.1", a.node_info()["port"], False)
t_setup = time.process_time()
print(json.dumps({"import_ray": t_ray - t0, "construct": t_ctor - t_ray, "setup": t_setup - t_ctor,
                  "total": t_setup - t0}), flush=True)
os._exit(0)
"""

MODES = ("gc_paused", "gc_on")


def _spec_file(root: str) -> str:
    import rayflex as rf
    from rayflex.data.dataset import write_synthetic_dataset
    from rayflex.mesh.plan import plan_mesh
    from rayflex.models import GPTConfig, gpt
    from rayflex.models.summary import summarized

    uri = write_synthetic_dataset(f"file://{root}/data", num_samples=256, seq_len=32, vocab_size=128,
                                  num_shards=1, seed=7)
    spec = rf.Trainer(model=gpt(GPTConfig(vocab_size=128, seq_len=32, d_model=32, n_layers=2, n_heads=2)),
                      data=rf.DataConfig(uri=uri, seq_len=32, global_batch=8),
                      run=rf.RunConfig(name="worker-start", storage=f"file://{root}/runs", steps=4),
                      scaling=rf.ScalingConfig(num_workers=1)).spec
    path = os.path.join(root, "spec.pkl")
    with open(path, "wb") as f:
        pickle.dump((summarized(spec), plan_mesh(spec.model, spec.parallel, spec.data, 1)), f)
    return path


def _sample(mode: str, spec_path: str) -> dict:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": ""}  # cached bytecode, as `make` runs it
    r = subprocess.run([sys.executable, "-c", _SAMPLE, mode, spec_path], capture_output=True, text=True,
                       timeout=300, env=env)
    if r.returncode != 0:
        raise RuntimeError(f"sample ({mode}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    setup_logging()
    with tempfile.TemporaryDirectory(prefix="rayflex-worker-start-") as root:
        spec_path = _spec_file(root)
        _sample("gc_paused", spec_path)  # warm the page cache and bytecode: not counted
        samples: dict[str, list[dict]] = {m: [] for m in MODES}
        for r in range(args.rounds):  # alternating, the order flipped every round
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                samples[mode].append(_sample(mode, spec_path))
    out: dict = {"benchmark": "worker_start", "rounds": args.rounds, "machine": machine(),
                 "load_avg_1m": os.getloadavg()[0]}
    for mode, rows in samples.items():
        out[mode] = {phase: {"median_cpu_s": round(statistics.median(r[phase] for r in rows), 3),
                             "min": round(min(r[phase] for r in rows), 3), "max": round(max(r[phase] for r in rows), 3)}
                     for phase in rows[0]}
    saved = [b["total"] - a["total"] for a, b in zip(samples["gc_paused"], samples["gc_on"])]
    out["saved_cpu_s_per_start"] = {"median": round(statistics.median(saved), 3), "min": round(min(saved), 3),
                                    "max": round(max(saved), 3)}
    emit(out, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
