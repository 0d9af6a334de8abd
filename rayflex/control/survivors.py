"""Ending an attempt: kill its dead or frozen ranks, ask the others to leave, and keep the
processes that could (for the next attempt, on their bundles). Used when a fault ends an
attempt and when the run stops at a step boundary to grow."""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

from rayflex.constants import knob
from rayflex.control import live_state
from rayflex.control.states import Attempt
from rayflex.group.worker_group import Release
from rayflex.telemetry import events as ev

log = logging.getLogger(__name__)


def collect_survivors(ctx, attempt: Attempt, bad_ranks: set[int], raised: frozenset = frozenset(),
                      warm: Optional[Callable[[], None]] = None,
                      snapshots: Optional[dict] = None) -> dict[str, Any]:
    """Kill the dead or frozen ranks; ask the others to leave the attempt and keep the ones
    that could (actor id -> handle). Ranks whose loop *raised* are alive: they leave like
    the others (so a checkpoint they are still uploading can commit), then are replaced.
    ``snapshots`` (filled in when given): every rank that left hands over the state of its
    last finished step, rank -> (info, files reference), for a live recovery."""
    group, reservation, cluster = attempt.group, ctx.reservation, ctx.cluster
    kill_now = set(bad_ranks) - set(raised)
    group.kill(sorted(kill_now))
    for r in kill_now:
        reservation.vacate(cluster.actor_id(group.actors[r]))
    if warm is not None:
        warm()  # the dead ranks' bundles are free now; the survivors may take seconds to leave
    others = [r for r in range(attempt.plan.world_size) if r not in kill_now]
    # With a peer dead an in-flight save cannot commit: leave at once, so the sockets the
    # other survivors are blocked on close now. A dead or raising peer leaves the others in
    # collectives that cannot complete: abort them (after the checkpoint grace, so a save
    # in flight can still commit). A growth stop is at a step boundary and leaves gracefully.
    grace = 0.0 if kill_now else knob("RELEASE_CHECKPOINT_GRACE_S")
    released = (group.release(others, timeout_s=knob("RELEASE_TIMEOUT_S"), checkpoint_grace_s=grace,
                              abort=bool(kill_now or raised), snapshot=snapshots is not None)
                if others else Release())
    if snapshots is not None:
        # A rank still uploading is not reused, but its state is a finished step's all the same.
        snapshots.update(live_state.take(group, attempt.plan, sorted(released.left | released.uploading)))
    survivors = {}
    for r in others:
        actor = group.actors[r]
        if r in released.left and r not in raised:
            survivors[cluster.actor_id(actor)] = actor
            continue
        if r in released.died:  # a second fault while the first is handled: named like the first
            ctx.record(ev.WorkerDied(step=ctx.ledger.step, rank=r, node_id=group.node_of.get(r, ""),
                                     error=f"while leaving the failed attempt: {released.died[r]}"))
        elif r in released.uploading:  # it left; its process goes with the upload it still ran
            log.info("rank %d left the failed attempt with a checkpoint upload still running; its process is "
                     "replaced", r)
        elif r not in released.left:  # frozen (or stuck) while leaving: named as a hang, then replaced
            timeout_s = knob("RELEASE_TIMEOUT_S")
            log.warning("rank %d did not leave the failed attempt within %.0fs; killing it", r, timeout_s)
            ctx.record(ev.HangDetected(step=ctx.ledger.step, ranks=[r], phases={str(r): "leaving"},
                                       stalled_s=timeout_s, timeout_s=timeout_s))
        group.kill([r])
        reservation.vacate(cluster.actor_id(actor))
    ctx.note_attempt(None, None)
    return survivors


def kill_all(ctx, survivors: dict) -> None:
    for actor in survivors.values():
        ctx.cluster.kill(actor)
