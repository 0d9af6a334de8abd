"""Live recovery, the controller's side: whether to ask a failure's survivors for their
state, taking it (rolled forward where the policy says), the policy's choice over what
they handed over (``faults.live_recovery``), its ``recovery_chosen`` event, and what the
next attempt's ranks then read."""

from __future__ import annotations

import logging
from typing import Any, Optional

from rayflex.control.states import Failed
from rayflex.faults import live_recovery
from rayflex.mesh.plan import MeshPlan
from rayflex.telemetry import events as ev

log = logging.getLogger(__name__)


def worth_asking(ctx, plan: MeshPlan, lost: set[int]) -> tuple[bool, Optional[ev.RecoveryChosen]]:
    """Whether the ranks not ``lost`` may still hold every shard (they are then asked for
    snapshots as they leave); if not, the checkpoint path's ``recovery_chosen``, saying why.
    (False, None): live recovery is off."""
    if not ctx.spec.elastic.live_recovery:
        return False, None
    if plan.comm_config(ctx.spec.comm).replicate == "diloco":
        return False, _event(ctx, live_recovery.FromCheckpoint(
            reason="DiLoCo's replicas hold different weights between syncs, and a restart needs each one's own "
                   "model and inner state: the checkpoint holds them, a survivor only its own replica's"))
    missing = live_recovery.lost_shard(plan, set(range(plan.world_size)) - lost)
    if missing is None:
        return True, None
    return False, _event(ctx, live_recovery.FromCheckpoint(reason=missing))


def take(group, plan: MeshPlan, ranks: list[int]) -> dict:
    """The snapshots of the ranks that left keeping their state: rank -> (info, files
    reference). Only one rank per shard takes one (``holders_to_ask``); the others drop
    their state. Ranks left inside a step's closing agreement that a peer finished first
    apply that step (the policy's ``RollForward``), so the holders hold one step. A holder
    whose snapshot failed brings the others in (each may hold its shard)."""
    if not ranks:
        return {}
    held = group.held_steps(ranks)
    forward = live_recovery.roll_forward(held)
    if forward is not None:
        log.info("ranks %s were left inside step %d's closing agreement, which a peer finished: they apply its "
                 "update", ", ".join(map(str, forward.ranks)), forward.step)
    asked = live_recovery.holders_to_ask(plan, held, forward)

    def snapshot(of: list[int]) -> dict:
        return group.take_live(of, {r: dict(forward.agreed) for r in forward.ranks if r in of} if forward else None)

    snapshots = snapshot(sorted(asked) if asked is not None else ranks)
    rest = [r for r in ranks if r not in snapshots]
    if any(info.get("error") for info, _ in snapshots.values()):
        snapshots.update(snapshot(rest))
    else:
        group.drop_live(rest)
    return snapshots


def choose(ctx, plan: MeshPlan, snapshots: dict[int, tuple[dict, Any]]) -> tuple[Optional[dict], ev.RecoveryChosen]:
    """The policy's choice over the survivors' snapshots: for a live recovery, what each
    rank of the next attempt is given to read (``TrainWorker.setup(live=...)``), else None;
    and its ``recovery_chosen`` event, recorded once the restart is decided (a run that
    fails instead recovers from nothing)."""
    choice = live_recovery.decide(plan, {r: info for r, (info, _) in snapshots.items()})
    event = _event(ctx, choice, snapshots)
    if not isinstance(choice, live_recovery.LiveRecovery):
        return None, event
    # Saved again only past the last commit (after an emergency checkpoint it is that step).
    return {"step": choice.step, "world_size": plan.world_size, "mesh": plan.to_dict(),
            "save": choice.step > ctx.ledger.committed_step,
            "infos": {r: snapshots[r][0] for r in choice.holders},
            "files": {r: snapshots[r][1] for r in choice.holders}}, event


def _event(ctx, choice, snapshots: Optional[dict] = None) -> ev.RecoveryChosen:
    infos = [info for info, _ in (snapshots or {}).values() if not info.get("error")]
    holders = list(getattr(choice, "holders", ()))
    step = getattr(choice, "step", ctx.ledger.step)
    return ev.RecoveryChosen(step=step, source=choice.source, reason=choice.reason, holders=holders,
                             snapshot_s=max((i.get("snapshot_s", 0.0) for i in infos), default=0.0),
                             snapshot_bytes=sum(i.get("bytes", 0) for i in infos if i.get("rank") in holders))


def record(ctx, chosen: Optional[ev.RecoveryChosen], next_state) -> None:
    """Record the recovery ``chosen`` for a failure once its restart is decided: not when
    the run fails instead (nothing is recovered)."""
    if chosen is None or isinstance(next_state, Failed):
        return
    log.info("recovery from %s: %s", chosen.source, chosen.reason)
    ctx.record(chosen)
