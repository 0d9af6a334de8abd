"""PLACING: plan the mesh and its placement, start (or reuse) the workers, restore.

The plan is made for the size the state names (the first start: the configured size, or
the best that fits when elastic); warm survivors and standbys keep their bundles and take
new ranks; the workers then rendezvous, build their stages and restore the checkpoint.
"""

from __future__ import annotations

import logging

from rayflex.constants import knob
from rayflex.control.notices import exclude_noticed_nodes, keep_notices_for_the_attempt
from rayflex.control.decisions import follow_decision
from rayflex.control.lost_nodes import implicated_nodes, name_vanished_nodes, stop_watching
from rayflex.control.states import Attempt, Finished, Placing, Running
from rayflex.errors import PlacementError, RayflexError, SetupFailed
from rayflex.planning.capacity.memory import CapacityError
from rayflex.faults.detector import FaultDetector
from rayflex.faults.policy import best_world_size
from rayflex.planning.placement.planner import ranks_by_node
from rayflex.telemetry import events as ev

log = logging.getLogger(__name__)


def place(ctx, state: Placing):
    t0 = ctx.clock.time()
    name_vanished_nodes(ctx)  # Ray may have declared a node of the last attempt dead since the restart decided
    exclude_noticed_nodes(ctx)  # a node noticed while restarting gets no ranks (its survivors are let go)
    redecided = _decide_again_if_slots_went(ctx, state)
    if redecided is not None:
        return redecided
    survivors = dict(state.survivors)
    try:
        world, plan, resolved, placement = _plan(ctx, state, survivors)
    except PlacementError:
        # A node of the warm plan (the workers that are up) went since the decision, and the
        # full size no longer fits either: decided again with the slots usable now.
        redecided = _decide_again_if_slots_went(ctx, state, plan_failed=True)
        if redecided is None:
            raise
        return redecided
    stop_watching(ctx, placement.rank_to_node)
    ctx.plan = plan
    group = _start_group(ctx, plan, placement, survivors, world, shrinking=state.workers_up is not None)
    try:
        infos = group.setup(restore=ctx.spec.checkpoint.resume,
                            while_waiting=lambda: _while_starting(ctx, placement.rank_to_node), live=state.live)
    except SetupFailed as failure:
        return _setup_failed(ctx, group, placement, failure)
    ctx.health.attempt_started(group.node_of.values(), [i.get("probe_gflops") for i in infos])
    ctx.record(_plan_event(world, plan, resolved, placement, group,
                           plan.memory_config(ctx.spec.memory).activation_checkpointing, _node_prices(ctx, group)))
    if ctx.spec.checkpoint.memory_replicas:
        _cover_with_keepers(ctx, group)
    steps = {i["step"] for i in infos}
    if len(steps) != 1:
        raise RayflexError(f"ranks restored different steps {sorted(steps)}; checkpoint is inconsistent")
    step = steps.pop()
    restored = infos[0].get("restored")
    if restored:
        from rayflex.data.sampler import sample_order_change  # numpy, not torch: fine beside the driver

        ctx.record(ev.CheckpointLoaded(step=step, uri=restored.get("uri", ""), world_size=world,
                                       saved_world_size=restored.get("world_size", 0),
                                       skipped=restored.get("skipped", []),
                                       data_order=sample_order_change(restored.get("sample_order")),
                                       **_load_sources(infos)))
        saved_total, total = restored.get("total_steps"), ctx.spec.run.steps
        if saved_total is not None and saved_total != total:
            opt = ctx.spec.run.optimizer
            ctx.record(ev.ScheduleChanged(step=step, from_total_steps=saved_total, to_total_steps=total,
                                          lr_before=opt.lr_of_step(step + 1, saved_total),
                                          lr_after=opt.lr_of_step(step + 1, total)))
    # A live recovery the workers could not complete fell back to the checkpoint (its step is committed).
    from_live = state.live is not None and not (restored or {}).get("live_failed")
    lost = ctx.ledger.restored(step, recovered=(restored or {}).get("recent_steps"), committed=not from_live,
                               sample_rows=_live_sample_rows(state.live))
    if state.restart_reason is not None:
        ctx.record(ev.Restarted(step=step, world_size=world, from_step=step, reason=state.restart_reason,
                                lost_steps=lost, reused_workers=len(getattr(group, "reused", [])),
                                fault_time=state.fault_time))
    ctx.record(ev.WorkersStarted(step=step, world_size=world, setup_s=ctx.clock.time() - t0,
                                 spawn_s=getattr(group, "spawn_s", 0.0),
                                 rendezvous_s=max(i.get("rendezvous_s", 0.0) for i in infos),
                                 build_s=max(i.get("build_s", 0.0) for i in infos),
                                 restore_s=max(i.get("restore_s", 0.0) for i in infos)))
    detector = FaultDetector(world, group.node_of, clock=ctx.clock.time)
    # A 0-step run that restored nothing still starts its workers: they save the weights
    # they built or loaded as step 0 and finish.
    if step >= ctx.spec.run.steps and not (ctx.spec.run.steps == 0 and not restored):
        return Finished()
    group.start(ctx.spec.run.steps)
    _watch_preemptions(ctx, group)
    if world < ctx.spec.scaling.max_size:
        ctx.request_capacity()
    return Running(Attempt(group=group, plan=plan, detector=detector))


