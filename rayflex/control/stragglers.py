"""Acting on stragglers: once a node a straggler was named on has stayed slow for
``STRAGGLER_CONFIRM_S``, the straggler policy weighs a restart without it against the
rest of the run at its pace (``faults.policy.StragglerPolicy``); the decision is an event.
To evict, the node is held out of placement until it passes a health check
(``control/node_health.py``; for the rest of the run with checks off) and the attempt stops
at the next step boundary with a checkpoint, as for a spot notice with time to spare; the
restart goes on without its ranks (no failure budget is charged, no step is lost).
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from rayflex.constants import knob
from rayflex.faults.detector import Fault
from rayflex.telemetry import events as ev

log = logging.getLogger(__name__)


def consider_stragglers(ctx, loop, now: float) -> None:
    """Ask the policy about each node with a named straggler, when due; act on an eviction."""
    policy = ctx.policies.straggler
    attempt = loop.attempt
    if policy is None or loop.stop_sent or loop.preempting is not None or loop.evicting is not None:
        return
    named = attempt.detector.stragglers
    if not named:
        return
    group = attempt.group
    for node in sorted({group.node_of[r] for r in named if r in group.node_of}):
        first_named = min(t for r, t in named.items() if group.node_of.get(r) == node)
        last = loop.straggler_checked.get(node)
        due = first_named + knob("STRAGGLER_CONFIRM_S") if last is None else last + knob("STRAGGLER_RECHECK_S")
        if now < due:
            continue
        loop.straggler_checked[node] = now
        ranks = sorted(r for r, n in group.node_of.items() if n == node)
        step_s, wait_s = attempt.detector.slowdown(ranks)
        without = ctx.usable_slots(ctx.usable_topology(avoid={node}))
        decision = policy.decide(node_id=node, ranks=ranks, world=attempt.plan.world_size, usable_slots=without,
                                 remaining_steps=max(0, ctx.spec.run.steps - ctx.ledger.step),
                                 slow_step_s=step_s, wait_s=wait_s, restart_s=restart_estimate_s(ctx),
                                 last_share=attempt.detector.last_share(ranks), named_share=attempt.detector.share)
        fields = asdict(decision)
        fields["ranks"] = list(fields["ranks"])
        ctx.record(ev.StragglerDecided(step=ctx.ledger.step, **fields))
        if decision.evict:
            log.warning("evicting straggler node %s: %s", node[:12], decision.reason)
            ctx.health.hold_out(node, f"evicted as a straggler: {decision.reason}")
            group.broadcast("request_stop", "straggler", sorted(ctx.left_out))
            loop.evicting = decision
            return


def restart_estimate_s(ctx) -> float:
    """What a restart costs the run, from this run: the save that stops the attempt and the
    newest start's setup (a cold start before any restart: an upper bound)."""
    started = ctx.recorder.timeline.of(ev.WorkersStarted)
    setup = started[-1].setup_s if started else knob("WORKER_START_TIMEOUT_S")
    return ctx.ledger.emergency_save_estimate_s() + setup


def eviction_fault(group, decision) -> Fault:
    """The attempt stopped for an eviction: the node's ranks are replaced elsewhere."""
    ranks = {r for r, n in group.node_of.items() if n == decision.node_id}
    return Fault(bad_ranks=ranks, kind="straggler",
                 error=f"straggler node {decision.node_id[:12]} evicted: {decision.reason}")
