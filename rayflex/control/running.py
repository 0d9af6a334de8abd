"""RUNNING: poll the workers, fold in their steps, and decide when the attempt ends.

An attempt ends on a fault (-> RESTARTING), when every rank is done or stopped (-> FINISHED,
STOPPED, or a restart after an emergency checkpoint or for growth), never by itself while
the ranks train.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from rayflex.constants import knob
from rayflex.control.diagnosing import investigate
from rayflex.control.lost_nodes import name_vanished_nodes
from rayflex.control.notices import handle_notices, preemption_fault
from rayflex.control.states import Attempt, Finished, Placing, Restarting, Running, Stopped
from rayflex.control.stragglers import consider_stragglers, eviction_fault
from rayflex.control.survivors import collect_survivors
from rayflex.control.warming import growth_target
from rayflex.group.standby import Readiness
from rayflex.telemetry import events as ev
from rayflex.worker.status import WorkerState


@dataclass
class AttemptLoop:
    """The running attempt's own bookkeeping (it ends with the attempt)."""

    attempt: Attempt
    stop_sent: bool = False
    grow_to: Optional[int] = None
    preempting: Any = None  # the Notice an emergency checkpoint is under way for
    evicting: Any = None  # the StragglerDecision the attempt is stopping for
    straggler_checked: dict = field(default_factory=dict)  # node -> when the policy last weighed it
    alive_nodes: frozenset = frozenset()
    last_nodes: float = 0.0
    last_notice: float = 0.0
    last_capacity: float = 0.0

    def stop(self) -> None:
        if not self.stop_sent:
            self.attempt.group.broadcast("request_stop")
            self.stop_sent = True


def run_attempt(ctx, state: Running):
    now = ctx.clock.time()
    loop = AttemptLoop(state.attempt, alive_nodes=frozenset(ctx.alive_nodes()), last_nodes=now, last_notice=now,
                       last_capacity=now)
    interval = knob("POLL_INTERVAL_S")
    while True:
        cycle_start = ctx.clock.time()
        outcome = _cycle(ctx, loop)
        if outcome is not None:
            return outcome
        ctx.clock.sleep(interval - (ctx.clock.time() - cycle_start))


def _cycle(ctx, loop: AttemptLoop):
    """One poll cycle; the next state when the attempt ends, else None."""
    attempt = loop.attempt
    if ctx.stop_requested.is_set():
        loop.stop()
    result = attempt.group.poll()
    for rank, st in sorted(result.statuses.items()):
        ctx.ledger.absorb(rank, st, attempt.plan, attempt.detector)
    now = ctx.clock.time()
    if now - loop.last_nodes > knob("NODES_REFRESH_S"):
        loop.alive_nodes, loop.last_nodes = frozenset(ctx.alive_nodes()), now
        name_vanished_nodes(ctx, loop.alive_nodes)  # a node of the failed attempt Ray declared dead only now
    fault = attempt.detector.check(result, set(loop.alive_nodes), now=now)
    if not fault and ctx.watcher is not None and now - loop.last_notice > knob("NOTICE_POLL_S"):
        loop.last_notice = now
        fault = handle_notices(ctx, loop)
    if fault:
        if loop.preempting is not None:
            fault.kind = "preemption"  # the node went before the emergency save finished
        for event in fault.events:
            ctx.record(event)
        investigate(ctx, attempt, fault)
        return Restarting(attempt=attempt, fault=fault, fault_time=now)
    states = {st.state for st in result.statuses.values()}
    if len(result.statuses) == attempt.plan.world_size and states <= {WorkerState.DONE, WorkerState.STOPPED}:
        return _attempt_over(ctx, loop, states, now)
    if ctx.cadence is not None and not loop.stop_sent and loop.preempting is None and loop.evicting is None:
        ctx.cadence.tick(ctx, attempt.group)
    consider_stragglers(ctx, loop, now)
    if ctx.health.enabled and (ctx.health.held_out or ctx.health.checking):
        ctx.health.tick(ctx, ctx.cluster.topology)
    _watch_capacity(ctx, loop, now)
    return None


def _attempt_over(ctx, loop: AttemptLoop, states: set, now: float):
    ctx.recorder.flush()
    if states == {WorkerState.DONE} and ctx.ledger.step >= ctx.spec.run.steps:
        return Finished()
    group = loop.attempt.group
    if loop.preempting is not None:
        return Restarting(attempt=loop.attempt, fault=preemption_fault(ctx, group, loop.preempting), fault_time=now)
    if loop.evicting is not None:
        return Restarting(attempt=loop.attempt, fault=eviction_fault(group, loop.evicting), fault_time=now)
    if loop.grow_to is not None and not ctx.stop_requested.is_set():
        reason = f"capacity returned: growing from {loop.attempt.plan.world_size} to {loop.grow_to} workers"
        survivors = collect_survivors(ctx, loop.attempt, set())
        return Placing(world_size=loop.grow_to, restart_reason=reason, fault_time=now, survivors=survivors)
    reason = ctx.stop_reason or "stopped"
    ctx.record(ev.RunStopped(step=ctx.ledger.step, reason=reason))
    return Stopped(reason=reason)


def _watch_capacity(ctx, loop: AttemptLoop, now: float) -> None:
    """Grow when capacity returns: warm the newcomers, then stop at a step boundary once
    they are all up (the stop leaves a checkpoint; the restart reuses every worker)."""
    if loop.stop_sent or loop.preempting is not None or loop.evicting is not None:
        return
    if (loop.grow_to is None and now - loop.last_capacity > knob("CAPACITY_CHECK_S")
            and loop.attempt.plan.world_size < ctx.spec.scaling.max_size):
        loop.last_capacity = now
        if ctx.health.ready_for_growth(ctx.usable_topology()):
            loop.grow_to = growth_target(ctx, loop.attempt.plan.world_size)
    if loop.grow_to is not None:
        ready = ctx.standby.readiness(knob("WORKER_START_TIMEOUT_S")) if ctx.standby else Readiness.READY
        if ready is Readiness.FAILED:
            loop.grow_to = None
        elif ready is Readiness.READY:
            loop.stop()
