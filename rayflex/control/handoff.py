"""An emergency save handed to memory replicas: the controller commits it.

With memory replicas, an emergency save's ranks hand each shard file's upload to a keeper
on a node that stays, and stop (``replicas.dcp_io.ReplicatingWriter``): the leaving node
needs the notice only to replicate. Nobody in the old attempt can commit the step then —
rank 0 may have been on the node that went — so the controller does, before the restart
picks the step to resume from: it waits for the keepers' uploads, checks that every shard
file DCP's ``.metadata`` names is in storage, whole, and commits. An upload that failed, or
a keeper that went with files still pending, leaves the step uncommitted (a
``checkpoint_failed`` event names why) and the restart resumes from the last committed one.
"""

from __future__ import annotations

import logging
import time

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
    from rayflex.replicas.keeper import UPLOADED
    from rayflex.storage.checkpoint import commit_if_whole

    step, info = ck["step"], ck["handed_off"]
    t0 = time.monotonic()
    try:
        states = ctx.keepers.wait_uploads(step, knob("HANDOFF_UPLOAD_TIMEOUT_S")) if ctx.keepers else {}
        failed = {name: state for name, state in sorted(states.items()) if state != UPLOADED}
        if failed:
            raise RuntimeError("uploads by the memory replicas' keepers did not finish: "
                               + "; ".join(f"{name}: {state}" for name, state in failed.items()))
        commit_if_whole(ctx.spec.checkpoint_uri, step, world_size=info["world_size"], mesh=info["mesh"],
                    keep=info["keep"])
    except Exception as e:  # noqa: BLE001 - the restart then resumes from the last committed step
        log.error("emergency checkpoint of step %d not committed: %s", step, e)
        ctx.record(ev.CheckpointFailed(step=step, reason=f"emergency save handed to memory replicas: {e}"))
        return
    if ctx.keepers:
        ctx.keepers.committed(step)
    waited = time.monotonic() - t0
    log.info("emergency checkpoint of step %d committed after its keepers' uploads (%.1fs more)", step, waited)
    ctx.ledger.checkpoint_done({**ck, "committed": True, "total_s": ck.get("total_s", 0.0) + waited,
                                "upload": "replica_keepers"})
