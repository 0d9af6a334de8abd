"""Weighted mixtures of token datasets (``DataConfig(sources=[(uri, weight), ...])``).

The global stream is cut into periods of ``MIXTURE_PERIOD`` positions. Each source owns an
integer share of every period (its weight, normalised; largest remainders), i.e. a range
of slots; a keyed bijection per period orders the slots. Position ``p`` in period ``k``
lands on slot ``sigma_k(p mod P)``: source ``s`` owning that slot, at its own stream
position ``k * share_s + (slot - first slot of s)``, which that source's sampler maps to a
row. So every period takes exactly ``share_s`` samples from source ``s``, each source's own
stream is consumed position by position with nothing skipped or repeated, and the whole
order is a function of the step alone: the same one-integer state and world-size
independence as a single dataset. A source smaller than the others simply wraps into its
next epoch sooner (its own sampler's epochs).

Rows are numbered globally: source ``s``'s row ``r`` is ``offset_s + r``, offsets being
the sources' cumulative sizes in the order given.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from rayflex.data.sampler import Bijection, StepOrder, derive_key

MIXTURE_PERIOD = 1000


def integer_shares(weights: list[float], period: int = MIXTURE_PERIOD) -> list[int]:
    """Weights as integer slots of a period (largest remainders), each source >= 1 slot."""
    total = sum(weights)
    exact = [w / total * period for w in weights]
    shares = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - shares[i], reverse=True)[:period - sum(shares)]:
        shares[i] += 1
    if min(shares) < 1:
        from rayflex.errors import ConfigError

        raise ConfigError("DataConfig.sources", f"a weight below 1/{period} of the total gets no samples "
                          f"(shares {shares})", f"raise the smallest weight to >= 1/{period} of the total")
    return shares


@functools.lru_cache(maxsize=8)
def _period_order(period: int, key: int) -> Bijection:
    return Bijection(period, key)


@dataclass(frozen=True)
class MixtureSampler(StepOrder):
    """Maps (step, dp rank) to global row indices of a mixture; see the module docstring."""

    sources: tuple  # GlobalSampler per source, in order
    offsets: tuple  # first global row of each source
    shares: tuple  # slots of a period per source
    global_batch: int
    seed: int
    period: int = MIXTURE_PERIOD

    @property
    def num_samples(self) -> int:
        return self.offsets[-1] + self.sources[-1].num_samples

    def source_positions(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, that source's stream position) of each global stream position."""
        pos = np.asarray(positions, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(self.shares)]).astype(np.int64)
        period, offset = np.divmod(pos, self.period)
        slot = np.empty_like(pos)
        for k in np.unique(period):
            sel = period == k
            slot[sel] = _period_order(self.period, derive_key(self.seed, int(k), 3))(offset[sel])
        source = np.searchsorted(starts, slot, side="right") - 1
        local = period * np.asarray(self.shares, dtype=np.int64)[source] + slot - starts[source]
        return source, local

    def rows_at(self, positions: np.ndarray) -> np.ndarray:
        source, local = self.source_positions(positions)
        out = np.empty_like(local)
        for s in np.unique(source):
            sel = source == s
            out[sel] = self.offsets[s] + self.sources[s].rows_at(local[sel])
        return out


class MixtureDataset:
    """Several :class:`~rayflex.data.dataset.TokenDataset` under one global row numbering."""

    def __init__(self, datasets: list, weights: list[float]):
        from rayflex.errors import ConfigError

        lens = {d.row_len for d in datasets}
        if len(lens) > 1:
            raise ConfigError("DataConfig.sources", "the sources' rows differ in length: "
                              + ", ".join(f"{d.uri} {d.row_len}" for d in datasets),
                              "prepare every source with the same --seq-len")
        self.datasets, self.weights = list(datasets), list(weights)
        self.row_len = datasets[0].row_len
        self.offsets = tuple(int(x) for x in np.concatenate([[0], np.cumsum([len(d) for d in datasets])[:-1]]))
        self.uri = "mixture:" + ",".join(f"{d.uri}={w:g}" for d, w in zip(datasets, weights))

    def __len__(self) -> int:
        return self.offsets[-1] + len(self.datasets[-1])

    def sampler(self, data) -> MixtureSampler:
        from rayflex.data.sampler import GlobalSampler

        # Each source its own seed: two sources of one size would otherwise share an order.
        own = tuple(GlobalSampler(len(d), data.global_batch, derive_key(data.seed, 4, i), block_rows=d.block_rows,
                                  window_blocks=data.shuffle_window) for i, d in enumerate(self.datasets))
        return MixtureSampler(sources=own, offsets=self.offsets,
                              shares=tuple(integer_shares(self.weights)), global_batch=data.global_batch,
                              seed=data.seed)

    def _split(self, indices: np.ndarray):
        indices = np.asarray(indices, dtype=np.int64)
        source = np.searchsorted(np.asarray(self.offsets), indices, side="right") - 1
        for s in np.unique(source):
            sel = source == s
            yield int(s), sel, indices[sel] - self.offsets[s]

    def rows(self, indices: np.ndarray) -> torch.Tensor:
        out = torch.empty((len(indices), self.row_len), dtype=torch.int64)
        for s, sel, local in self._split(indices):
            out[torch.from_numpy(np.nonzero(sel)[0])] = self.datasets[s].rows(local)
        return out

    def warm(self, indices: np.ndarray) -> None:
        for s, _, local in self._split(indices):
            self.datasets[s].warm(local)


def source_counts(sampler: MixtureSampler, steps: int) -> list[int]:
    """Samples each source gave to the first ``steps`` steps (for tests and reports)."""
    source, _ = sampler.source_positions(np.arange(steps * sampler.global_batch))
    return np.bincount(source, minlength=len(sampler.sources)).tolist()
