"""Token data: Parquet shards on any fsspec URI, read by row group, with prefetch.

The sample order is ``rayflex.data.sampler`` (world-size independent, one integer of
state, O(1) memory): :meth:`TokenDataset.sampler` builds it with blocks the size of the
dataset's row groups, so a step touches a bounded set of row groups. The dataset reads
only those row groups' ``tokens`` column (byte ranges of the shard, through fsspec), keeps
a bounded LRU of them, and a :class:`Prefetcher` thread loads the next steps' row groups
while the current step trains.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from rayflex.constants import knob
from rayflex.data.sampler import GlobalSampler
from rayflex.storage.fs import check_bucket, ensure_dir, redact_uri, resolve, with_retries

if TYPE_CHECKING:
    from rayflex.config import DataConfig

log = logging.getLogger(__name__)

TOKENS_COLUMN = "tokens"

__all__ = ["GlobalSampler", "Prefetcher", "ReadStats", "TokenDataset", "check_dataset", "data_label", "open_dataset",
           "write_synthetic_dataset"]


@dataclass
class ReadStats:
    """What a dataset read: row groups and their rows and (compressed) bytes, and the rows
    it handed out. ``rows_loaded / rows_served`` is the read amplification."""

    groups_loaded: int = 0
    rows_loaded: int = 0
    bytes_loaded: int = 0
    rows_served: int = 0

    @property
    def amplification(self) -> float:
        return self.rows_loaded / self.rows_served if self.rows_served else 0.0


@dataclass(frozen=True)
class _Group:
    shard: int  # index into the shard list
    index: int  # row group within the shard
    rows: int
    bytes: int  # the tokens column chunk, compressed (what a read fetches)


class TokenDataset:
    """Random access to rows of ``seq_len + 1`` token ids stored in Parquet shards.

    Only footers are read at open time; a row group's ``tokens`` column is read on first
    use (its byte range only) and kept in an LRU of ``cache_groups`` row groups. Safe to
    call from the training thread and a :class:`Prefetcher` at once: a row group being
    read by one is waited for, never read twice.
    """

    def __init__(self, uri: str, *, cache_groups: int = 8):
        from rayflex.errors import ConfigError

        self.uri = uri
        self._fs, root = resolve(uri)
        try:
            listed = with_retries(lambda: self._fs.ls(root, detail=False), what=f"list {redact_uri(uri)}")
            names = sorted(p for p in listed if p.endswith(".parquet"))
        except FileNotFoundError:
            names = []
        if not names:
            check_bucket(uri, field="DataConfig.uri")  # "no shards" would hide a missing bucket
            raise ConfigError("DataConfig.uri", f"no Parquet shards (*.parquet) under {uri!r}",
                              "write a dataset first, e.g. rayflex.data.dataset.write_synthetic_dataset(uri)")
        self._shards = names
        self._footers = [with_retries(lambda: self._footer(name), what=f"read the footer of {name}") for name in names]
        self._groups = [g for s, md in enumerate(self._footers) for g in self._groups_of(s, md)]
        if not self._groups:
            raise ConfigError("DataConfig.uri", f"the Parquet shards under {redact_uri(uri)} hold no rows",
                              "write or prepare a dataset with at least one row")
        self._starts = np.concatenate([[0], np.cumsum([g.rows for g in self._groups])]).astype(np.int64)
        self.cache_groups = max(1, cache_groups)
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self._loading: dict[int, threading.Event] = {}
        self.stats = ReadStats()
        self.row_len = int(self._load(0).shape[1])

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def num_row_groups(self) -> int:
        return len(self._groups)

    @property
    def block_rows(self) -> int:
        """The dataset's row-group size (the most common one): the sampler's block."""
        return Counter(g.rows for g in self._groups).most_common(1)[0][0]

    @property
    def blocks_aligned(self) -> bool:
        """Every block of the sampler is one row group (all groups but the dataset's last
        hold ``block_rows`` rows). Not so for shards whose last row group is partial (Ray
        Data writes them): from there on a block straddles two groups."""
        k = self.block_rows
        return all(g.rows == k for g in self._groups[:-1])

    def cache_for_window(self, window_blocks: int) -> int:
        """Row groups a reader must cache so that no group is read twice: a rank's share of
        two windows (the one it trains in and the next, which prefetch reaches into), one
        group per block, two where blocks straddle groups, and a little slack."""
        return 2 * window_blocks * (1 if self.blocks_aligned else 2) + 4

    def sampler(self, data: "DataConfig") -> GlobalSampler:
        """This dataset's sample order for ``data`` (its batch, seed and shuffle window)."""
        return GlobalSampler(len(self), data.global_batch, data.seed, block_rows=self.block_rows,
                             window_blocks=data.shuffle_window)

    def _footer(self, path: str):
        import pyarrow.parquet as pq

        with self._fs.open(path, "rb") as f:
            return pq.ParquetFile(f).metadata

    @staticmethod
    def _groups_of(shard: int, md) -> list[_Group]:
        # The schema's leaf names are "element"/"item" for a list column: find the tokens
        # column chunk by its path ("tokens.list.element").
        first = md.row_group(0) if md.num_row_groups else None
        col = next((j for j in range(first.num_columns) if first.column(j).path_in_schema.split(".")[0]
                    == TOKENS_COLUMN), 0) if first is not None else 0
        out = []
        for i in range(md.num_row_groups):
            rg = md.row_group(i)
            if rg.num_rows:
                out.append(_Group(shard, i, rg.num_rows, rg.column(col).total_compressed_size))
        return out

    def _read_group(self, g: _Group):
        import pyarrow.parquet as pq

        # ParquetFile with the footer already read: one ranged read of the column chunk
        # (read_table would import pyarrow.dataset and read the footer again). Read and
        # decoded on this thread, no Arrow pool started: pre-buffering starts Arrow's I/O
        # pool and use_threads its CPU pool, and a process exiting while a pool thread is
        # still up aborts ("terminate called without an active exception").
        with self._fs.open(self._shards[g.shard], "rb") as f:
            return pq.ParquetFile(f, metadata=self._footers[g.shard], pre_buffer=False).read_row_group(
                g.index, columns=[TOKENS_COLUMN], use_threads=False)

    def _load(self, gi: int) -> np.ndarray:
        while True:
            with self._lock:
                if gi in self._cache:
                    self._cache.move_to_end(gi)
                    return self._cache[gi]
                pending = self._loading.get(gi)
                if pending is None:
                    mine = self._loading[gi] = threading.Event()
                    break
            # The other thread's read; then take it from the cache. One that does not end
            # (a prefetch stuck on a dead endpoint, perhaps left by an earlier attempt) is
            # not waited for again: this thread reads the group itself.
            if not pending.wait(knob("DATA_PENDING_READ_WAIT_S")):
                log.warning("row group %d of %s: another thread's read is not done after %.0fs; reading it here",
                            self._groups[gi].index, redact_uri(self._shards[self._groups[gi].shard]),
                            knob("DATA_PENDING_READ_WAIT_S"))
                return self._read_into_cache(gi)
        try:
            return self._read_into_cache(gi)
        finally:
            with self._lock:
                if self._loading.get(gi) is mine:
                    del self._loading[gi]
            mine.set()

    def _read_into_cache(self, gi: int) -> np.ndarray:
        g = self._groups[gi]
        table = with_retries(lambda: self._read_group(g), what=f"read row group {g.index} of {self._shards[g.shard]}")
        # Kept as stored (int32 ids: zero-copy from Arrow, half the cache of int64); only
        # the rows a step takes are widened, in :meth:`rows`. A prefetch thread that
        # converted whole row groups would hold the GIL the training thread waits for.
        arr = _rows_as_numpy(table.column(TOKENS_COLUMN))
        with self._lock:
            self._cache[gi] = arr
            while len(self._cache) > self.cache_groups:
                self._cache.popitem(last=False)
            self.stats.groups_loaded += 1
            self.stats.rows_loaded += g.rows
            self.stats.bytes_loaded += g.bytes
        return arr

    def groups_of(self, indices: np.ndarray) -> np.ndarray:
        """The row groups holding the given global row indices (sorted, unique)."""
        return np.unique(np.searchsorted(self._starts, np.asarray(indices), side="right") - 1)

    def warm(self, indices: np.ndarray) -> None:
        """Load the row groups of ``indices`` into the cache (the prefetcher's call)."""
        for gi in self.groups_of(indices):
            self._load(int(gi))

    def rows(self, indices: np.ndarray) -> torch.Tensor:
        """Rows at the given global indices, as a (len(indices), row_len) int64 tensor."""
        indices = np.asarray(indices, dtype=np.int64)
        group_of = np.searchsorted(self._starts, indices, side="right") - 1
        out = np.empty((len(indices), self.row_len), dtype=np.int64)
        for gi in np.unique(group_of):
            mask = group_of == gi
            out[mask] = self._load(int(gi))[indices[mask] - self._starts[gi]]
        with self._lock:
            self.stats.rows_served += len(indices)
        return torch.from_numpy(out)


