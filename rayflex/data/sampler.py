"""The world-size-independent sample order: O(1) memory, row-group locality.

Step ``s`` consumes positions ``[s*G, (s+1)*G)`` of an endless stream of epochs. The
sampler's whole state is one integer (the next step) and the order depends only on the
seed and the dataset's size and block size, never on dp, pp or tp: a resume at another
world size sees exactly the samples an uninterrupted run would have seen. Which dp rank
trains which of a step's rows does depend on dp (:func:`rank_share`: the step's rows in
dataset order, cut into ``dp`` equal runs); the step's gradient, a mean over its global
batch, does not.

Position -> row, within epoch ``e``, in two levels:

1. The dataset is cut into blocks of ``block_rows`` consecutive rows (the shards' row-group
   size, so a block is one or two row groups). The full blocks are permuted by a seeded
   bijection, and the permuted sequence is cut into *windows* of ``window_blocks`` blocks.
2. Inside a window, positions go round-robin over its blocks: round ``r`` (``W``
   consecutive positions for a window of ``W`` blocks) takes one row from every block,
   the blocks in a seeded order of the round's own, and each block yields its rows in a
   seeded order of its own. The rows that do not fill a block (fewer than ``block_rows``)
   close the epoch, permuted among themselves.

Each bijection is a keyed 4-round Feistel network over the next power of four (tweaked
per round or block where one is needed per round or block), walked in cycles back into
``[0, n)``: no permutation array is ever built, so memory is O(1) per index whatever N is,
and each epoch still visits every row exactly once.

The statistical trade-off: rows are drawn from a window of ``window_blocks`` random
blocks, not from the whole dataset, so one step touches ~``window_blocks`` row groups
(what a reader must cache) instead of up to G of them. Rows packed next to each other at
preparation time (one document's chunks) stay within a window; datasets shuffled at
preparation time lose nothing. Within a window the draw is stratified: every step takes an
equal share (+-1) of every block, each share a uniform random subset of the block's rows
not yet drawn — the variance of a step's mix is no larger than a uniform draw from the
window. With ``window_blocks * block_rows >= N`` the order is a uniform shuffle of the epoch.

Read cost: a rank's run of a step's rows in dataset order covers whole blocks (exactly,
when dp divides the window's blocks and their per-step shares), and the steps of a window
take the same share of each block, so each block is read by one rank: rows read per row
consumed stay ~1 at any dp instead of growing to ~min(dp, window_blocks).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from rayflex.constants import DEFAULT_SHUFFLE_WINDOW

# The version of the order function, recorded in every checkpoint: a resume from a
# checkpoint of another version continues at the right step but not on the rows the
# original run would have seen next, and says so (CheckpointLoaded.data_order). 1: a
# per-epoch permutation array; 2: windowed Feistel blocks (rank slices of the stream);
# 3: round-robin windows, each rank a run of the step's rows in dataset order.
SAMPLE_ORDER = 3


def sample_order_change(saved) -> str:
    """What a resume from a checkpoint saved with order ``saved`` means for the data
    ("" when the order is this rayflex's)."""
    if saved == SAMPLE_ORDER:
        return ""
    was = f"sample order {saved}" if saved is not None else "an older sample order (before versions were recorded)"
    return (f"the checkpoint was trained with {was}; this rayflex uses order {SAMPLE_ORDER}: the run resumes at its "
            "step, but later steps see other rows than the original run would have (each row still once per epoch)")


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _mix_int(x: int) -> int:
    """:func:`_mix` on one Python int (no array overhead: keys are derived per call)."""
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return x ^ (x >> 31)


def derive_key(*parts: int) -> int:
    """A 64-bit key from non-negative integers (seed, epoch, level, window)."""
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = _mix_int(h ^ (int(p) & 0xFFFFFFFFFFFFFFFF))
    return h


@functools.lru_cache(maxsize=64)
def _bijection(n: int, key: int) -> "Bijection":
    return Bijection(n, key)


class Bijection:
    """A keyed pseudo-random permutation of ``[0, n)`` evaluated pointwise."""

    ROUNDS = 4

    def __init__(self, n: int, key: int):
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        self.half_bits = max(1, (int(n - 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half_bits) - 1)
        self.keys = [np.uint64(derive_key(key, r)) for r in range(self.ROUNDS)]

    def _rounds(self, x: np.ndarray, tweak) -> np.ndarray:
        h = np.uint64(self.half_bits)
        left, right = x >> h, x & self.mask
        for k in self.keys:
            left, right = right, left ^ (_mix(right ^ k ^ tweak) & self.mask)
        return (left << h) | right

    def __call__(self, x: np.ndarray, tweak=None) -> np.ndarray:
        """The images of ``x`` (integers in ``[0, n)``), as int64. ``tweak`` (an integer
        array like ``x``) selects, per element, one of many independent permutations."""
        if self.n == 1:
            return np.zeros(np.shape(x), dtype=np.int64)
        x = np.asarray(x, dtype=np.uint64)
        tweak = np.uint64(0) if tweak is None else _mix(np.asarray(tweak, dtype=np.uint64) + np.uint64(1))
        out = self._rounds(x, tweak)
        # Cycle walking: the domain is at most 4n, so a point needs ~2 walks on average.
        todo = np.nonzero(out >= np.uint64(self.n))[0]
        while todo.size:
            t = tweak if np.ndim(tweak) == 0 else tweak[todo]
            out[todo] = self._rounds(out[todo], t)
            todo = todo[out[todo] >= np.uint64(self.n)]
        return out.astype(np.int64)


def rank_share(step_rows: np.ndarray, dp_rank: int, dp: int) -> np.ndarray:
    """Dp rank ``dp_rank``'s rows of a step: the step's rows in dataset order, cut into
    ``dp`` equal runs. The step's set of rows (and so the gradient of its global batch) is
    the same at any dp; each rank's run covers whole blocks, so across the steps of a
    window every block is read by one rank, not by all of them."""
    per_rank = len(step_rows) // dp
    return np.sort(step_rows)[dp_rank * per_rank:(dp_rank + 1) * per_rank]


class StepOrder:
    """(step, dp rank) -> rows, for a sampler with ``global_batch`` and ``rows_at``."""

    def step_rows(self, step: int) -> np.ndarray:
        """Every row of step ``step`` (0-based), in stream order (the same at any dp)."""
        return self.rows_at(np.arange(step * self.global_batch, (step + 1) * self.global_batch, dtype=np.int64))

    def indices(self, step: int, dp_rank: int = 0, dp: int = 1) -> np.ndarray:
        """Dataset row indices for ``dp_rank`` at ``step``; over the ranks in order they are
        the step's rows in dataset order (:func:`rank_share`)."""
        return rank_share(self.step_rows(step), dp_rank, dp)


@dataclass(frozen=True)
class GlobalSampler(StepOrder):
    """Maps (step, dp rank) to dataset row indices; see the module docstring.

    ``block_rows``: rows per block (the dataset's row-group size; 0: the whole dataset is
    one window, a uniform shuffle). ``window_blocks``: blocks shuffled together.
    """

    num_samples: int
    global_batch: int
    seed: int
    block_rows: int = 0
    window_blocks: int = DEFAULT_SHUFFLE_WINDOW

    def __post_init__(self) -> None:
        if self.num_samples < 1:
            raise ValueError(f"a sampler needs at least one sample, got num_samples={self.num_samples}")
        if self.window_blocks < 1:
            raise ValueError(f"window_blocks must be >= 1, got {self.window_blocks}")

    @property
    def _block(self) -> int:
        k = self.block_rows
        return self.num_samples if k <= 0 or k > self.num_samples else k

    def rows_at(self, positions: np.ndarray) -> np.ndarray:
        """Dataset row indices at global stream positions (any epoch)."""
        pos = np.asarray(positions, dtype=np.int64)
        n, k, w = self.num_samples, self._block, self.window_blocks
        full_blocks = n // k
        full_rows = full_blocks * k
        window = w * k
        out = np.empty_like(pos)
        epoch, q = np.divmod(pos, n)
        # Group by (epoch, window): a step's positions fall in one or two of them.
        win = np.where(q < full_rows, q // window, -1)
        for e, wi in sorted(set(zip(epoch.tolist(), win.tolist()))):
            sel = np.nonzero((epoch == e) & (win == wi))[0]
            if wi < 0:  # the rows that do not fill a block end the epoch
                tail = _bijection(n - full_rows, derive_key(self.seed, e, 2))
                out[sel] = full_rows + tail(q[sel] - full_rows)
                continue
            blocks_here = min(w, full_blocks - wi * w)
            # Round-robin over the window's blocks: round ``r`` takes one row of each block,
            # the blocks in an order of its own and each block's rows in an order of its own.
            rnd, j = np.divmod(q[sel] - wi * window, blocks_here)
            slot = _bijection(blocks_here, derive_key(self.seed, e, 1, wi))(j, tweak=rnd)
            block = _bijection(full_blocks, derive_key(self.seed, e, 0))(wi * w + slot)
            row = _bijection(k, derive_key(self.seed, e, 4))(rnd, tweak=block)
            out[sel] = block * k + row
        return out