def _decide_again_if_slots_went(ctx, state: Placing, *, plan_failed: bool = False):
    """A node may go between a restart's decision and its plan (Ray declares a vanished
    machine dead seconds after its ranks stop): the size is decided again with the slots
    usable now, charging no failure, instead of failing a plan that no longer fits. A warm
    restart (on the workers that are up, ``workers_up``) has a fallback of its own, the full
    size; only once that plan failed too (``plan_failed``) is it decided again."""
    if state.restart_reason is None or state.world_size is None or (state.workers_up is not None and not plan_failed):
        return None
    size = state.full_size or state.world_size
    usable = ctx.usable_slots()
    if usable >= size:
        return None
    log.warning("%d workers no longer fit in the %d usable slots: deciding the size again", size, usable)
    decision = ctx.policies.failure.resize(usable_slots=usable, reason=f"{state.restart_reason}; {size} workers "
                                                             f"no longer fit in the {usable} usable slots")
    return follow_decision(ctx, decision, dict(state.survivors), state.fault_time, lambda: None, live=state.live)


def _while_starting(ctx, rank_to_node) -> None:
    """Called back about once a second while the ranks start and restore: spot notices are
    kept for the attempt's first poll, and a node of the plan that Ray has declared dead
    since fails the start now. A machine that vanished is declared dead by Ray's health
    check seconds after its ranks stopped, so a restart may have planned on it while Ray
    still listed it; a rank placed there never starts (its bundle waits for a node that
    will not return), and the start would otherwise wait out the setup timeout."""
    keep_notices_for_the_attempt(ctx)
    gone = set(rank_to_node) - ctx.alive_nodes()
    if gone:
        raise SetupFailed("start", {rank: f"its node {node[:12]} is gone (Ray declared it dead)"
                                    for rank, node in enumerate(rank_to_node) if node in gone}, [], 0.0)


def _setup_failed(ctx, group, placement, failure: SetupFailed):
    """Workers of the new attempt died or never answered while it started: their node went
    mid-restart (a spot node preempted, a frozen node that Ray's health check declared
    dead). A failure like one in training, decided by the failure policy, never the end of
    the run by itself; one on the nodes where the failed attempt's fault struck, which Ray
    has declared dead since, is the loss being recovered from and is not charged again. Every worker of the attempt
    is let go: the others may be half-way into a rendezvous with the dead one."""
    now, step = ctx.clock.time(), ctx.ledger.step + 1
    implicated = implicated_nodes(ctx)  # before this start's own failures are recorded
    # Where each rank is: known to the group once it answered, else where the plan put it.
    node_of = {**dict(enumerate(placement.rank_to_node)), **getattr(group, "node_of", {})}
    log.warning("attempt failed to start: %s", failure)
    for rank, error in sorted(failure.dead.items()):
        ctx.record(ev.WorkerDied(step=step, rank=rank, node_id=node_of.get(rank, ""), error=error))
    alive, ranks_on = ctx.alive_nodes(), ranks_by_node(node_of)
    for node in sorted({node_of[r] for r in [*failure.dead, *failure.slow] if node_of.get(r)} - alive):
        ctx.record(ev.NodeLost(step=step, node_id=node, ranks=ranks_on[node]))
    hung = sorted(r for r in failure.slow if node_of.get(r) in alive)
    if hung:  # up in Ray's view, silent to the controller: frozen (or stuck) while the attempt started
        ctx.record(ev.HangDetected(step=step, ranks=hung, phases={str(r): f"setup: {failure.phase}" for r in hung},
                                   stalled_s=failure.timeout_s, timeout_s=failure.timeout_s))
    for actor in getattr(group, "actors", []):
        ctx.reservation.vacate(ctx.cluster.actor_id(actor))
        ctx.cluster.kill(actor)
    failed_on = {node_of.get(r) for r in [*failure.dead, *failure.slow]}
    if failed_on and failed_on <= implicated - alive:
        # Nodes where the failed attempt's fault struck, declared dead by Ray after the
        # restart had planned on them: the loss it is recovering from, seen late, not a new
        # failure (charged again, one vanished node could spend the whole failure budget).
        # A node of that attempt that was healthy then and dies now is a new failure.
        usable = ctx.usable_slots()
        decision = ctx.policies.failure.resize(usable_slots=usable, reason=(
            f"{failure}; node(s) {', '.join(sorted(n[:12] for n in failed_on))} of the failed attempt, which Ray "
            f"declared dead since: the loss being recovered from, not charged again"))
    else:
        decision = ctx.policies.failure.decide(kind="failure", step=step, committed_step=ctx.ledger.committed_step,
                                     usable_slots=ctx.usable_slots(), error=str(failure))
    return follow_decision(ctx, decision, {}, now, lambda: failure)


