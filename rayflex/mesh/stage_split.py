"""Cutting a model's blocks into pipeline stages. Torch-free, so the capacity planner can
use the very function the workers use without importing torch."""

from __future__ import annotations

import functools
from typing import Sequence

from rayflex.mesh.rules import check_stages


def balanced_split(costs: list[float], num_stages: int) -> list[list[int]]:
    """Contiguous split of blocks into ``num_stages`` non-empty slices minimising the max
    stage cost (classic linear partition, exact by dynamic programming; ties prefer the
    earlier cut so equal costs give equal-count stages)."""
    n = len(costs)
    check_stages(num_stages, n)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[s][i]: minimal max cost of cutting blocks [0, i) into s stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                v = max(best[s - 1][j], prefix[i] - prefix[j])
                if v < best[s][i] - 1e-12:
                    best[s][i], cut[s][i] = v, j
    bounds, i = [], n
    for s in range(num_stages, 0, -1):
        j = cut[s][i]
        bounds.append(list(range(j, i)))
        i = j
    return bounds[::-1]


def stage_split(block_costs: Sequence[float], num_stages: int) -> tuple[tuple[int, ...], ...]:
    """:func:`balanced_split` as tuples, memoised: the capacity search and its memory
    model ask for the same few splits many times."""
    return _cached_split(tuple(float(c) for c in block_costs), num_stages)


@functools.lru_cache(maxsize=512)
def _cached_split(costs: tuple, num_stages: int) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(stage) for stage in balanced_split(list(costs), num_stages))