class Prefetcher:
    """Loads the row groups of the next ``depth`` steps of one dp rank in a background
    thread, so the training thread finds them cached. :meth:`ahead_of` is called once a
    step has its rows; errors are logged, and the training thread reads what is missing
    itself."""

    def __init__(self, dataset: TokenDataset, sampler: GlobalSampler, dp_rank: int, dp: int, depth: int = 2):
        self.dataset, self.sampler = dataset, sampler
        self.dp_rank, self.dp, self.depth = dp_rank, dp, depth
        self._next: "queue.Queue[Optional[int]]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rayflex-prefetch", daemon=True)
        self._thread.start()

    def ahead_of(self, step: int) -> None:
        """Step ``step`` (0-based) has its rows: prefetch the ``depth`` steps after it."""
        self._next.put(step)

    def _run(self) -> None:
        while True:
            step = self._next.get()
            while step is not None and not self._next.empty():  # only the newest request matters
                nxt = self._next.get()
                step = nxt if nxt is None else max(step, nxt)
            if step is None:
                return
            try:
                for ahead in range(step + 1, step + 1 + self.depth):
                    self.dataset.warm(self.sampler.indices(ahead, self.dp_rank, self.dp))
            except Exception as e:  # noqa: BLE001 - a failed prefetch is read again on demand
                log.warning("prefetch of step %d failed (the step reads it itself): %s", step + 1, e)

    def close(self, timeout_s: float = 5.0) -> None:
        self._next.put(None)
        self._thread.join(timeout_s)


