"""The data path at scale, before and after, in one run on one generated corpus:

* the sampler: time and peak memory per step, the per-epoch permutation it replaced
  (``np.random.default_rng([seed, epoch]).permutation(N)`` on every call) vs the O(1)
  Feistel order, at N up to 10^9 virtual samples (the old one only where it fits);
* read amplification (rows loaded / rows consumed): the old reader (uniform order, whole
  shards, an LRU of 4 shards, dp rank 0; simulated exactly from the shard each row lives
  in, since reading a 5 GB corpus that way takes hours) vs the row-group reader with the
  windowed order at several shuffle windows, every dp rank with its own reader (measured:
  every byte really read);
* data wait per step with and without the prefetcher, against a step of ``--step-s``.

    python benchmarks/data.py [--shards 2000 --rows-per-shard 320 --seq-len 2048] [--storage file|s3]

The corpus is random token ids (incompressible: bytes on disk = bytes read).
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time
import tracemalloc

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine, setup_logging  # noqa: E402

from rayflex.data.dataset import TOKENS_COLUMN, Prefetcher, TokenDataset  # noqa: E402
from rayflex.data.sampler import GlobalSampler  # noqa: E402


def write_corpus(uri: str, shards: int, rows: int, seq_len: int, group_rows: int, vocab: int = 50_000) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rayflex.storage.fs import ensure_dir, resolve

    fs, root = resolve(uri)
    ensure_dir(fs, root)
    rng = np.random.default_rng(0)
    total = 0
    for s in range(shards):
        tokens = rng.integers(0, vocab, size=(rows, seq_len + 1), dtype=np.int32)
        col = pa.FixedSizeListArray.from_arrays(pa.array(tokens.ravel()), seq_len + 1)
        with fs.open(f"{root}/shard-{s:05d}.parquet", "wb") as f:
            pq.write_table(pa.table({TOKENS_COLUMN: col}), f, row_group_size=group_rows, compression="none")
        total += tokens.nbytes
    return total


def bench_sampler(n: int, batch: int, block: int, steps: int, old: bool) -> dict:
    if old:
        def indices(step):  # the replaced sampler's per-call permutation
            pos = np.arange(step * batch, (step + 1) * batch)
            return np.random.default_rng([0, 0]).permutation(n)[pos % n]
    else:
        s = GlobalSampler(n, batch, 0, block_rows=block, window_blocks=16)
        indices = s.indices
    indices(0)
    times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        indices(step)
        times.append(time.perf_counter() - t0)
    tracemalloc.start()  # memory apart: tracing slows every allocation
    indices(steps + 1)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"n": n, "ms_per_step_median": statistics.median(times) * 1e3,
            "ms_per_step_max": max(times) * 1e3, "peak_bytes": peak}


def old_reader_amplification(ds: TokenDataset, batch: int, dp: int, steps: int) -> float:
    """The replaced reader, exactly: uniform order, each miss reads the whole shard into
    an LRU of 4 shards; rows loaded / rows consumed for dp rank 0."""
    starts = np.concatenate([[0], np.cumsum([rows for rows in _shard_rows(ds)])])
    order = GlobalSampler(len(ds), batch, 0)  # uniform (block_rows=0)
    lru: collections.OrderedDict = collections.OrderedDict()
    loaded = served = 0
    for step in range(steps):
        idx = order.indices(step, 0, dp)
        for shard in np.unique(np.searchsorted(starts, idx, side="right") - 1):
            if shard in lru:
                lru.move_to_end(shard)
                continue
            loaded += int(starts[shard + 1] - starts[shard])
            lru[shard] = True
            if len(lru) > 4:
                lru.popitem(last=False)
        served += len(idx)
    return loaded / served


def _shard_rows(ds: TokenDataset) -> list[int]:
    per = collections.Counter()
    for g in ds._groups:
        per[g.shard] += g.rows
    return [per[s] for s in range(len(ds._shards))]


def new_reader(uri: str, batch: int, dp: int, steps: int, window: int, *, step_s: float = 0.0,
               prefetch: int = 0, rank: int = 0) -> dict:
    ds = TokenDataset(uri, cache_groups=2 * window + 4)
    base_rows = ds.stats.rows_loaded  # the group read at open
    base_bytes = ds.stats.bytes_loaded
    s = GlobalSampler(len(ds), batch, 0, block_rows=ds.block_rows, window_blocks=window)
    pf = Prefetcher(ds, s, rank, dp, prefetch) if prefetch else None
    waits = []
    t_start = time.perf_counter()
    for step in range(steps):
        idx = s.indices(step, rank, dp)
        t0 = time.perf_counter()
        ds.rows(idx)
        waits.append(time.perf_counter() - t0)
        if pf is not None:
            pf.ahead_of(step)  # as the worker does: after the step's own read
        if step_s:
            time.sleep(step_s)
    if pf is not None:
        pf.close()
    row_bytes = (ds.stats.bytes_loaded - base_bytes) / max(1, ds.stats.rows_loaded - base_rows)
    return {"window_blocks": window, "dp": dp, "amplification": (ds.stats.rows_loaded - base_rows) / ds.stats.rows_served,
            "bytes_read": ds.stats.bytes_loaded - base_bytes, "bytes_consumed": ds.stats.rows_served * row_bytes,
            "data_wait_ms_median": statistics.median(waits) * 1e3, "data_wait_ms_p90": float(np.percentile(waits, 90)) * 1e3,
            "data_wait_fraction": sum(waits) / max(1e-9, time.perf_counter() - t_start), "row_groups": ds.num_row_groups,
            "block_rows": ds.block_rows}


def every_rank(uri: str, batch: int, dp: int, steps: int, window: int) -> dict:
    """Read amplification of each dp rank (its own reader, as in a run): rows loaded per
    row consumed, mean and max over the ranks, and bytes read / consumed over all of them."""
    runs = [new_reader(uri, batch, dp, steps, window, rank=r) for r in range(dp)]
    amps = [r["amplification"] for r in runs]
    return {"window_blocks": window, "dp": dp, "amplification": statistics.mean(amps),
            "amplification_max_rank": max(amps),
            "bytes_read": sum(r["bytes_read"] for r in runs), "bytes_consumed": sum(r["bytes_consumed"] for r in runs),
            "bytes_read_per_byte_consumed": sum(r["bytes_read"] for r in runs) / sum(r["bytes_consumed"] for r in runs),
            "row_groups": runs[0]["row_groups"], "block_rows": runs[0]["block_rows"]}


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=2000)
    ap.add_argument("--rows-per-shard", type=int, default=320)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--group-rows", type=int, default=32, help="rows per Parquet row group")
    ap.add_argument("--batch", type=int, default=256, help="global batch (samples)")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--step-s", type=float, default=0.1, help="simulated compute per step (prefetch runs)")
    ap.add_argument("--storage", choices=["file", "s3"], default="file")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="rayflex-data-bench-")
    server = None
    if args.storage == "s3":
        from checkpoint import start_s3

        root, server = start_s3()
        uri = root.replace("/runs", "/corpus")
    else:
        uri = f"file://{work}/corpus"
    t0 = time.time()
    nbytes = write_corpus(uri, args.shards, args.rows_per_shard, args.seq_len, args.group_rows)
    out: dict = {"machine": machine(), "storage": args.storage, "corpus": {
        "shards": args.shards, "rows": args.shards * args.rows_per_shard, "seq_len": args.seq_len,
        "row_group_rows": args.group_rows, "bytes": nbytes, "write_s": round(time.time() - t0, 1)},
        "global_batch": args.batch, "steps": args.steps}
    try:
        load = os.getloadavg()
        out["load_avg_at_start"] = load
        out["sampler"] = {
            "before": [bench_sampler(n, args.batch, 4096, 20, old=True) for n in (10**6, 10**7)],
            "after": [bench_sampler(n, args.batch, 4096, 200, old=False) for n in (10**6, 10**7, 10**9)]}
        ds = TokenDataset(uri)
        amp = {"before_uniform_whole_shards_lru4": {
            f"dp{dp}": old_reader_amplification(ds, args.batch, dp, args.steps) for dp in (1, 8)}}
        for window in (1, 4, 16):
            for dp in (1, 8):
                amp[f"after_window{window}_dp{dp}"] = every_rank(uri, args.batch, dp, args.steps, window)
        out["read_amplification"] = amp
        out["data_wait"] = {f"prefetch{p}": new_reader(uri, args.batch, 8, min(args.steps, 100), 4,
                                                         step_s=args.step_s, prefetch=p) for p in (0, 2)}
        out["step_s"] = args.step_s
    finally:
        if server is not None:
            server.stop()
        if args.storage == "file":
            import shutil

            shutil.rmtree(work, ignore_errors=True)
    emit(out, args.out)


if __name__ == "__main__":
    main()
