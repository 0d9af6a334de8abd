"""What a run cost, and where the money went: the goodput breakdown in dollars.

Computed from ``metrics.jsonl`` and ``events.jsonl`` alone (as goodput is), so
``result.json``, ``rayflex status`` and ``rayflex report`` agree.

**What is charged.** A run pays for every node its ranks occupy, whole (you rent the
machine, not the share of it a rank uses), at the node's price per hour: its label
``rayflex.io/price-per-hour`` (cluster.yaml), else ``ScalingConfig.price_per_hour`` for its
market (``ray.io/market-type``), else ``"*"`` (:func:`rayflex.config.node_price`). Each ``plan_chosen`` records the prices of
its nodes. A node is charged from the moment the run starts placing ranks on it (for a
session's first attempt: from the session's start) until the run stops using it: the next
attempt's placement leaves it out, it is lost (``node_lost``), or the driver session ends.
Between a failure and the next placement the survivors' nodes are still the run's.

**Where it went.** Every second of a driver session falls in exactly one category, and each
category's dollars are the integral of the held nodes' price over its seconds, so the parts
sum to the total:

- ``training``: steps of the final history that a checkpoint covers (or of a finished run),
  and the training loop's time between them;
- ``stragglers``: the part of those steps the other ranks spent waiting for a rank named
  slow (``straggler_detected``), from that event to the end of its attempt (the step's
  ``sync_wait_s``: the longest wait at its sync);
- ``checkpoint_stalls``: the time saves blocked training (``blocked_s``);
- ``setup``: a session's start to its first step (placing, starting processes, restoring)
  and its last step to its end (the final save, teardown);
- ``recovery``: from the last step before a restart to the first step after it, but for
- ``capacity_wait``: restarts waiting for the cluster to have room (``capacity_waited``);
- ``recomputed``: steps a restart threw away (they were trained again);
- ``uncommitted``: steps after the newest checkpoint of a run that did not finish (a resume
  trains them again).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable, Optional

from rayflex.telemetry import events as ev
from rayflex.telemetry.goodput import TERMINAL_EVENTS, Events, final_history, goodput_breakdown, sessions

CATEGORIES = ("training", "stragglers", "checkpoint_stalls", "setup", "recovery", "capacity_wait",
              "recomputed", "uncommitted")


@dataclass(frozen=True)
class Cost:
    """A run's cost in dollars, by category (``CATEGORIES``), with the seconds behind each."""

    total_usd: float
    parts_usd: dict
    seconds: dict
    node_hours: float
    tokens: int  # tokens of the steps that count as training
    unpriced_nodes: tuple  # nodes the run held without a price (charged nothing)

    @property
    def usd_per_1k_tokens(self) -> Optional[float]:
        return self.total_usd / (self.tokens / 1000) if self.tokens else None

    def to_dict(self) -> dict:
        return {"total_usd": self.total_usd, "usd_per_1k_tokens": self.usd_per_1k_tokens,
                "parts_usd": dict(self.parts_usd), "seconds": dict(self.seconds), "node_hours": self.node_hours,
                "tokens": self.tokens, "unpriced_nodes": list(self.unpriced_nodes)}


class _Rate:
    """Dollars per second of the nodes held: ``changes`` are (time, rate from then on)."""

    def __init__(self, changes: list[tuple[float, float]]):
        changes = sorted(changes, key=lambda c: c[0])
        self.times = [t for t, _ in changes]
        self.rates = [r for _, r in changes]

    def integral(self, a: float, b: float) -> float:
        total = 0.0
        i = max(0, bisect.bisect_right(self.times, a) - 1)
        while i < len(self.times) and self.times[i] < b:
            seg_end = self.times[i + 1] if i + 1 < len(self.times) else b
            lo, hi = max(a, self.times[i]), min(b, seg_end)
            if hi > lo:
                total += self.rates[i] * (hi - lo)
            i += 1
        return total


def _held_rate(evs: list[ev.Event], spans: list[tuple[float, float]]) -> tuple[_Rate, float, set]:
    """(dollars/s over time, node-hours, nodes held without a price)."""
    changes: list[tuple[float, float]] = []
    node_s, unpriced = 0.0, set()
    for start, end in spans:
        # (when, order, what): a placement (its plan) or a node lost, in time order.
        timeline: list[tuple[float, int, object]] = []
        plan = None
        for e in (e for e in evs if start <= e.time <= end):
            if isinstance(e, ev.PlanChosen):
                plan = e
            elif isinstance(e, ev.WorkersStarted) and plan is not None:
                # The session's first placement is charged from the session's start.
                timeline.append((start if not timeline else max(start, e.time - e.setup_s), 0, plan))
                plan = None
            elif isinstance(e, ev.NodeLost):
                timeline.append((e.time, 1, e.node_id))
        if plan is not None:  # placed, but the run ended before its workers reported started
            timeline.append((start if not timeline else plan.time, 0, plan))
        timeline.sort(key=lambda x: (x[0], x[1]))
        held: dict[str, Optional[float]] = {}
        since = start
        for at, _, what in timeline:
            node_s += len(held) * (at - since)
            since = at
            if isinstance(what, ev.PlanChosen):
                held = {n: what.node_prices.get(n) for n in what.rank_to_node if n}
            else:
                held.pop(what, None)
            unpriced.update(n for n, p in held.items() if p is None)
            changes.append((at, sum(p for p in held.values() if p is not None) / 3600.0))
        node_s += len(held) * (end - since)
        changes.append((end, 0.0))
    return _Rate(changes), node_s / 3600.0, unpriced


