"""What a pipeline schedule keeps in flight on one rank, in torch's op order: the compute ops
of GPipe, 1F1B and interleaved 1F1B (``schedule_ops``), and the op at which a rank's
activations, gradients and kept buffers peak (``schedule_peak``; ``schedule_peak_linear`` is
the same for one chunk per rank without walking every op). The memory model
(``capacity.memory``) feeds them per-chunk byte counts.
"""

from __future__ import annotations

from functools import lru_cache

from rayflex.errors import ConfigError


def schedule_ops(schedule: str, pp_index: int, pp: int, m: int, v: int = 1):
    """This rank's compute ops in torch's order: ``("F"|"B", local_chunk)`` tuples."""
    return list(_ops(schedule, pp_index, pp, m, v))


@lru_cache(maxsize=4096)  # the capacity search walks the same schedules for many layouts
def _ops(schedule: str, pp_index: int, pp: int, m: int, v: int) -> tuple:
    return tuple(_schedule_ops(schedule, pp_index, pp, m, v))


def _schedule_ops(schedule: str, pp_index: int, pp: int, m: int, v: int):
    if schedule == "gpipe":
        return [("F", 0)] * m + [("B", 0)] * m
    if schedule == "1f1b":
        w = min(m, pp - pp_index)
        return [("F", 0)] * w + [op for _ in range(m - w) for op in (("B", 0), ("F", 0))] + [("B", 0)] * w
    if schedule == "interleaved":
        rounds = max(1, m // pp)
        per_round = m // rounds
        warmup = min((v - 1) * per_round + 2 * (pp - 1 - pp_index), m * v)
        total_fwd = m * v
        ops = []
        for k in range(total_fwd):  # forward op k, and (past the warm-up) backward op k - warmup
            if k < warmup:
                ops.append(("F", (k // per_round) % v))
            else:
                ops.append(("F", (k // per_round) % v))
                ops.append(("B", v - 1 - ((k - warmup) // per_round) % v))
        for k in range(total_fwd, total_fwd + warmup):
            ops.append(("B", v - 1 - ((k - warmup) // per_round) % v))
        return ops
    raise ConfigError("schedule", f"unknown schedule {schedule!r}", "use gpipe, 1f1b or interleaved")


def in_flight_peak(schedule: str, pp_index: int, pp: int, m: int, v: int = 1) -> int:
    """Most chunk-microbatches this rank holds at once (the activation count of the docs)."""
    live = peak = 0
    for kind, _ in schedule_ops(schedule, pp_index, pp, m, v):
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def schedule_peak(schedule: str, pp_index: int, pp: int, m: int, v: int, acts_of, keep_of, in_grad_of,
                  workspace_of, first_grads_of, grads_of) -> tuple:
    """Walk a rank's schedule op by op: activations in flight, unsharded gradients once a
    chunk has run a backward (``grads_of``; ``first_grads_of`` is its first backward's
    growth), input gradients and kept logits accumulating to the end of the step. Returns
    ``(total, acts, grads, kept, workspace, live)`` at the first op where the total peaks;
    every ``*_of`` is per local chunk."""
    acts = grads = step_kept = 0.0
    has_grads = [False] * v
    best_total, best = -1.0, (-1.0, 0.0, 0.0, 0.0, 0.0, 0)
    live = 0
    for kind, c in _ops(schedule, pp_index, pp, m, v):
        if kind == "F":
            acts += acts_of[c]
            step_kept += keep_of[c]
            live += 1
            total = acts + grads + step_kept
            if total > best_total:
                best_total, best = total, (total, acts, grads, step_kept, 0.0, live)
            continue
        ws = workspace_of[c]
        if not has_grads[c]:
            # the chunk's gradients appear block by block while its activations go
            has_grads[c] = True
            grads += grads_of[c]
            ws += first_grads_of[c] - grads_of[c]
        total = acts + grads + step_kept + ws
        if total > best_total:
            best_total, best = total, (total, acts, grads, step_kept, ws, live)
        acts -= acts_of[c]
        step_kept += in_grad_of[c]
        live -= 1
    return best


def schedule_peak_linear(schedule: str, pp_index: int, pp: int, m: int, acts: float, keep: float, in_grad: float,
                         workspace: float, first_grads: float, grads: float) -> tuple:
    """:func:`schedule_peak` for one chunk per rank (GPipe, 1F1B) without walking every op.

    Such a schedule is w forwards, m - w (backward, forward) pairs and w backwards; within
    each of those runs an op's total is linear in its position, so the first peak is at an
    end of a run (or the run's second op, past the first backward's extra growth).
    Evaluating those ops in order finds what the walk finds, in O(1) instead of O(m)."""
    w = m if schedule == "gpipe" else min(m, pp - pp_index)
    pairs = m - w
    points = []
    for k in sorted({1, w}):  # warm-up forwards
        points.append((k * acts + k * keep, k * acts, 0.0, k * keep, 0.0, k))
    for j in sorted({1, 2, pairs} & set(range(1, pairs + 1))):  # steady state: B then F
        kept = (w + j - 1) * keep + (j - 1) * in_grad
        ws = workspace + (first_grads - grads if j == 1 else 0.0)
        points.append((w * acts + grads + kept + ws, w * acts, grads, kept, ws, w))
        kept += in_grad + keep
        points.append((w * acts + grads + kept, w * acts, grads, kept, 0.0, w))
    for k in sorted({1, 2, w} & set(range(1, w + 1))):  # cool-down backwards
        kept = m * keep + (pairs + k - 1) * in_grad
        ws = workspace + (first_grads - grads if pairs == 0 and k == 1 else 0.0)
        live = w - k + 1
        points.append((live * acts + grads + kept + ws, live * acts, grads, kept, ws, live))
    best = (-1.0, 0.0, 0.0, 0.0, 0.0, 0)
    for point in points:  # the walk's running sums round differently: an equal total is a tie
        if point[0] > best[0] * (1 + 1e-12):
            best = point
    return best
