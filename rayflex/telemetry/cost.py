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


def _step_span(line: dict) -> tuple[float, float]:
    end = float(line["time"])
    return end - float(line.get("step_time_s") or 0.0), end


def cost_breakdown(metrics: Iterable[dict], events: Events, *, now: Optional[float] = None) -> Optional[Cost]:
    """The run's cost by category; None when no node it held has a price."""
    metrics, evs = list(metrics or []), sorted((e for e in ev.as_events(events or []) if e.time is not None),
                                               key=lambda e: e.time)
    if not any(isinstance(e, ev.PlanChosen) and any(p is not None for p in e.node_prices.values()) for e in evs):
        return None
    spans = sessions(metrics, evs, now)
    rate, node_hours, unpriced = _held_rate(evs, spans)
    history, lost = final_history(metrics, evs)
    committed_step = goodput_breakdown(metrics, evs, now=now).committed_step
    lost_ids = {id(m) for m in lost}
    # Steps after a straggler was named, until its attempt ended: the others' wait counts.
    straggling: list[tuple[float, float]] = []
    named = None
    for e in evs:
        if isinstance(e, ev.StragglerDetected) and named is None:
            named = e.time
        elif isinstance(e, (ev.WorkersStarted, *TERMINAL_EVENTS)) and named is not None:
            straggling.append((named, e.time))
            named = None
    if named is not None:
        straggling.append((named, float("inf")))

    seconds = dict.fromkeys(CATEGORIES, 0.0)
    dollars = dict.fromkeys(CATEGORIES, 0.0)

    def charge(category: str, a: float, b: float) -> None:
        if b > a:
            seconds[category] += b - a
            dollars[category] += rate.integral(a, b)

    tokens = 0
    for start, end in spans:
        lines = sorted((m for m in metrics if m.get("time") is not None and start <= m["time"] <= end),
                       key=lambda m: m["time"])
        covered: list[tuple[float, float, str]] = []
        prev_end = start
        for m in lines:
            a, b = _step_span(m)
            a = max(a, prev_end)  # steps never overlap; clip a clock's jitter
            if id(m) in lost_ids:
                category = "recomputed"
            elif committed_step is not None and m["step"] > committed_step:
                category = "uncommitted"
            else:
                category = "training"
                tokens += int(round((m.get("tokens_per_s") or 0.0) * (m.get("step_time_s") or 0.0)))
                if any(s <= m["time"] <= e for s, e in straggling):
                    wait = min(float(m.get("sync_wait_s") or 0.0), b - a)
                    covered.append((b - wait, b, "stragglers"))
                    b -= wait
            covered.append((a, b, category))
            prev_end = max(prev_end, _step_span(m)[1])
        # Between steps: a save's blocked time, a wait for capacity, else by position.
        placed = [(e.time - e.waited_s, e.time, "capacity_wait") for e in evs
                  if isinstance(e, ev.CapacityWaited) and start <= e.time <= end]
        for e in evs:
            if isinstance(e, (ev.CheckpointCommitted, ev.CheckpointFailed)) and start <= e.time <= end and e.step:
                step_end = next((m["time"] for m in reversed(lines) if m["step"] == e.step and m["time"] <= e.time),
                                None)
                blocked = getattr(e, "blocked_s", 0.0) or 0.0
                if step_end is not None and blocked > 0:
                    placed.append((step_end, step_end + blocked, "checkpoint_stalls"))
        covered.sort()
        step_ends = [b for _, b, _ in covered]
        gaps, t = [], start
        for a, b, _ in covered:
            if a > t:
                gaps.append((t, a))
            t = max(t, b)
        if end > t:
            gaps.append((t, end))
        restarts = [e.time for e in evs if isinstance(e, (ev.WorkersStarted, ev.Restarted)) and start <= e.time <= end]
        for a, b, category in covered:
            charge(category, a, b)
        for ga, gb in gaps:
            t = ga
            for pa, pb, category in sorted(placed):
                pa, pb = max(pa, t), min(pb, gb)
                if pb > pa:
                    charge(_gap_category(ga, gb, step_ends, restarts, start, end), t, pa)
                    charge(category, pa, pb)
                    t = pb
            charge(_gap_category(ga, gb, step_ends, restarts, start, end), t, gb)
    total = sum(dollars.values())
    return Cost(total_usd=total, parts_usd=dollars, seconds=seconds, node_hours=node_hours, tokens=tokens,
                unpriced_nodes=tuple(sorted(unpriced)))


def _gap_category(a: float, b: float, step_ends: list, restarts: list, start: float, end: float) -> str:
    """A gap between steps: before the session's first step or after its last, setup; with a
    restart in it, recovery; else the training loop's own time between steps."""
    if not step_ends or a <= start and b <= min(step_ends) or a >= max(step_ends):
        return "setup"
    if any(a <= t <= b for t in restarts):
        return "recovery"
    return "training"
