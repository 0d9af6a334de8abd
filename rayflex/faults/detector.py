"""FaultDetector: names the dead, hung, failed or slow rank (and node) from poll results.

A plain class fed by the controller once per poll cycle; it never touches actors. Four
signals, each turned into a typed event:

* **failed** — the rank's training loop raised (the worker reports its traceback);
* **dead** — Ray says the actor is gone, or its node is no longer alive;
* **hung** — the rank stopped answering polls for ``HEARTBEAT_TIMEOUT_S`` (a frozen
  process), or no rank finished a step for max(``HANG_TIMEOUT_FLOOR_S``,
  ``HANG_TIMEOUT_STEP_MULTIPLE`` x median step time; ``HANG_TIMEOUT_WARMUP_FLOORS`` floors
  before the attempt's first step is measured) while the actors still answer (a
  collective that never completes) — the event names the ranks whose phase is not
  ``collective`` (the ones the others wait for) and every rank's phase;
* **straggler** — a rank the others keep waiting for: its wait for its peers in the step
  (inside its collectives and at the end-of-step all-reduce, ``sync_wait_s``) is below the
  ranks' median by ``STRAGGLER_MIN_COST`` of the step or more (the last to arrive waits
  least; a rank that costs the others less is not worth naming) in at least
  ``straggler_share`` of the steps of the last ``straggler_window_s`` seconds
  (``STRAGGLER_WINDOW_S``; and of at least ``STRAGGLER_MIN_STEPS`` steps). It needs 3
  ranks, and compares each rank with the other ranks of the same steps over a window of
  time: a rank descheduled for a few steps in a row on a shared CPU — the demo's 4 ranks
  on 2 cores named rank 0 after 5 such steps (ratio 5.7) when one streak was enough — is
  noise, not a slow rank.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from rayflex.constants import knob
from rayflex.telemetry import events as ev
from rayflex.worker.status import WorkerState

# How much less than the ranks' median a rank must wait in a step, as a share of the step,
# for the step to count against it: a rank that costs the others less is not named.
STRAGGLER_MIN_COST = 0.05
# The fewest steps a straggler window must hold (slow steps: the window grows to hold them).
STRAGGLER_MIN_STEPS = 10


@dataclass
class Fault:
    """What the detector concluded this cycle: the events and the ranks to replace."""

    events: list = field(default_factory=list)
    bad_ranks: set = field(default_factory=set)
    # failures count against the failure budget; preemptions against their own
    kind: str = "failure"
    error: str = ""
    # A hang's flavour ("frozen": ranks stopped answering; "collective": everyone answers,
    # nobody progresses), and what the flight records said about it (faults/diagnosis).
    hang: str = ""
    diagnosis: Optional[Any] = None

    def __bool__(self) -> bool:
        return bool(self.bad_ranks)


# A node is named a straggler when its ranks arrived last in this share of the recent steps
# (and the straggler policy keeps one that no longer does).
STRAGGLER_SHARE = 0.8


class FaultDetector:
    def __init__(self, world_size: int, node_of: dict[int, str], *,
                 straggler_window_s: Optional[float] = None, straggler_share: float = STRAGGLER_SHARE,
                 clock: Callable[[], float] = time.time):
        self.world_size = world_size
        self.node_of = dict(node_of)
        self._clock = clock
        self.last_answer = {r: clock() for r in range(world_size)}
        self.last_progress = clock()
        self.last_step = -1
        self._last_check: Optional[float] = None  # when check() last ran: the cycle is measured
        self.step_times: deque = deque(maxlen=50)
        self._slow_steps: dict[int, deque] = {}  # rank -> (when, slow) per step, oldest first
        self._window_s = knob("STRAGGLER_WINDOW_S") if straggler_window_s is None else straggler_window_s
        self._share = straggler_share
        self._first_step_at: Optional[float] = None
        self._named_at: dict[int, float] = {}
        self._recent: deque = deque(maxlen=10)  # (step time, rank -> sync wait) of the last steps

    # ----------------------------------------------------------------- inputs
    def note_step(self, step: int, step_time_s: float, sync_waits: dict[int, float]) -> list[ev.Event]:
        """A step every rank finished; returns straggler events (reported once per rank)."""
        self.last_progress = self._clock()
        self.last_step = step
        self.step_times.append(step_time_s)
        self._recent.append((step_time_s, dict(sync_waits)))
        return self._stragglers(step, step_time_s, sync_waits)

    def slowdown(self, ranks) -> tuple[float, float]:
        """(step time, how long the other ranks waited at the step's sync for ``ranks``):
        medians over the attempt's last steps; (0, 0) before any."""
        if not self._recent:
            return 0.0, 0.0
        waits = [statistics.median(w for r, w in waits.items() if r not in ranks) if set(waits) - set(ranks)
                 else 0.0 for _, waits in self._recent]
        return statistics.median(t for t, _ in self._recent), statistics.median(waits)

    def last_share(self, ranks) -> float:
        """Of the attempt's last steps, the share in which one of ``ranks`` arrived last by a
        margin worth naming (the straggler signal's own test): whether it is slow *now*.
        Where the ranks share too few cores, somebody waits every step (the others' wait is
        not all for these ranks); a healed node is last only in its share of the steps."""
        counted = [(t, w) for t, w in self._recent if len(w) >= 3]
        if not counted:
            return 0.0
        hits = 0
        for step_time_s, waits in counted:
            median = statistics.median(waits.values())
            worth = max(0.005, STRAGGLER_MIN_COST * step_time_s)
            hits += any(r in waits and median - waits[r] >= worth for r in ranks)
        return hits / len(counted)

    @property
    def share(self) -> float:
        """The share of steps a rank must arrive last in to be named."""
        return self._share

    def hang_timeout_s(self) -> float:
        floor = knob("HANG_TIMEOUT_FLOOR_S")
        if not self.step_times:  # the attempt's first step: its warm-up is not measured yet
            return floor * knob("HANG_TIMEOUT_WARMUP_FLOORS")
        return max(floor, knob("HANG_TIMEOUT_STEP_MULTIPLE") * statistics.median(self.step_times))

    def check(self, poll, alive_nodes: Optional[set[str]] = None, now: Optional[float] = None) -> Fault:
        """One poll cycle's verdict."""
        now = now or self._clock()
        # The controller's cycle as this host runs it now. A hang is named at the first check
        # after its silence passed the timeout, so its event's stalled_s - poll_gap_s <= timeout_s.
        gap = 0.0 if self._last_check is None else now - self._last_check
        self._last_check = now
        fault = Fault()
        for rank in poll.statuses:
            self.last_answer[rank] = now
        step = max((st.step for st in poll.statuses.values()), default=None)
        if step is not None and step > self.last_step and all(
                st.step >= step for st in poll.statuses.values()):
            # Also the step an attempt restored: without it, every poll of an attempt that
            # hangs before finishing its first step looked like progress.
            self.last_progress = now
            self.last_step = step
        # Dead actors and dead nodes.
        lost_nodes = set()
        if alive_nodes is not None:
            lost_nodes = {n for n in self.node_of.values() if n not in alive_nodes}
        for node in sorted(lost_nodes):
            ranks = sorted(r for r, n in self.node_of.items() if n == node)
            fault.events.append(ev.NodeLost(step=self.last_step + 1, node_id=node, ranks=ranks))
            fault.bad_ranks.update(ranks)
        for rank, err in sorted(poll.dead.items()):
            fault.events.append(ev.WorkerDied(step=self.last_step + 1, rank=rank, node_id=self.node_of.get(rank, ""),
                                              error=err, detected_after_s=now - self.last_answer.get(rank, now)))
            fault.bad_ranks.add(rank)
            fault.error = fault.error or f"worker rank {rank} died: {err}"
        # Loops that raised: the first failure is the cause; peers failing in a collective
        # right after are consequences, reported in the event but replaced all the same.
        failed = sorted((st for st in poll.statuses.values() if st.state == WorkerState.FAILED),
                        key=lambda s: (s.error_step or 0, _is_consequence(s.error)))
        if failed and not fault.bad_ranks:
            first = failed[0]
            fault.events.append(ev.WorkerFailed(step=first.error_step, rank=first.rank, node_id=first.node_id,
                                                error=first.error or ""))
            fault.bad_ranks.add(first.rank)
            fault.error = first.error or ""
        # Frozen processes: no poll answer for the heartbeat timeout.
        silent = {r: now - self.last_answer[r] for r in poll.unresponsive}
        frozen = sorted(r for r, s in silent.items() if s > knob("HEARTBEAT_TIMEOUT_S"))
        if frozen and not fault.bad_ranks:
            phases = {r: st.phase for r, st in poll.statuses.items()}
            phases.update({r: "unresponsive" for r in frozen})
            fault.events.append(ev.HangDetected(step=self.last_step + 1, ranks=frozen, phases=_keys(phases),
                                                stalled_s=max(silent[r] for r in frozen),
                                                timeout_s=knob("HEARTBEAT_TIMEOUT_S"), poll_gap_s=gap))
            fault.bad_ranks.update(frozen)
            fault.hang = "frozen"
            fault.error = f"ranks {frozen} stopped answering (frozen process)"
        # Collective hangs: everyone answers, nobody progresses.
        stalled = now - self.last_progress
        running = [st for st in poll.statuses.values() if st.state == WorkerState.RUNNING]
        if not fault.bad_ranks and running and stalled > self.hang_timeout_s():
            phases = {r: st.phase for r, st in poll.statuses.items()}
            culprits = sorted(r for r, p in phases.items() if p not in ("collective",)) or sorted(phases)
            fault.events.append(ev.HangDetected(step=self.last_step + 1, ranks=culprits, phases=_keys(phases),
                                                stalled_s=stalled, timeout_s=self.hang_timeout_s(), poll_gap_s=gap))
            fault.bad_ranks.update(culprits)
            fault.hang = "collective"
            fault.error = f"no step finished for {stalled:.1f}s; ranks {culprits} not in a collective"
        return fault

    # ----------------------------------------------------------------- stragglers
    @property
    def stragglers(self) -> dict[int, float]:
        """Ranks named stragglers in this attempt -> when (the detector's clock)."""
        return dict(self._named_at)

    def _stragglers(self, step: int, step_time_s: float, sync_waits: dict[int, float]) -> list[ev.Event]:
        if len(sync_waits) < 3:
            return []
        now = self._clock()
        if self._first_step_at is None:
            self._first_step_at = now
        watched_long_enough = now - self._first_step_at >= self._window_s
        median = statistics.median(sync_waits.values())
        worth = max(0.005, STRAGGLER_MIN_COST * step_time_s)
        out = []
        for rank, w in sync_waits.items():
            # The last rank to arrive waits least while the others wait for it: by how much
            # less (what it cost the others this step) decides.
            seen = self._slow_steps.setdefault(rank, deque())
            seen.append((now, median - w >= worth))
            while len(seen) > STRAGGLER_MIN_STEPS and now - seen[0][0] > self._window_s:
                seen.popleft()
            slow = sum(1 for _, s in seen if s)
            if (watched_long_enough and len(seen) >= STRAGGLER_MIN_STEPS and slow >= self._share * len(seen)
                    and rank not in self._named_at):
                self._named_at[rank] = now
                out.append(ev.StragglerDetected(step=step, rank=rank, node_id=self.node_of.get(rank, ""),
                                                ratio=median / max(w, 1e-6)))
        return out


def _is_consequence(error: Optional[str]) -> bool:
    """Errors a rank gets because a *peer* failed (closed connection, timeout)."""
    text = (error or "").lower()
    return any(s in text for s in ("connection closed", "connection reset", "timed out", "timeout",
                                   "broken pipe", "peer", "gloo"))


def _keys(d: dict) -> dict:
    return {str(k): v for k, v in sorted(d.items())}
