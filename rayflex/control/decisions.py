"""Acting on the failure policy's decision: wait for resources (asking the autoscaler), fail
the run, or restart at the size it chose — now, with the workers that are up, when
``restart_while_warming`` allows."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from rayflex.constants import knob
from rayflex.control.states import Failed, Placing
from rayflex.control.survivors import kill_all
from rayflex.control.warming import warm_standbys
from rayflex.faults.policy import Fail, Restart, WaitForResources, best_world_size
from rayflex.telemetry import events as ev

log = logging.getLogger(__name__)


def follow_decision(ctx, decision, survivors: dict, fault_time: float, error: Callable[[], Any],
                    live: Optional[dict] = None):
    """Act on the failure policy's decision: wait for resources (asking the autoscaler),
    fail the run (with ``error()`` as its cause), or restart at the size it chose (from the
    survivors' state, ``live``, when the recovery policy chose it)."""
    deadline = started = None
    while isinstance(decision, WaitForResources):
        if deadline is None:
            started = ctx.clock.time()
            deadline = started + decision.timeout_s
            ctx.request_capacity()
            log.warning("waiting up to %.0fs for resources: %s", decision.timeout_s, decision.reason)
        if ctx.clock.time() > deadline or ctx.stop_requested.is_set():
            ctx.record(ev.CapacityWaited(waited_s=ctx.clock.time() - started, reason=decision.reason,
                                         outcome="gave_up"))
            kill_all(ctx, survivors)
            return Failed(f"gave up waiting for resources after {decision.timeout_s:.0f}s: {decision.reason}")
        ctx.clock.sleep(knob("RESOURCE_POLL_S"))
        reason = decision.reason
        decision = ctx.policies.failure.resize(usable_slots=ctx.usable_slots())
    if started is not None:
        ctx.record(ev.CapacityWaited(waited_s=ctx.clock.time() - started, reason=reason))
    if isinstance(decision, Fail):
        kill_all(ctx, survivors)
        return Failed(decision.reason, error())
    assert isinstance(decision, Restart)
    placing = Placing(world_size=decision.world_size, restart_reason=decision.reason, fault_time=fault_time,
                      survivors=survivors, live=live)
    return with_what_is_up(ctx, placing) or placing


def with_what_is_up(ctx, placing: Placing) -> Optional[Placing]:
    """With ``restart_while_warming``: if the restart needs workers that are not up, start
    them as standbys and restart now at the largest valid size the survivors and warm
    standbys fill; the run grows to the full size once the newcomers are warm."""
    size = placing.world_size
    if not ctx.warm_restarts:
        return None
    standby = ctx.standby
    if standby is not None:
        standby.poll()
    up = len(placing.survivors) + (standby.ready if standby is not None else 0)
    if up >= size:
        return None
    now = best_world_size(ctx.spec, up)
    if now is None or now < ctx.spec.scaling.min_size:
        return None  # too few to train with: wait for the new workers
    current: dict[str, int] = {}
    for aid in placing.survivors:
        node = ctx.reservation.node_of_actor(aid) if ctx.reservation else None
        if node is not None:
            current[node] = current.get(node, 0) + 1
    up_slots = dict(current)
    for node in standby.nodes() if standby is not None else ():
        up_slots[node] = up_slots.get(node, 0) + standby.count_ready(node)
    if not warm_standbys(ctx, size, current):
        return None  # cannot place the newcomers now: restart at ``size`` as usual
    reason = (f"{placing.restart_reason}; restarting at once with the {now} workers that are up, growing to "
              f"{size} when {size - up} more are warm")
    return Placing(world_size=now, restart_reason=reason, fault_time=placing.fault_time,
                   survivors=placing.survivors, workers_up=up_slots, full_size=size, live=placing.live)
