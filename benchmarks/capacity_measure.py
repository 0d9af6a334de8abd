"""Measure the real peak memory of rayflex TrainWorkers on CPU, per rank.

Each rank of a configuration runs a real :class:`rayflex.worker.train_worker.TrainWorker` in its
own process (``torch.multiprocessing`` fork server, gloo on 127.0.0.1, one torch thread, no Ray).
The processes form a pool reused across configurations, so torch is imported once.

What is measured, per rank:

* ``peak_bytes``: the peak of the process's anonymous resident memory (``RssAnon``: heap
  and mmapped tensors; not the shared libraries' code pages, which the first use of a
  kernel faults in) during ``setup()`` plus the training steps, minus ``RssAnon`` just
  before ``setup()``. The kernel keeps the exact high-water mark of the whole resident set
  (``VmHWM``); it is reset (``/proc/self/clear_refs`` = 5) right after the baseline is read,
  and the peak of anonymous memory is ``VmHWM - RssFile - RssShmem`` read at the end.
  That is exact when file-backed pages do not grow during the run; a warm-up job (a tiny
  pipelined run, once per process) faults most of them in first, and the growth that is
  left is reported (``file_growth_bytes``) and bounds the error. Allocator caching would
  make RSS lag behind freed tensors, so the pool starts its processes with
  ``MALLOC_MMAP_THRESHOLD_=65536``: every tensor of 64 KiB or more is its own ``mmap``
  and goes back to the kernel the moment torch frees it, so RSS follows live tensor bytes.
  What remains besides tensors (gloo buffers, Python objects, the data shard, kernel
  workspaces) is the runtime's overhead, which the memory model carries as a constant.
  The first ``setup()`` of a process allocates about 35 MB of one-time state (process
  group, device mesh, FSDP2/DTensor caches); the warm-up job pays it before any baseline.
* ``state_bytes``: the exact bytes of this rank's local parameter, gradient and
  optimizer-state shards after the last step (sum of local tensor sizes).
* ``activation_peak_bytes``: the worker's own probe (bytes autograd saved for backward).

This module is imported by ``benchmarks/capacity.py`` and by ``tests/test_capacity.py``.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Optional

log = logging.getLogger("rayflex.capacity_measure")

MMAP_THRESHOLD = 65536
# What setup() would import lazily: imported before the baseline (and by the fork server).
PRELOAD = ("torch", "torch.distributed.fsdp", "torch.distributed.pipelining", "torch.distributed.tensor",
           "pyarrow.parquet", "rayflex.data.dataset", "rayflex.worker.train_worker")


@dataclass(frozen=True)
class MeasureConfig:
    """One CPU-measurable configuration (a small GPT on ``pp * dp`` ranks)."""

    name: str
    pp: int
    dp: int
    schedule: str = "1f1b"
    microbatches: Optional[int] = None
    stages_per_rank: int = 1
    micro_batch: Optional[int] = None  # pp == 1: samples per accumulation pass
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    vocab_size: int = 256
    seq_len: int = 128
    global_batch: int = 16
    steps: int = 2

    @property
    def world_size(self) -> int:
        return self.pp * self.dp


@dataclass
class RankMeasurement:
    rank: int
    pp_index: int
    dp_index: int
    peak_bytes: int
    setup_peak_bytes: int
    state_bytes: int
    activation_peak_bytes: int
    baseline_anon_bytes: int
    file_growth_bytes: int
    step_time_s: float
    # Anonymous RSS (minus the baseline) after setup() and after the last step.
    after_setup_bytes: int = 0
    end_bytes: int = 0


def gpt_config(cfg: MeasureConfig):
    from rayflex.models import GPTConfig

    return GPTConfig(vocab_size=cfg.vocab_size, seq_len=cfg.seq_len, d_model=cfg.d_model,
                     n_layers=cfg.n_layers, n_heads=cfg.n_heads)


def train_spec(cfg: MeasureConfig, data_uri: str, name: str = "capacity"):
    from rayflex.config import (CheckpointConfig, DataConfig, ParallelConfig, RunConfig, ScalingConfig,
                                TrainSpec)
    from rayflex.models import gpt

    return TrainSpec(model=gpt(gpt_config(cfg)),
                     data=DataConfig(uri=data_uri, seq_len=cfg.seq_len, global_batch=cfg.global_batch,
                                     micro_batch=cfg.micro_batch),
                     run=RunConfig(name=name, storage=f"file://{tempfile.gettempdir()}/rayflex-capacity",
                                   steps=cfg.steps),
                     scaling=ScalingConfig(num_workers=cfg.world_size),
                     parallel=ParallelConfig(pp=cfg.pp, schedule=cfg.schedule, microbatches=cfg.microbatches,
                                             stages_per_rank=cfg.stages_per_rank),
                     checkpoint=CheckpointConfig(resume=False))


# ------------------------------------------------------------------------------ child side
def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _anon_peak(st: dict[str, int]) -> int:
    """Peak anonymous RSS since the last HWM reset, assuming file pages did not grow."""
    return st["VmHWM"] - st["RssFile"] - st["RssShmem"]


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _local_bytes(t) -> int:
    from torch.distributed.tensor import DTensor

    if t is None:
        return 0
    if isinstance(t, DTensor):
        t = t._local_tensor
    return t.numel() * t.element_size()


def _state_bytes(worker) -> int:
    import torch

    total = 0
    for p in worker.params:
        total += _local_bytes(p) + _local_bytes(p.grad)
    for opt in worker.optimizers:
        for st in opt.state.values():
            total += sum(_local_bytes(v) for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return total


def _run_rank(rank: int, spec, plan, port: int, steps: int, timeout_s: float) -> RankMeasurement:
    import gc

    import torch.distributed as dist

    from rayflex.worker.train_worker import TrainWorker

    gc.collect()
    worker = TrainWorker(rank, spec, plan)
    base = _status()
    _reset_hwm()
    worker.setup("127.0.0.1", port, restore=False)
    after_setup = _status()
    setup_peak = _anon_peak(after_setup) - base["RssAnon"]
    worker.start(steps)
    if not worker.join(timeout_s):
        raise TimeoutError(f"rank {rank}: {steps} steps did not finish in {timeout_s}s")
    end = _status()
    status = worker.poll()
    if status.state != "done":
        raise RuntimeError(f"rank {rank} ended {status.state}: {status.error}")
    pp_index, dp_index = plan.coords(rank)
    m = RankMeasurement(rank=rank, pp_index=pp_index, dp_index=dp_index,
                        peak_bytes=_anon_peak(end) - base["RssAnon"], setup_peak_bytes=setup_peak,
                        state_bytes=_state_bytes(worker),
                        activation_peak_bytes=max(r.activation_peak_bytes for r in status.records),
                        baseline_anon_bytes=base["RssAnon"],
                        file_growth_bytes=end["RssFile"] + end["RssShmem"] - base["RssFile"] - base["RssShmem"],
                        step_time_s=status.records[-1].step_time_s,
                        after_setup_bytes=after_setup["RssAnon"] - base["RssAnon"],
                        end_bytes=end["RssAnon"] - base["RssAnon"])
    worker.shutdown()
    if dist.is_initialized():
        dist.destroy_process_group()
    del worker
    gc.collect()
    return m


def _pool_main(index: int, jobs, results) -> None:
    import torch

    torch.set_num_threads(1)
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    while True:
        job = jobs.get()
        if job is None:
            return
        try:
            results.put((index, "ok", asdict(_run_rank(*job))))
        except BaseException:  # noqa: BLE001 - the parent reports it with the rank
            results.put((index, "error", traceback.format_exc()))


# ------------------------------------------------------------------------------ parent side
class MeasurePool:
    """``size`` long-lived rank processes; :meth:`measure` runs one configuration on them."""

    def __init__(self, size: int = 4, timeout_s: float = 300.0, warm_up: bool = True,
                 start_method: str = "forkserver"):
        import torch.multiprocessing as mp

        self.size = size
        self.timeout_s = timeout_s
        self._tmp = tempfile.TemporaryDirectory(prefix="rayflex-capacity-")
        # A fork server imports torch once and forks the rank processes from it: on a
        # loaded 2-core machine, four processes each importing torch take minutes.
        ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            ctx.set_forkserver_preload(list(PRELOAD))
        # Children inherit the environment: glibc reads these when the server starts.
        saved = {k: os.environ.get(k) for k in ("MALLOC_MMAP_THRESHOLD_", "OMP_NUM_THREADS")}
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
        os.environ["OMP_NUM_THREADS"] = "1"
        here = os.path.dirname(os.path.abspath(__file__))
        if here not in sys.path:
            sys.path.insert(0, here)
        try:
            self._results = ctx.Queue()
            self._jobs = [ctx.Queue() for _ in range(size)]
            self._procs = [ctx.Process(target=_pool_main, args=(i, self._jobs[i], self._results), daemon=True)
                           for i in range(size)]
            for p in self._procs:
                p.start()
            if warm_up:
                self._warm_up()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    def _warm_up(self) -> None:
        """One tiny interleaved pp=2 x dp job per process (its first process group, device
        mesh, FSDP2, pipeline and AdamW step): the first ``setup()`` of a process allocates
        some 35 MB of one-time state that later baselines then hold."""
        tiny = dict(d_model=32, n_layers=4, n_heads=2, seq_len=32, vocab_size=64, steps=1)
        if self.size % 2:
            jobs = [MeasureConfig(name="warmup-fsdp", pp=1, dp=self.size, global_batch=self.size, **tiny)]
        else:
            jobs = [MeasureConfig(name="warmup-interleaved", pp=2, dp=self.size // 2, schedule="interleaved",
                                  stages_per_rank=2, microbatches=2, global_batch=self.size, **tiny)]
        for cfg in jobs:
            self.measure(cfg)

    def _dataset(self, cfg: MeasureConfig) -> str:
        from rayflex.data.dataset import write_synthetic_dataset

        uri = f"file://{self._tmp.name}/tokens-{cfg.seq_len}-{cfg.vocab_size}-{cfg.global_batch * cfg.steps}"
        if not os.path.exists(uri[len("file://"):]):
            write_synthetic_dataset(uri, num_samples=cfg.global_batch * cfg.steps, seq_len=cfg.seq_len,
                                    vocab_size=cfg.vocab_size, num_shards=1, seed=0)
        return uri

    def measure(self, cfg: MeasureConfig) -> tuple[object, list[RankMeasurement]]:
        """Run ``cfg`` on the first ``world_size`` pool processes; returns (plan, per rank)."""
        from rayflex.mesh.plan import plan_mesh
        from rayflex.local_ray import free_ports

        if cfg.world_size > self.size:
            raise ValueError(f"{cfg.name}: world size {cfg.world_size} > pool size {self.size}")
        spec = train_spec(cfg, self._dataset(cfg), name=cfg.name)
        plan = plan_mesh(spec.model, spec.parallel, spec.data, cfg.world_size)
        port = free_ports(1)[0]
        for r in range(cfg.world_size):
            self._jobs[r].put((r, spec, plan, port, cfg.steps, self.timeout_s))
        out: dict[int, RankMeasurement] = {}
        errors = []
        deadline = time.monotonic() + self.timeout_s + 60
        while len(out) + len(errors) < cfg.world_size:
            try:
                index, kind, payload = self._results.get(timeout=1.0)
            except queue.Empty:
                dead = [i for i, p in enumerate(self._procs[:cfg.world_size]) if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"{cfg.name}: rank process(es) {dead} died (see stderr)") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{cfg.name}: no result from the rank processes in "
                                       f"{self.timeout_s}s") from None
                continue
            if kind == "ok":
                out[index] = RankMeasurement(**payload)
            else:
                errors.append(f"rank {index}:\n{payload}")
        if errors:
            raise RuntimeError(f"{cfg.name} failed:\n" + "\n".join(errors))
        return plan, [out[r] for r in range(cfg.world_size)]

    def close(self) -> None:
        for q in self._jobs:
            q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        self._tmp.cleanup()

    def __enter__(self) -> "MeasurePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------------------ comparison
# Configurations with different pp, dp and schedule. ``CORE`` runs in the test suite;
# ``ALL`` in benchmarks/capacity.py.
CORE = (
    MeasureConfig(name="pp1-dp2-accum4", pp=1, dp=2, micro_batch=2),
    MeasureConfig(name="pp2-dp2-1f1b", pp=2, dp=2, schedule="1f1b", microbatches=4),
    MeasureConfig(name="pp2-dp2-gpipe", pp=2, dp=2, schedule="gpipe", microbatches=4),
    MeasureConfig(name="pp2-dp1-interleaved", pp=2, dp=1, schedule="interleaved", stages_per_rank=2,
                  microbatches=4),
)
ALL = CORE + (
    MeasureConfig(name="pp1-dp2", pp=1, dp=2),
    MeasureConfig(name="pp1-dp4-accum4", pp=1, dp=4, micro_batch=1),
    MeasureConfig(name="pp2-dp1-1f1b", pp=2, dp=1, schedule="1f1b", microbatches=4),
    MeasureConfig(name="pp4-dp1-1f1b-6layers", pp=4, dp=1, schedule="1f1b", microbatches=8, n_layers=6),
    MeasureConfig(name="pp2-dp1-gpipe-m8", pp=2, dp=1, schedule="gpipe", microbatches=8),
    MeasureConfig(name="pp2-dp2-interleaved", pp=2, dp=2, schedule="interleaved", stages_per_rank=2,
                  microbatches=4),
)


def compare(pool: MeasurePool, cfg: MeasureConfig, runtime=None) -> list[dict]:
    """Measure ``cfg`` and put the memory model's prediction next to each rank."""
    from rayflex.planning.capacity.memory import ModelDescription, Runtime, estimate_memory

    plan, measured = pool.measure(cfg)
    layout = plan
    est = estimate_memory(ModelDescription.from_gpt(gpt_config(cfg)), layout, runtime or Runtime.cpu())
    rows = []
    for m in measured:
        rank = est.ranks[m.pp_index]
        rows.append({"config": cfg.name, "pp": cfg.pp, "dp": cfg.dp,
                     "schedule": layout.schedule if cfg.pp > 1 else "fsdp", "microbatches": layout.microbatches,
                     "micro_batch": layout.micro_batch, "accum_steps": layout.accum_steps,
                     "stages_per_rank": layout.stages_per_rank, "rank": m.rank, "pp_index": m.pp_index,
                     "predicted_peak_bytes": rank.peak_bytes, "measured_peak_bytes": m.peak_bytes,
                     "relative_error": (rank.peak_bytes - m.peak_bytes) / m.peak_bytes,
                     "predicted_phase": rank.phase,
                     "predicted_setup_bytes": rank.setup_bytes, "measured_setup_bytes": m.setup_peak_bytes,
                     "measured_state_bytes": m.state_bytes,
                     "measured_activation_peak_bytes": m.activation_peak_bytes,
                     # parameter shard + gradient shard (same size) + optimizer states
                     "predicted_state_bytes": 2 * rank.params_sharded + rank.optimizer_states,
                     "file_growth_bytes": m.file_growth_bytes, "step_time_s": m.step_time_s})
    return rows
