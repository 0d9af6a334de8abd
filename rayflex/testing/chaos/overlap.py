"""Overlap mode: a fault lands while the run is still handling the previous one.

Faults come in pairs. The first of a pair hits a healthy run (as in sequential mode); the
second is put in at a seeded point of the recovery from the first — during the release of
the failed attempt, during placement, during the restore, during the first step after the
restart, during the placement that grows the run back (runs that restart while the
newcomers warm), or within a second of the first fault (two nodes lost at once) — or,
when the first is an object-store outage (which stops nothing), while the store is still
down (a spot notice then asks for an emergency checkpoint the store refuses). A window a
fault kind cannot hit is never planned: a killed process needs a process (restore, first
step, at once), arming a raise needs a running attempt (first step).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Optional

MODES = ("sequential", "overlap")  # how an injector spaces faults (see injector.py)

# Where in a recovery the second fault of a pair lands.
WINDOWS = ("at_once", "release", "placement", "restore", "first_step", "growth", "outage")
GROWTH_REASON = "capacity returned"  # how the controller names a restart that grows the run

_NEEDS_PROCESS = ("kill_actor", "sigstop", "corrupt_checkpoint")
_NODE = ("remove_node", "preempt_long", "preempt_short")


def windows_for(first: str, second: str, *, growth: bool = False) -> tuple[str, ...]:
    """The windows in which ``second`` can land while the run handles ``first`` (empty: it
    cannot overlap it). ``growth``: the run restarts with the survivors and grows back."""
    if first == "s3_down":
        return () if second == "s3_down" else ("outage",)  # a second outage inside the first is none
    if second == "raise_once":
        return ("first_step",)
    if second in _NEEDS_PROCESS:
        return ("at_once", "restore", "first_step")
    if second == "s3_down" or second in _NODE:
        return ("at_once", "release", "placement", "restore", "first_step") + (("growth",) if growth else ())
    raise ValueError(f"unknown fault kind {second!r}")


@dataclass(frozen=True)
class Overlap:
    """Fault ``index`` lands in ``window`` of the recovery from fault ``index - 1``."""
    index: int
    window: str


def plan_overlaps(seed: int, kinds: list[str], *, growth: bool = False) -> dict[int, Overlap]:
    """Every second fault overlaps the one before it, in a seeded window it can hit. Two
    node losses in a row are always planned at once (the "two nodes within one second" case)."""
    rng = random.Random(seed * 104729 + 3)
    out = {}
    for i in range(1, len(kinds), 2):
        first, second = kinds[i - 1], kinds[i]
        options = windows_for(first, second, growth=growth)
        if options:
            out[i] = Overlap(i, "at_once" if first == second == "remove_node" else rng.choice(options))
    return out


def phase_of(status: dict, *, restart_step: Optional[int], restarted: bool, store_down: bool) -> str:
    """Where the run is now, in the words of ``WINDOWS``: ``restarted`` says whether a restart
    has begun since the first fault of the pair; ``restart_step`` is the step that restart
    resumed from (None until it loaded one)."""
    state = status.get("state")
    if store_down:
        return "outage"
    if state == "RESTARTING":
        return "release"
    if state == "PLACING":
        if str(status.get("reason") or "").startswith(GROWTH_REASON):
            return "growth"
        return "restore" if status.get("workers") else "placement"
    if state == "RUNNING" and restarted and restart_step is not None and status.get("step", 0) <= restart_step + 1:
        return "first_step"
    return "running" if state == "RUNNING" else str(state).lower()


def window_over(window: str, phase: str, *, since_s: float, restart_reasons: list[str]) -> bool:
    """Whether the recovery has passed ``window`` without the injector seeing it: at_once
    after its second; outage once the store is back; growth once a growth restart has been
    and gone; the others once the run trains past the first step after a restart (or
    never restarted within a minute)."""
    if window == "at_once":
        return since_s > 1.0
    if window == "outage":
        return phase != "outage"
    if phase != "running":
        return False
    if window == "growth":
        return any(r.startswith(GROWTH_REASON) for r in restart_reasons) or since_s > 180.0
    return bool(restart_reasons) or since_s > 60.0