def _plan(ctx, state: Placing, survivors: dict):
    """(world size, mesh, pp choice, placement). A restart on only the workers that are up
    falls back to the full size when they cannot form that mesh."""
    topology = ctx.usable_topology()
    if state.workers_up is not None:
        # only the slots of the workers that are up: never a bundle the warming newcomers hold
        topology = ctx.only_slots(topology, state.workers_up)
    world = state.world_size
    if world is None:  # first start: the configured size, or the best that fits if elastic
        world = ctx.spec.scaling.num_workers
        if ctx.spec.scaling.min_size < world:
            world = best_world_size(ctx.spec, min(world, ctx.usable_slots(topology))) or world
    try:
        plan, resolved, placement = ctx.plan_at(world, topology)
    except RayflexError as e:
        if state.full_size is None:
            # A restart shrank below where the model fits: more room may come (autoscaler,
            # a replacement node); the first start's size is the user's to fix.
            if isinstance(e, CapacityError) and state.restart_reason is not None \
                    and world < ctx.spec.scaling.max_size:
                return _wait_for_a_size_that_fits(ctx, world, e)
            raise
        log.warning("cannot restart on the workers that are up; waiting for the new ones", exc_info=True)
        world = state.full_size
        plan, resolved, placement = ctx.plan_at(world, ctx.usable_topology())
        if ctx.standby is not None:
            ctx.standby.wait(knob("WORKER_START_TIMEOUT_S"))
            survivors.update(ctx.standby.take())
    return world, plan, resolved, placement


def _wait_for_a_size_that_fits(ctx, too_small: int, error: CapacityError):
    """A restart shrank to a size where the model fits in no mesh (the survivors cannot
    hold its shards). Nothing is wrong with the run, only with the cluster's size now: ask
    the autoscaler for capacity and re-plan as slots come back, for up to
    ``resource_wait_s``; then fail with what did not fit."""
    wait_s = ctx.spec.elastic.resource_wait_s
    deadline = ctx.clock.time() + wait_s
    log.warning("the model fits in no mesh of %d workers; waiting up to %.0fs for more: %s", too_small, wait_s, error)
    ctx.request_capacity()
    started = ctx.clock.time()
    while ctx.clock.time() < deadline and not ctx.stop_requested.is_set():
        ctx.clock.sleep(knob("RESOURCE_POLL_S"))
        topology = ctx.usable_topology()
        size = ctx.best_size(topology)
        if size > too_small:
            try:
                planned = (size, *ctx.plan_at(size, topology))
            except CapacityError as e:
                too_small, error = size, e
                continue
            ctx.record(ev.CapacityWaited(waited_s=ctx.clock.time() - started, reason=str(error)[:300]))
            return planned
    ctx.record(ev.CapacityWaited(waited_s=ctx.clock.time() - started, reason=str(error)[:300], outcome="gave_up"))
    raise CapacityError(f"gave up after waiting {wait_s:.0f}s for room: the model fits in no mesh of "
                        f"{too_small} workers, the most the cluster has had since: {error}")


