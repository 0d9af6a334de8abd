"""Token data: Parquet shards on any fsspec URI and a world-size-independent sampler.

The sampler addresses *global sample positions*: step ``s`` consumes positions
``[s*G, (s+1)*G)`` of an endless stream made of seeded per-epoch permutations; dp rank
``r`` of ``dp`` takes the contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of that window. Its
whole state is one integer (the next step), so a resume at another world size sees the
very samples an uninterrupted run would have seen.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from rayflex.storage.fs import check_bucket, ensure_dir, redact_uri, resolve, with_retries

if TYPE_CHECKING:
    from rayflex.config import DataConfig

log = logging.getLogger(__name__)

TOKENS_COLUMN = "tokens"


class TokenDataset:
    """Random access to rows of ``seq_len + 1`` token ids stored in Parquet shards.

    Only shard footers are read at open time; a shard's column is loaded on first use and
    kept in a small LRU, so a worker touching a few shards never holds the whole dataset.
    """

    def __init__(self, uri: str, *, cache_shards: int = 4):
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
        counts = [with_retries(lambda: self._num_rows(name), what=f"read the footer of {name}") for name in names]
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self._cache: OrderedDict[int, np.ndarray] = OrderedDict()
        self._cache_shards = cache_shards
        first = self._load(0)
        self.row_len = int(first.shape[1])

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _num_rows(self, path: str) -> int:
        import pyarrow.parquet as pq

        with self._fs.open(path, "rb") as f:
            return pq.ParquetFile(f).metadata.num_rows

    def _read_column(self, path: str):
        import pyarrow.parquet as pq

        with self._fs.open(path, "rb") as f:
            return pq.read_table(f, columns=[TOKENS_COLUMN])

    def _load(self, shard: int) -> np.ndarray:
        if shard in self._cache:
            self._cache.move_to_end(shard)
            return self._cache[shard]
        path = self._shards[shard]
        table = with_retries(lambda: self._read_column(path), what=f"read {path}")
        col = table.column(TOKENS_COLUMN).combine_chunks()
        rows = np.asarray(col.flatten().to_numpy(zero_copy_only=False), dtype=np.int64)
        arr = rows.reshape(len(col), -1)
        self._cache[shard] = arr
        if len(self._cache) > self._cache_shards:
            self._cache.popitem(last=False)
        return arr

    def rows(self, indices: np.ndarray) -> torch.Tensor:
        """Rows at the given global indices, as a (len(indices), row_len) int64 tensor."""
        shard_of = np.searchsorted(self._starts, indices, side="right") - 1
        out = np.empty((len(indices), self.row_len), dtype=np.int64)
        for shard in np.unique(shard_of):
            mask = shard_of == shard
            out[mask] = self._load(int(shard))[indices[mask] - self._starts[shard]]
        return torch.from_numpy(out)


def check_dataset(data: "DataConfig") -> TokenDataset:
    """Open ``data``'s dataset on the driver and check that it can feed the run.

    Reads the shards' footers (row counts) and the first shard, never the whole dataset.
    A global batch larger than the dataset is refused: the sampler would wrap within one
    step and train on duplicated rows of that very batch, silently.
    """
    from rayflex.errors import ConfigError

    ds = TokenDataset(data.uri)
    if ds.row_len < data.seq_len + 1:
        raise ConfigError("DataConfig.seq_len", f"seq_len={data.seq_len} needs rows of {data.seq_len + 1} "
                          f"tokens but {redact_uri(data.uri)} has {ds.row_len}", f"use seq_len <= {ds.row_len - 1}")
    if data.global_batch > len(ds):
        raise ConfigError("DataConfig.global_batch",
                          f"global_batch={data.global_batch} is larger than the dataset: {redact_uri(data.uri)} "
                          f"has {len(ds)} rows, so every step would repeat rows of its own batch",
                          f"lower global_batch to at most {len(ds)}, or write at least {data.global_batch} rows")
    return ds


@dataclass(frozen=True)
class GlobalSampler:
    """Maps (step, dp rank) to dataset indices; see the module docstring."""

    num_samples: int
    global_batch: int
    seed: int

    def _perm(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)

    def positions(self, step: int, dp_rank: int, dp: int) -> range:
        """Global stream positions consumed by ``dp_rank`` at ``step`` (0-based step)."""
        per_rank = self.global_batch // dp
        start = step * self.global_batch + dp_rank * per_rank
        return range(start, start + per_rank)

    def indices(self, step: int, dp_rank: int = 0, dp: int = 1) -> np.ndarray:
        """Dataset row indices for ``dp_rank`` at ``step``; epochs wrap with a new permutation."""
        pos = np.asarray(self.positions(step, dp_rank, dp), dtype=np.int64)
        epochs = pos // self.num_samples
        out = np.empty_like(pos)
        for e in np.unique(epochs):
            mask = epochs == e
            out[mask] = self._perm(int(e))[pos[mask] % self.num_samples]
        return out


def write_synthetic_dataset(uri: str, *, num_samples: int = 4096, seq_len: int = 64,
                            vocab_size: int = 256, num_shards: int = 4, seed: int = 0,
                            branching: int = 4) -> str:
    """Write token sequences from a fixed sparse Markov chain as Parquet shards.

    Each token has ``branching`` likely successors, so a model can learn the chain: the
    loss falls from ln(vocab) towards about ln(branching). Returns ``uri``.
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
            pq.write_table(pa.table({TOKENS_COLUMN: col}), f)
    log.info("wrote %d samples in %d shards to %s", num_samples, num_shards, uri)
    return uri
