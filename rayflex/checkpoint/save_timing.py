"""When a due checkpoint is taken while the previous one is still being written.

``CheckpointConfig(when_busy=...)``: ``"defer"`` (the default) never lets training wait for
an upload — a save that falls due while the previous one is still writing waits, without
blocking a step, and is taken at the first step boundary after that upload ended (several
that fell due meanwhile become that one save); ``"wait"`` takes it on time, and training
waits for the previous upload first. A save someone asked for (``on_demand``), a stop's, an
emergency save on a spot notice and the run's last save are never deferred.

Every rank decides from the same inputs — the flags of the step's control all-reduce — so
all ranks save at the same step boundary or none does (a save is collective).
"""

from __future__ import annotations

from dataclasses import dataclass

# Requests that may wait like a periodic save: the controller's own schedule
# (CheckpointConfig(every_steps="auto")). Any other reason a save was asked for is taken now.
DEFERRABLE_REQUESTS = frozenset({"auto"})


@dataclass(frozen=True)
class SaveTiming:
    save: bool  # take a checkpoint at this step boundary
    pending: bool  # a due save is waiting for the previous one to be written
    deferred_now: bool  # it started waiting at this boundary (the event is recorded once)


def save_timing(*, due: bool, required: bool, busy: bool, pending: bool, when_busy: str) -> SaveTiming:
    """``due``: a periodic or controller-scheduled save falls due at this boundary;
    ``required``: a save was asked for and must not be deferred; ``busy``: some rank's
    previous save is still being written (agreed over every rank); ``pending``: a save
    deferred at an earlier boundary is still waiting."""
    if required:
        return SaveTiming(save=True, pending=False, deferred_now=False)
    if not (due or pending):
        return SaveTiming(save=False, pending=False, deferred_now=False)
    if busy and when_busy == "defer":
        return SaveTiming(save=False, pending=True, deferred_now=not pending)
    return SaveTiming(save=True, pending=False, deferred_now=False)