def open_dataset(data: "DataConfig", *, cache_groups: Optional[int] = None):
    """``data``'s dataset: a :class:`TokenDataset`, or a mixture of them (``data.sources``).
    ``cache_groups``: each source's row-group cache (None: what its layout needs for
    ``data.shuffle_window``, :meth:`TokenDataset.cache_for_window`)."""
    datasets = [TokenDataset(uri) for uri in ([u for u, _ in data.sources] if data.sources else [data.uri])]
    for ds in datasets:
        ds.cache_groups = cache_groups if cache_groups is not None else ds.cache_for_window(data.shuffle_window)
    if data.sources:
        from rayflex.data.mixture import MixtureDataset

        return MixtureDataset(datasets, [w for _, w in data.sources])
    return datasets[0]


def data_label(data: "DataConfig") -> str:
    """How errors name ``data``'s dataset (credentials redacted)."""
    if data.sources:
        return "the mixture " + " + ".join(redact_uri(u) for u, _ in data.sources)
    return redact_uri(data.uri)


def check_dataset(data: "DataConfig"):
    """Open ``data``'s dataset on the driver and check that it can feed the run.

    Reads the shards' footers (row counts) and the first row group, never the whole dataset.
    A global batch larger than the dataset is refused: the sampler would wrap within one
    step and train on duplicated rows of that very batch, silently.
    """
    from rayflex.errors import ConfigError

    ds = open_dataset(data)
    if ds.row_len < data.seq_len + 1:
        raise ConfigError("DataConfig.seq_len", f"seq_len={data.seq_len} needs rows of {data.seq_len + 1} "
                          f"tokens but {data_label(data)} has {ds.row_len}", f"use seq_len <= {ds.row_len - 1}")
    if data.sources:
        from rayflex.data.mixture import integer_shares

        for (uri, _), share, source in zip(data.sources, integer_shares([w for _, w in data.sources]), ds.datasets):
            per_step = -(-data.global_batch * share // 1000) + 1  # at most, in any one step
            if per_step > len(source):
                raise ConfigError("DataConfig.sources",
                                  f"{redact_uri(uri)} has {len(source)} rows but its weight gives it up to "
                                  f"{per_step} samples of a step (global_batch={data.global_batch}), so a step "
                                  "would repeat its rows", "lower its weight or the global batch, or add rows")
    if data.global_batch > len(ds):
        raise ConfigError("DataConfig.global_batch",
                          f"global_batch={data.global_batch} is larger than the dataset: {data_label(data)} "
                          f"has {len(ds)} rows, so every step would repeat rows of its own batch",
                          f"lower global_batch to at most {len(ds)}, or write at least {data.global_batch} rows")
    return ds


def write_synthetic_dataset(uri: str, *, num_samples: int = 4096, seq_len: int = 64,
                            vocab_size: int = 256, num_shards: int = 4, seed: int = 0,
                            branching: int = 4, row_group_rows: Optional[int] = None) -> str:
    """Write token sequences from a fixed sparse Markov chain as Parquet shards.

    Each token has ``branching`` likely successors, so a model can learn the chain: the
    loss falls from ln(vocab) towards about ln(branching). ``row_group_rows``: rows per
    Parquet row group (None: one per shard). Returns ``uri``.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    fs, root = resolve(uri)
    ensure_dir(fs, root)
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab_size, size=(vocab_size, branching))
    probs = rng.dirichlet(np.ones(branching) * 2.0, size=vocab_size)
    cum = probs.cumsum(axis=1)
    seqs = np.empty((num_samples, seq_len + 1), dtype=np.int32)
    seqs[:, 0] = rng.integers(0, vocab_size, size=num_samples)
    for t in range(1, seq_len + 1):
        u = rng.random(num_samples)[:, None]
        choice = (u > cum[seqs[:, t - 1]]).sum(axis=1)
        seqs[:, t] = successors[seqs[:, t - 1], np.minimum(choice, branching - 1)]
    for shard, part in enumerate(np.array_split(seqs, num_shards)):
        col = pa.array(list(part), type=pa.list_(pa.int32()))
        with fs.open(f"{root}/shard-{shard:05d}.parquet", "wb") as f:
            pq.write_table(pa.table({TOKENS_COLUMN: col}), f, row_group_size=row_group_rows)
    log.info("wrote %d samples in %d shards to %s", num_samples, num_shards, uri)
    return uri


def _rows_as_numpy(column) -> np.ndarray:
    """A list<int> (or fixed_size_list<int>, as numpy-backed writers and HF ``datasets``
    store fixed-length sequences) column of equal-length rows as a (rows, row_len) array,
    read straight from Arrow's buffers (zero-copy for one chunk).

    Arrow's own conversions (``ListArray.flatten``, ``combine_chunks``, ``to_numpy``) import
    pyarrow.compute and pandas: ~1 CPU-s in every worker process that reads data, the most
    expensive import at worker start-up that rayflex controls."""
    import pyarrow as pa

    parts = []
    for chunk in column.chunks:
        if not len(chunk):
            continue
        if chunk.null_count:  # rows are never null in a rayflex dataset; Arrow's path then
            parts.append(np.stack(chunk.to_numpy(zero_copy_only=False)))
            continue
        if pa.types.is_fixed_size_list(chunk.type):
            size = chunk.type.list_size
            start = chunk.offset * size  # .values ignores a slice's offset
            parts.append(_integers_as_numpy(chunk.values)[start:start + len(chunk) * size].reshape(len(chunk), size))
            continue
        if not (pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type)) \
                or not pa.types.is_integer(chunk.type.value_type):
            raise ValueError(f"column {TOKENS_COLUMN!r} is {chunk.type}: a rayflex dataset holds seq_len + 1 "
                             "token ids per row as list<int> or fixed_size_list<int> (write it with "
                             "rayflex.data.prepare or write_synthetic_dataset)")
        offsets = _integers_as_numpy(chunk.offsets)
        values = _integers_as_numpy(chunk.values)[offsets[0]:offsets[-1]]
        lengths = np.diff(offsets)
        if len(lengths) and (lengths != lengths[0]).any():
            raise ValueError(f"rows of unequal length ({lengths.min()}..{lengths.max()} tokens) in column "
                             f"{TOKENS_COLUMN!r}: a rayflex dataset holds fixed-length rows "
                             "(write it with rayflex.data.prepare or write_synthetic_dataset)")
        parts.append(values.reshape(len(chunk), -1))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _integers_as_numpy(values) -> np.ndarray:
    """An Arrow integer array without nulls as a zero-copy NumPy view of its data buffer
    (``Array.to_numpy`` would import pandas, see :func:`_rows_as_numpy`)."""
    import pyarrow as pa

    if not pa.types.is_integer(values.type) or values.null_count:
        return values.to_numpy(zero_copy_only=False)
    kind = "i" if pa.types.is_signed_integer(values.type) else "u"
    width = values.type.bit_width // 8
    return np.frombuffer(values.buffers()[1], dtype=np.dtype(f"<{kind}{width}"), count=len(values),
                         offset=values.offset * width)