def cost_breakdown(metrics: Iterable[dict], events: Events, *, now: Optional[float] = None) -> Optional[Cost]:
    """The run's cost by category; None when no node it held has a price."""
    metrics, evs = list(metrics or []), sorted((e for e in ev.as_events(events or []) if e.time is not None),
                                               key=lambda e: e.time)
    if not any(isinstance(e, ev.PlanChosen) and any(p is not None for p in e.node_prices.values()) for e in evs):
        return None
    spans = sessions(metrics, evs, now)
    rate, node_hours, unpriced = _held_rate(evs, spans)
    _, lost = final_history(metrics, evs)
    kinds = _StepKinds(lost, goodput_breakdown(metrics, evs, now=now).committed_step, _straggling(evs))
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    dollars = dict.fromkeys(CATEGORIES, 0.0)
    for start, end in spans:
        lines = sorted((m for m in metrics if m.get("time") is not None and start <= m["time"] <= end),
                       key=lambda m: m["time"])
        inside = [e for e in evs if start <= e.time <= end]
        for a, b, category in _partition(start, end, kinds.intervals(lines, start), _between_steps(inside, lines),
                                         [e.time for e in inside if isinstance(e, (ev.WorkersStarted, ev.Restarted))]):
            seconds[category] += b - a
            dollars[category] += rate.integral(a, b)
    return Cost(total_usd=sum(dollars.values()), parts_usd=dollars, seconds=seconds, node_hours=node_hours,
                tokens=kinds.tokens, unpriced_nodes=tuple(sorted(unpriced)))


def _straggling(evs: list[ev.Event]) -> list[tuple[float, float]]:
    """Spans from a straggler's naming to the end of its attempt: the others' wait counts."""
    spans, named = [], None
    for e in evs:
        if isinstance(e, ev.StragglerDetected) and named is None:
            named = e.time
        elif isinstance(e, (ev.WorkersStarted, *TERMINAL_EVENTS)) and named is not None:
            spans.append((named, e.time))
            named = None
    return spans + ([(named, float("inf"))] if named is not None else [])


class _StepKinds:
    """What each step's seconds were: training (less a named straggler's wait), recomputed
    (rolled back by a restart) or uncommitted; counts the training steps' tokens."""

    def __init__(self, lost: list[dict], committed_step: Optional[int], straggling: list[tuple[float, float]]):
        self.lost = {id(m) for m in lost}
        self.committed_step, self.straggling = committed_step, straggling
        self.tokens = 0

    def intervals(self, lines: list[dict], start: float) -> list[tuple[float, float, str]]:
        out, prev_end = [], start
        for m in lines:
            end = float(m["time"])
            a, b = max(end - float(m.get("step_time_s") or 0.0), prev_end), end  # never overlapping
            prev_end = max(prev_end, end)
            if id(m) in self.lost:
                out.append((a, b, "recomputed"))
            elif self.committed_step is not None and m["step"] > self.committed_step:
                out.append((a, b, "uncommitted"))
            else:
                self.tokens += int(round((m.get("tokens_per_s") or 0.0) * (m.get("step_time_s") or 0.0)))
                wait = 0.0
                if any(s <= end <= e for s, e in self.straggling):
                    wait = min(float(m.get("sync_wait_s") or 0.0), max(0.0, b - a))
                    out.append((b - wait, b, "stragglers"))
                out.append((a, b - wait, "training"))
        return out


def _between_steps(inside: list[ev.Event], lines: list[dict]) -> list[tuple[float, float, str]]:
    """What fills the time between steps when something does: a save blocking training right
    after its step, a restart's wait for capacity."""
    step_end = {m["step"]: m["time"] for m in lines}  # a step trained again: its newest end
    out = [(e.time - e.waited_s, e.time, "capacity_wait") for e in inside if isinstance(e, ev.CapacityWaited)]
    for e in inside:
        if isinstance(e, (ev.CheckpointCommitted, ev.CheckpointFailed)) and e.step in step_end:
            blocked = getattr(e, "blocked_s", 0.0) or 0.0
            if blocked > 0 and step_end[e.step] <= e.time:
                out.append((step_end[e.step], step_end[e.step] + blocked, "checkpoint_stalls"))
    return sorted(out)


def _partition(start: float, end: float, steps: list, between: list, restarts: list[float]):
    """Every second of [start, end] once: the steps' intervals, then the gaps between them,
    filled by ``between`` (sorted) where it says and by position elsewhere: before the
    session's first step or after its last, setup; with a restart in it, recovery; else the
    training loop's own time between steps."""
    steps = sorted((a, b, c) for a, b, c in steps if b > a)
    yield from steps
    if not steps:
        yield from _filled(start, end, "setup", between)
        return
    first, last = steps[0][1], max(b for _, b, _ in steps)
    restarts = sorted(restarts)
    t, gaps = start, []
    for a, b, _ in steps:
        if a > t:
            gaps.append((t, a))
        t = max(t, b)
    if end > t:
        gaps.append((t, end))
    j = 0
    for ga, gb in gaps:
        if ga <= start and gb <= first or ga >= last:
            where = "setup"
        else:
            i = bisect.bisect_left(restarts, ga)
            where = "recovery" if i < len(restarts) and restarts[i] <= gb else "training"
        # Gaps come in time order: a span that ended before this one's start is done with.
        while j < len(between) and between[j][1] <= ga:
            j += 1
        k = j
        while k < len(between) and between[k][0] < gb:
            k += 1
        yield from _filled(ga, gb, where, between[j:k])


def _filled(ga: float, gb: float, where: str, between: list):
    """[ga, gb] as ``between``'s spans where they overlap it, ``where`` elsewhere."""
    t = ga
    for pa, pb, category in between:
        pa, pb = max(pa, t), min(pb, gb)
        if pb > pa:
            if pa > t:
                yield t, pa, where
            yield pa, pb, category
            t = pb
    if gb > t:
        yield t, gb, where