def _start_group(ctx, plan, placement, survivors: dict, world: int, *, shrinking: bool):
    """Reuse the warm workers the placement has ranks for, spawn the rest; a warm worker
    the plan has no rank for waits as a standby for the growth that follows."""
    reservation, cluster = ctx.ensure_reservation(), ctx.cluster
    if ctx.standby is not None:
        if not shrinking:
            # A restart at full size needs the warming standbys (they hold its bundles):
            # one started earlier is never slower than a process started now.
            ctx.standby.wait(knob("WORKER_START_TIMEOUT_S"))
        survivors.update(ctx.standby.take())
    slots = {aid: reservation.slot_of(aid) for aid in survivors}
    members, extra = reservation.assign(placement, survivors)
    alive = ctx.alive_nodes()
    for actor in extra:
        aid = cluster.actor_id(actor)
        slot = slots.get(aid)
        if (ctx.standby is not None and world < ctx.spec.scaling.max_size and slot is not None
                and slot.node in alive and slot.node not in ctx.left_out):
            reservation.bind_slot(slot, aid)
            ctx.standby.adopt(aid, actor, slot.node)
        else:
            cluster.kill(actor)
    reservation.release_unused()
    group = cluster.worker_group(plan, members)
    ctx.note_attempt(group, plan)
    for rank, actor in enumerate(getattr(group, "actors", [])):
        if rank not in getattr(group, "reused", []):
            reservation.bind(rank, cluster.actor_id(actor))
    return group


def _cover_with_keepers(ctx, group) -> None:
    """A replica keeper on every node of the attempt, peers chosen over them (memory
    replicas are an extra: a failure here leaves checkpoints in storage only)."""
    try:
        keepers = ctx.ensure_keepers()
        peers = keepers.cover(set(group.node_of.values()), ctx.cluster.topology())
    except Exception as e:  # noqa: BLE001
        log.warning("memory replica keepers not placed: %s", e)
        return
    fewest = min((len(p) for p in peers.values()), default=0)
    if fewest < keepers.copies:
        reason = (f"a replica lives on another node than its shard and this attempt has {len(peers)} node(s): "
                  f"add nodes, or lower CheckpointConfig.memory_replicas to {max(len(peers) - 1, 0)}")
        log.warning("memory_replicas=%d: %s", keepers.copies, reason)
        ctx.record(ev.MemoryReplicasShort(wanted=keepers.copies, fewest=fewest, nodes=len(peers), reason=reason))


def _live_sample_rows(live) -> dict:
    """step -> the step's rows over every dp rank, from the survivors' snapshots (a live
    recovery's steps that a dead rank finished but never reported)."""
    rows: dict = {}
    for info in (live or {}).get("infos", {}).values():
        rows.update((int(s), r) for s, r in (info.get("sample_rows") or {}).items())
    return rows


def _load_sources(infos: list[dict]) -> dict:
    """Where the ranks read the checkpoint from (memory replicas): shard files per source
    summed over ranks, the slowest rank's load, and every file read from storage and why."""
    loads = [i["restored"] for i in infos if i.get("restored")]
    out: dict = {"load_s": max((r.get("load_s", 0.0) for r in loads), default=0.0)}
    reports = [r["sources"] for r in loads if r.get("sources")]
    if reports:
        out["sources"] = {k: sum(r["files"][k] for r in reports) for k in reports[0]["files"]}
        out["fell_back"] = {name: why for r in reports for name, why in r["fell_back"].items()}
        out["remote_reads"] = sum(r["remote_reads"] for r in reports)
    return out


def _node_prices(ctx, group) -> dict:
    """Dollars per hour of each node the attempt's ranks are on (None: unpriced)."""
    from rayflex.config import node_price

    labels = {n.node_id: n.labels for n in ctx.cluster.topology().nodes}
    return {node: node_price(labels.get(node, {}), ctx.spec.scaling.price_per_hour)
            for node in sorted(set(group.node_of.values())) if node}


def _plan_event(world: int, plan, resolved, placement, group, recompute: str, prices: dict) -> ev.PlanChosen:
    return ev.PlanChosen(world_size=world, pp=plan.pp, dp=plan.dp, tp=plan.tp, dp_replicate=plan.dp_replicate,
                         activation_checkpointing=recompute, replicate_choice=dict(plan.replicate_choice),
                         schedule=plan.schedule,
                         stage_blocks=[list(b) for b in plan.stage_blocks], stage_costs=list(plan.stage_costs),
                         balance=plan.balance, microbatches=plan.microbatches, micro_batch=plan.micro_batch,
                         accum_steps=plan.accum_steps,
                         rank_to_node=[group.node_of.get(r, "") for r in range(world)],
                         planned_rank_to_node=list(placement.rank_to_node),
                         modeled_comm_s=placement.modeled_comm_s, naive_comm_s=placement.naive_comm_s,
                         explanation="\n".join(x for x in (resolved.explanation, placement.explanation) if x),
                         node_prices=prices)


def _watch_preemptions(ctx, group) -> None:
    if ctx.watcher is None:
        ctx.watcher = ctx.cluster.preemption_watcher()
    if ctx.watcher is not None:
        ctx.watcher.watch_nodes(set(group.node_of.values()))
