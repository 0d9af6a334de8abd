"""The controller's side of an emergency save handed to memory replicas: commit it before
the restart picks the step to resume from, and record what happened
(``checkpoint/handoff.py`` has the mechanism)."""

from __future__ import annotations

import logging
import time

from rayflex.checkpoint.handoff import commit_handed_off as commit
from rayflex.constants import knob
from rayflex.telemetry import events as ev

log = logging.getLogger(__name__)


def commit_handed_off(ctx) -> None:
    """Commit the emergency save rank 0 reported as handed off, if any (then forget it)."""
    ck, ctx.ledger.handed_off = ctx.ledger.handed_off, None
    if ck is None:
        if ctx.keepers:
            # An emergency save whose ranks went before rank 0 reported it: it will not be
            # committed, but its keepers' uploads must end before a new attempt can write
            # the same step's files (a late one would land among them).
            ctx.keepers.wait_uploads(None, knob("HANDOFF_UPLOAD_TIMEOUT_S"))
        return
    step = ck["step"]
    try:
        waited = commit(ctx.keepers, ctx.spec.checkpoint_uri, step, ck["handed_off"], knob("HANDOFF_UPLOAD_TIMEOUT_S"))
    except Exception as e:  # noqa: BLE001 - the restart then resumes from the last committed step
        log.error("emergency checkpoint of step %d not committed: %s", step, e)
        ctx.record(ev.CheckpointFailed(step=step, reason=f"emergency save handed to memory replicas: {e}"))
        return
    if ctx.keepers:
        ctx.keepers.committed(step)
    log.info("emergency checkpoint of step %d committed after its keepers' uploads (%.1fs more)", step, waited)
    # From the save's start to its commit: the keepers' uploads began at the hand-off, and the
    # restart's own seconds before this wait ran beside them (the rank's part + the wait alone
    # would leave those out). Two machines' clocks: never below what both sides measured.
    total = ck.get("total_s", 0.0) + waited
    if ck.get("started_at") is not None:
        total = max(total, time.time() - ck["started_at"])
    ctx.ledger.checkpoint_done({**ck, "committed": True, "total_s": total, "upload": "replica_keepers"})
