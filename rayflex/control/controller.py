"""The Controller: owns one run, as an explicit state machine.

INITIALIZING -> PLACING -> RUNNING -> FINISHED | FAILED | STOPPED. Each state is handled by
one method returning the next state; the controller never computes tensors, it places
workers, polls them, records what happens and decides through policies.

A plain class: ``ray.remote(Controller)`` at spawn time makes it the named run actor; tests
can drive it with a stand-in worker group factory.
"""

from __future__ import annotations

import enum
import logging
import statistics
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional

from rayflex.mesh.plan import MeshPlan, plan_mesh
from rayflex.config import TrainSpec
from rayflex.constants import knob, knob_env
from rayflex.errors import RayflexError, WorkerError
from rayflex.telemetry import events as ev
from rayflex.storage.rundir import RunDirectory

log = logging.getLogger(__name__)

class RunState(str, enum.Enum):
    INITIALIZING = "INITIALIZING"
    PLACING = "PLACING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def terminal(self) -> bool:
        return self in (RunState.FINISHED, RunState.FAILED, RunState.STOPPED)


class Controller:
    def __init__(self, spec: TrainSpec, *, group_factory: Optional[Callable] = None,
                 knobs: Optional[dict] = None):
        from rayflex.constants import adopt_knobs
        from rayflex.telemetry.metrics_export import MetricsExporter

        adopt_knobs(knobs)
        self._exporter = MetricsExporter(spec.run.name)
        self.spec = spec
        self.state = RunState.INITIALIZING
        self.rundir = RunDirectory(spec.run.run_dir)
        self.timeline = ev.Timeline()
        self._group_factory = group_factory
        self.group = None
        self.run_placement = None
        self.plan: Optional[MeshPlan] = None
        self.detector = None
        from rayflex.faults.policy import FailurePolicy

        self.policy = FailurePolicy(spec)
        self._target_world: Optional[int] = None
        self._restart_slots: Optional[dict[str, int]] = None  # node -> workers up, for a restart now
        self._full_restart_size: Optional[int] = None  # the size that restart stands in for
        self._grow_to: Optional[int] = None
        self._survivors: dict[str, Any] = {}
        self.standby = None  # StandbyPool: workers warmed before a growth restart needs them
        self._storage_down_since: Optional[float] = None
        self._flusher = ThreadPoolExecutor(1, thread_name_prefix="rundir")
        self._flush_future = None
        self._flush_started = 0.0
        self._fault = None
        self._fault_time: Optional[float] = None
        self._restart_reason: Optional[str] = None
        self._committed_step = 0
        self._excluded: set[str] = set()
        self._preempting = None
        self._ckpt_seconds: list[float] = []
        self.watcher = None
        self.step = 0  # last step every rank finished
        self.start_step = 0
        self.reason = ""
        self.error: Optional[BaseException] = None
        self._pending: dict[int, dict[int, Any]] = {}
        self._metrics: list[dict] = []
        self._stop = threading.Event()
        self._started_at = time.time()
        self._first_step_at: Optional[float] = None
        self._last_ckpt: Optional[dict] = None
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- public
    def run(self) -> dict:
        """Drive the state machine to a terminal state; returns the result dict."""
        handlers = {RunState.INITIALIZING: self._initialize, RunState.PLACING: self._place,
                    RunState.RUNNING: self._running, RunState.RESTARTING: self._restarting}
        while not self.state.terminal:
            try:
                nxt = handlers[self.state]()
            except Exception as e:  # noqa: BLE001 - any error ends the run with its reason
                log.exception("controller error in state %s", self.state.value)
                self.error = e
                self.reason = self.reason or f"{type(e).__name__}: {e}"
                nxt = RunState.FAILED
            self._transition(nxt)
        return self._finish()

    def status(self) -> dict:
        with self._lock:
            last = self._metrics[-1] if self._metrics else {}
        return {"name": self.spec.run.name, "state": self.state.value, "step": self.step,
                "target_steps": self.spec.run.steps, "loss": last.get("loss"),
                "tokens_per_s": last.get("tokens_per_s"),
                "world_size": self.plan.world_size if self.plan else None,
                "last_checkpoint": self._last_ckpt, "run_dir": self.spec.run.run_dir,
                "reason": self.reason, "restarts": len(self.timeline.of(ev.Restarted)),
                "workers": self._workers()}

    def _workers(self) -> list[dict]:
        group = self.group
        if group is None or not getattr(group, "node_of", None):
            return []
        pids = getattr(group, "pids", {})
        return [{"rank": r, "node_id": group.node_of.get(r), "pid": pids.get(r)} for r in sorted(group.node_of)]

    def metrics(self, since_step: int = 0) -> list[dict]:
        with self._lock:
            return [m for m in self._metrics if m["step"] > since_step]

    def events(self) -> list[dict]:
        return [e.to_dict() for e in self.timeline.events]

    def inject_failure(self, rank: int, at_step: int, message: str) -> int:
        """Fault injection (chaos runs, tests): rank ``rank`` of the current attempt raises
        ``message`` once, at the first step it starts at or after ``at_step``. A restart
        before then disarms it (the injector re-arms). Returns the rank's last finished step."""
        import ray

        return ray.get(self.group.actors[rank].set_fail_at.remote(at_step, message), timeout=30)

    def request_stop(self, reason: str = "stop requested") -> None:
        self.reason = reason
        self._stop.set()

    def request_checkpoint(self) -> None:
        if self.group is not None:
            self.group.call(0, "request_checkpoint", "on_demand")

    # ----------------------------------------------------------------- states
    def _transition(self, nxt: RunState) -> None:
        log.info("run %s: %s -> %s", self.spec.run.name, self.state.value, nxt.value)
        self.state = nxt

    def _flush_rundir(self) -> None:
        """Store the run directory's new lines in the background (a slow or unreachable
        store must not stall fault detection); an outage is an event, not a failure."""
        now = time.time()
        if self._flush_future is not None:
            if not self._flush_future.done():
                if now - self._flush_started > knob("STORAGE_STALL_S"):
                    self._storage_trouble(f"a write of the run directory has not finished after "
                                          f"{now - self._flush_started:.0f}s")
                return
            error = self._flush_future.result()
            if error is not None:
                self._storage_trouble(error)
            else:
                self._storage_ok()
        self._flush_started = now
        self._flush_future = self._flusher.submit(self.rundir.flush)

    def _finish_flushes(self) -> None:
        """Wait for the background flush, then store everything (retrying through an outage)."""
        if self._flush_future is not None:
            self._flush_future.result()
            self._flush_future = None
        self.rundir.flush_until_stored(knob("STORAGE_FINAL_WAIT_S"))
        self._flusher.shutdown(wait=False)

    def _storage_trouble(self, error: str) -> None:
        if self._storage_down_since is None:
            self._storage_down_since = time.time()
            self._record(ev.StorageUnavailable(step=self.step, uri=self.spec.run.run_dir, error=error))
            log.warning("run directory unavailable, keeping its lines in memory: %s", error)

    def _storage_ok(self) -> None:
        if self._storage_down_since is not None:
            down = time.time() - self._storage_down_since
            self._storage_down_since = None
            self._record(ev.StorageRecovered(step=self.step, uri=self.spec.run.run_dir, down_s=down))

    def _record(self, event: ev.Event) -> ev.Event:
        self.timeline.add(event)
        self._exporter.on_event(event)
        self.rundir.add_line("events.jsonl", event.to_dict())
        log.info("event: %s", event.describe())
        return event

    def _initialize(self) -> RunState:
        self.rundir.ensure()
        # A run directory with history: continue its files (resume by name).
        self.rundir.load_lines("metrics.jsonl")
        self.rundir.load_lines("events.jsonl")
        self.rundir.load_lines("samples.jsonl")
        self.timeline = ev.Timeline.from_jsonl("\n".join(self.rundir.lines("events.jsonl")))
        self._metrics = [__import__("json").loads(line) for line in self.rundir.lines("metrics.jsonl")]
        self.rundir.write_json("spec.json", _describe_spec(self.spec))
        self._record(ev.RunStarted(name=self.spec.run.name, target_steps=self.spec.run.steps,
                                   step=self._metrics[-1]["step"] if self._metrics else 0))
        return RunState.PLACING

    def _usable_topology(self):
        from rayflex.planning.topology import Topology

        topology = Topology.from_ray(cpus_per_worker=self.spec.scaling.cpus_per_worker,
                                     use_gpu=self.spec.scaling.use_gpu)
        if self._excluded:  # nodes with a preemption notice: about to vanish
            topology = Topology(tuple(n for n in topology.nodes if n.node_id not in self._excluded),
                                topology.bandwidths)
        return topology

    def _usable_slots(self, topology) -> int:
        labels = self.spec.scaling.node_labels
        return sum(n.slots for n in topology.usable().nodes
                   if all(n.labels.get(k) == v for k, v in labels.items()))

    def _place(self) -> RunState:
        from rayflex.faults.policy import best_world_size
        from rayflex.group.reservation import RunPlacement
        from rayflex.planning.comm_profile import plan_for

        t0 = time.time()
        topology = self._usable_topology()
        shrinking = self._restart_slots is not None  # restarting now with the workers that are up
        if shrinking:
            topology = self._topology_of_workers_up(topology)
        world = self._target_world
        if world is None:  # first start: the configured size, or the best that fits if elastic
            world = self.spec.scaling.num_workers
            if self.spec.scaling.min_size < world:
                world = best_world_size(self.spec, min(world, self._usable_slots(topology))) or world
        from rayflex.planning.capacity.auto import resolve_parallel

        # pp="auto": the capacity planner picks the fastest mesh that fits this world size,
        # at launch and again on every elastic restart.
        def plan_at(size: int, topo):
            resolved = resolve_parallel(self.spec, size, topo)
            self.plan = plan_mesh(self.spec.model, resolved.parallel, resolved.data, size)
            return resolved, plan_for(self.spec, self.plan, topo)  # PlacementError names what is missing

        try:
            resolved, placement = plan_at(world, topology)
        except RayflexError:
            if self._full_restart_size is None:
                raise
            # The workers that are up cannot form that mesh: restart at full size after all.
            log.warning("cannot restart on the workers that are up; waiting for the new ones", exc_info=True)
            world = self._full_restart_size
            resolved, placement = plan_at(world, self._usable_topology())
            if self.standby is not None:
                self.standby.wait(knob("WORKER_START_TIMEOUT_S"))
                self._survivors.update(self.standby.take())
        self._full_restart_size = None
        if self.run_placement is None:
            self.run_placement = RunPlacement(self.spec)
        if self.standby is not None:
            if not shrinking:
                # A restart at full size needs the warming standbys (they hold its bundles):
                # one started earlier is never slower than a process started now.
                self.standby.wait(knob("WORKER_START_TIMEOUT_S"))
            self._survivors.update(self.standby.take())
        slots = {aid: self.run_placement.slot_of(aid) for aid in self._survivors}
        members, extra = self.run_placement.assign(placement, self._survivors)
        alive = _alive_nodes()
        for actor in extra:
            # A warm worker the smaller plan has no rank for waits as a standby for the
            # growth that follows; one on a departing node goes.
            aid, slot = _actor_id(actor), slots.get(_actor_id(actor))
            if (self.standby is not None and world < self.spec.scaling.max_size and slot is not None
                    and slot["node"] in alive and slot["node"] not in self._excluded):
                self.run_placement.bind_slot(slot, aid)
                self.standby.adopt(aid, actor, slot["node"])
            else:
                _kill(actor)
        self.run_placement.release_unused()
        factory = self._group_factory or _ray_group
        self.group = factory(self.spec, self.plan, members)
        for rank, actor in enumerate(getattr(self.group, "actors", [])):
            if rank not in getattr(self.group, "reused", []):
                self.run_placement.bind(rank, _actor_id(actor))
        self._survivors = {}
        infos = self.group.setup(restore=self.spec.checkpoint.resume)
        self._record(ev.PlanChosen(world_size=world, pp=self.plan.pp, dp=self.plan.dp,
                                   schedule=self.plan.schedule,
                                   stage_blocks=[list(b) for b in self.plan.stage_blocks],
                                   stage_costs=list(self.plan.stage_costs), balance=self.plan.balance,
                                   microbatches=self.plan.microbatches, micro_batch=self.plan.micro_batch,
                                   accum_steps=self.plan.accum_steps,
                                   rank_to_node=[self.group.node_of.get(r, "") for r in range(world)],
                                   planned_rank_to_node=list(placement.rank_to_node),
                                   modeled_comm_s=placement.modeled_comm_s, naive_comm_s=placement.naive_comm_s,
                                   explanation="\n".join(x for x in (resolved.explanation,
                                                                     placement.explanation) if x)))
        steps = {i["step"] for i in infos}
        if len(steps) != 1:
            raise RayflexError(f"ranks restored different steps {sorted(steps)}; checkpoint is inconsistent")
        self.step = self.start_step = steps.pop()
        self._committed_step = max(self._committed_step, self.step)
        restored = infos[0].get("restored")
        if restored:
            self._record(ev.CheckpointLoaded(step=self.step, uri=restored.get("uri", ""), world_size=world,
                                             saved_world_size=restored.get("world_size", 0),
                                             skipped=restored.get("skipped", [])))
        # Steps past the restored one belong to a timeline that was rolled back: re-run.
        with self._lock:
            rolled_back = [m for m in self._metrics if m["step"] > self.step]
            self._metrics = [m for m in self._metrics if m["step"] <= self.step]
        if rolled_back:
            for name in ("metrics.jsonl", "samples.jsonl"):
                self.rundir.rewrite(name, lambda line: line["step"] <= self.step)
        self._pending.clear()
        if self._restart_reason is not None:
            self._record(ev.Restarted(step=self.step, world_size=world, from_step=self.step,
                                      reason=self._restart_reason, lost_steps=len(rolled_back),
                                      reused_workers=len(getattr(self.group, "reused", [])),
                                      fault_time=self._fault_time))
            self._restart_reason = None
        self._record(ev.WorkersStarted(step=self.step, world_size=world, setup_s=time.time() - t0,
                                       spawn_s=getattr(self.group, "spawn_s", 0.0),
                                       rendezvous_s=max(i.get("rendezvous_s", 0.0) for i in infos),
                                       build_s=max(i.get("build_s", 0.0) for i in infos),
                                       restore_s=max(i.get("restore_s", 0.0) for i in infos)))
        from rayflex.faults.detector import FaultDetector

        self.detector = FaultDetector(world, self.group.node_of)
        if self.step >= self.spec.run.steps:
            return RunState.FINISHED
        self.group.start(self.spec.run.steps)
        self._watch_preemptions()
        if world < self.spec.scaling.max_size:
            _request_capacity(self.spec)
        return RunState.RUNNING

    def _running(self) -> RunState:
        stop_sent = False
        last_flush = last_nodes = last_capacity = last_notice = time.time()
        alive_nodes = _alive_nodes()
        interval = knob("POLL_INTERVAL_S")
        while True:
            cycle_start = time.time()
            if self._stop.is_set() and not stop_sent:
                self.group.broadcast("request_stop")
                stop_sent = True
            result = self.group.poll()
            for rank, st in sorted(result.statuses.items()):
                self._absorb(rank, st)
            now = time.time()
            if now - last_nodes > 0.5:
                alive_nodes, last_nodes = _alive_nodes(), now
            fault = self.detector.check(result, alive_nodes)
            if not fault and self.watcher is not None and now - last_notice > 0.5:
                last_notice = now
                fault = self._check_notices(result)
            if fault and self._preempting is not None:
                fault.kind = "preemption"  # the node went before the emergency save finished
            if fault:
                self._fault = fault
                self._fault_time = now
                for event in fault.events:
                    self._record(event)
                return RunState.RESTARTING
            states = {st.state for st in result.statuses.values()}
            if len(result.statuses) == self.plan.world_size and states <= {"done", "stopped"}:
                self._flush_rundir()
                if states == {"done"} and self.step >= self.spec.run.steps:
                    return RunState.FINISHED
                if self._preempting is not None:
                    return self._begin_preemption_restart()
                if self._grow_to is not None and not self._stop.is_set():
                    return self._begin_growth()
                self._record(ev.RunStopped(step=self.step, reason=self.reason or "stopped"))
                return RunState.STOPPED
            if (not stop_sent and self._grow_to is None and self._preempting is None and now - last_capacity > 2.0
                    and self.plan.world_size < self.spec.scaling.max_size):
                last_capacity = now
                self._check_growth()
                if self._grow_to is not None and not self._warm_standbys(self._grow_to):
                    self._grow_to = None  # retried at the next capacity check
            if not stop_sent and self._grow_to is not None and self._preempting is None:
                warm = self._standbys_state()
                if warm == "failed":
                    self._grow_to = None
                elif warm == "ready":
                    # Stop at the next step boundary; the stop leaves a checkpoint there.
                    self.group.broadcast("request_stop")
                    stop_sent = True
            if now - last_flush > 1.0:
                self._flush_rundir()
                last_flush = now
            time.sleep(max(0.0, interval - (time.time() - cycle_start)))

    # ----------------------------------------------------------------- preemption
    def _watch_preemptions(self) -> None:
        from rayflex.faults import preemption as pre

        if self.watcher is None:
            cfg = self.spec.elastic
            sources: list = []
            if cfg.watch_ray_drain:
                sources.append(pre.RayDrainSource())
            if cfg.metadata_url:
                sources.append(pre.MetadataSource(cfg.metadata_url, cfg.metadata_kind))
            if cfg.notice_file:
                sources.append(pre.NoticeFileSource(cfg.notice_file))
            self.watcher = pre.PreemptionWatcher(sources) if sources else None
        if self.watcher is not None:
            self.watcher.watch_nodes(set(self.group.node_of.values()))

    def _checkpoint_estimate_s(self) -> float:
        """How long an emergency checkpoint takes, from this run's recent saves."""
        if self._ckpt_seconds:
            return statistics.median(self._ckpt_seconds[-5:])
        return knob("EMERGENCY_CHECKPOINT_DEFAULT_S")

    def _check_notices(self, poll):
        from rayflex.faults.detector import Fault

        for notice in self.watcher.poll():
            ranks = sorted(r for r, n in self.group.node_of.items() if n == notice.node_id)
            self._excluded.add(notice.node_id)
            left = notice.seconds_left()
            step_s = statistics.median(self.detector.step_times) if self.detector.step_times else 1.0
            needed = step_s + self._checkpoint_estimate_s() + self.spec.elastic.emergency_margin_s
            base = dict(step=self.step, node_id=notice.node_id, deadline=notice.deadline, source=notice.source,
                        ranks=ranks, seconds_left=left, needed_s=needed)
            if not ranks:
                self._record(ev.PreemptionNotice(**base, action="no_workers",
                                                 reason="no worker on the node; it is excluded from placement"))
                continue
            if self._preempting is not None:
                self._record(ev.PreemptionNotice(**base, action="emergency_checkpoint",
                                                 reason="joins the emergency checkpoint already under way"))
                continue
            if left >= needed:
                self._record(ev.PreemptionNotice(**base, action="emergency_checkpoint", reason=(
                    f"{left:.1f}s left >= {needed:.1f}s needed (a step {step_s:.2f}s + checkpoint "
                    f"{self._checkpoint_estimate_s():.2f}s + margin {self.spec.elastic.emergency_margin_s:.1f}s)")))
                self._preempting = notice
                self._grow_to = None  # the restart after the checkpoint picks the size
                self.group.broadcast("request_stop", "preemption")
                # The replacements for the node's ranks start while the checkpoint is taken.
                self._warm_standbys(self._replacement_size())
                continue
            why = (f"only {left:.1f}s left, an emergency checkpoint needs {needed:.1f}s: restoring the last "
                   f"committed checkpoint (step {self._committed_step}) without node {notice.node_id[:12]}")
            self._record(ev.PreemptionNotice(**base, action="restore_last_committed", reason=why))
            return Fault(bad_ranks=set(ranks), kind="preemption", error=why)
        return None

    def _begin_preemption_restart(self) -> RunState:
        from rayflex.faults.detector import Fault

        notice, self._preempting = self._preempting, None
        ranks = {r for r, n in self.group.node_of.items() if n in self._excluded}
        self._fault = Fault(bad_ranks=ranks, kind="preemption",
                            error=f"spot preemption of node {notice.node_id[:12]} ({notice.source})")
        self._fault_time = time.time()
        return RunState.RESTARTING

    def _check_growth(self) -> None:
        from rayflex.faults.policy import ElasticPolicy

        if not self.spec.checkpoint.every_steps:
            return  # growing restarts from a checkpoint; without them it would lose progress
        slots = self._usable_slots(self._usable_topology())
        target = ElasticPolicy(self.spec).grow_to(self.plan.world_size, slots)
        if target is not None:
            self._grow_to = target
            log.info("capacity for %d workers is back (%d usable slots): growing at the next step boundary",
                     target, slots)

    def _replacement_size(self) -> int:
        """The world size a restart would pick with the slots usable now."""
        return self._best_size(self._usable_topology())

    def _best_size(self, topology) -> int:
        from rayflex.faults.policy import best_world_size

        return best_world_size(self.spec, self._usable_slots(topology)) or 0

    def _warm_standbys(self, target: int, current: Optional[dict[str, int]] = None,
                       avoid: frozenset | set = frozenset()) -> bool:
        """Start, on the nodes the plan for ``target`` ranks uses, the workers the current
        group lacks there (ranks on excluded nodes do not count), while the run keeps
        training. False if that plan cannot be made now."""
        from rayflex.planning.comm_profile import plan_for
        from rayflex.group.standby import StandbyPool

        if self._group_factory is not None or target <= 0:
            return False  # a stand-in group (unit tests), or no size to warm for
        if self.standby is None:
            self.standby = StandbyPool(self._spawn_standby, self.run_placement, _actor_id)
        from rayflex.planning.capacity.auto import resolve_parallel

        try:
            topology = self._usable_topology()
            if avoid:
                from rayflex.planning.topology import Topology

                topology = Topology(tuple(n for n in topology.nodes if n.node_id not in avoid), topology.bandwidths)
                target = min(target, self._best_size(topology))
                if target <= 0:
                    return False
            resolved = resolve_parallel(self.spec, target, topology)
            placement = plan_for(self.spec, plan_mesh(self.spec.model, resolved.parallel, resolved.data, target),
                                 topology)
            if current is None:  # while running: the group's workers, per node
                current = {}
                for node in self.group.node_of.values():
                    current[node] = current.get(node, 0) + 1
            for node, ranks in placement.node_ranks().items():
                need = len(ranks) - current.get(node, 0) - self.standby.count(node)
                if need > 0:
                    self.standby.start(node, need)
            return True
        except Exception as e:  # noqa: BLE001 - the node went meanwhile: retry at the next check
            log.warning("could not warm workers for %d ranks: %s", target, e)
            self.standby.clear()
            return False

    def _spawn_standby(self, strategy):
        from rayflex.group.worker_group import worker_actor_class

        return worker_actor_class(self.spec).options(scheduling_strategy=strategy).remote(
            -1, self.spec, self.plan, knobs=knob_env())

    def _standbys_state(self) -> str:
        """"ready" once every standby is up, "warming" before, "failed" (and the pool is
        emptied) if one could not start or they take longer than WORKER_START_TIMEOUT_S."""
        if self.standby is None:
            return "ready"
        errors = self.standby.poll()
        too_slow = self.standby.oldest_warming_s() > knob("WORKER_START_TIMEOUT_S")
        if errors or too_slow:
            log.warning("standby workers given up: %s",
                        "; ".join(errors) or f"not up after {knob('WORKER_START_TIMEOUT_S'):.0f}s")
            self.standby.clear()
            return "failed"
        return "ready" if self.standby.warming == 0 else "warming"

    def _begin_growth(self) -> RunState:
        self._restart_reason = f"capacity returned: growing from {self.plan.world_size} to {self._grow_to} workers"
        self._fault_time = time.time()
        self._target_world = self._grow_to
        self._grow_to = None
        self._collect_survivors(set())
        return RunState.PLACING

    def _collect_survivors(self, bad_ranks: set[int], raised: frozenset = frozenset(),
                           warm: Optional[Callable[[], None]] = None) -> None:
        """Kill the dead or frozen ranks; ask the others to leave the attempt and keep the
        ones that could. Ranks whose loop *raised* are alive: they leave like the others
        (so a checkpoint they are still uploading can commit) and are then replaced."""
        kill_now = set(bad_ranks) - set(raised)
        self.group.kill(sorted(kill_now))
        for r in kill_now:
            self.run_placement.vacate(_actor_id(self.group.actors[r]))
        if warm is not None:
            warm()  # the dead ranks' bundles are free now; the survivors may take seconds to leave
        others = [r for r in range(self.plan.world_size) if r not in kill_now]
        # With a peer dead, an in-flight save cannot commit: leave at once, so the sockets
        # the other survivors are blocked on close now.
        grace = 0.0 if kill_now else 3.0
        # A dead or raising peer leaves the others in collectives that cannot complete:
        # abort them (after the checkpoint grace, so a save in flight can still commit). A
        # growth stop is at a step boundary and leaves gracefully.
        released = (self.group.release(others, timeout_s=knob("RELEASE_TIMEOUT_S"), checkpoint_grace_s=grace,
                                       abort=bool(kill_now or raised)) if others else {})
        self._survivors = {}
        for r in others:
            actor = self.group.actors[r]
            if released.get(r) and r not in raised:
                self._survivors[_actor_id(actor)] = actor
                continue
            if not released.get(r):
                log.warning("rank %d did not leave the failed attempt within %.0fs; killing it",
                            r, knob("RELEASE_TIMEOUT_S"))
            self.group.kill([r])
            self.run_placement.vacate(_actor_id(actor))
        self.group = None

    def _restarting(self) -> RunState:
        from rayflex.faults.policy import Fail, Restart, WaitForResources

        fault = self._fault
        node_of = dict(self.group.node_of)
        raised = frozenset(e.rank for e in fault.events if isinstance(e, ev.WorkerFailed))
        # Replacements are warmed only for the ranks killed now: a rank that raised still
        # holds its slot until it has left, so a bundle reserved there would only time out.
        gone = set(fault.bad_ranks) - raised
        self._collect_survivors(set(fault.bad_ranks), raised,
                                warm=(lambda: self._warm_replacements(node_of, gone)) if gone else None)
        # Dead actors are seen before Ray declares their node dead; name the lost nodes
        # now, so the timeline says whether a process or a whole node went.
        reported = {e.node_id for e in fault.events if isinstance(e, ev.NodeLost)}
        alive = _alive_nodes()
        for node in sorted({node_of[r] for r in fault.bad_ranks if r in node_of} - alive - reported):
            self._record(ev.NodeLost(step=self.step + 1, node_id=node,
                                     ranks=sorted(r for r, n in node_of.items() if n == node)))
        deadline = None
        while True:
            slots = self._usable_slots(self._usable_topology())
            decision = self.policy.decide(kind=fault.kind, step=self.step + 1, committed_step=self._committed_step,
                                          usable_slots=slots, error=fault.error) if deadline is None else \
                self.policy.resize(usable_slots=slots)
            if isinstance(decision, Fail):
                self.reason = decision.reason
                self.error = self._worker_error(fault)
                return RunState.FAILED
            if isinstance(decision, Restart):
                self._target_world = decision.world_size
                self._restart_reason = decision.reason
                self._restart_with_what_is_up(decision.world_size)
                return RunState.PLACING
            assert isinstance(decision, WaitForResources)
            if deadline is None:
                deadline = time.time() + decision.timeout_s
                _request_capacity(self.spec)
                log.warning("waiting up to %.0fs for resources: %s", decision.timeout_s, decision.reason)
            if time.time() > deadline or self._stop.is_set():
                self.reason = f"gave up waiting for resources after {decision.timeout_s:.0f}s: {decision.reason}"
                return RunState.FAILED
            time.sleep(1.0)

    def _warm_replacements(self, node_of: dict[int, str], bad_ranks: set[int]) -> None:
        """Start the replacements for the ranks that are gone now, while the survivors leave
        (seconds, when one is blocked on a dead peer): the restart then finds them warm or
        nearly so. Never on a node that lost all its ranks: it is probably on its way out,
        before Ray has noticed."""
        if not self.spec.elastic.restart_while_warming or self._group_factory is not None:
            return
        avoid = {node for node in set(node_of.values())
                 if all(r in bad_ranks for r, n in node_of.items() if n == node)}
        current: dict[str, int] = {}
        for rank, node in node_of.items():
            if rank not in bad_ranks:
                current[node] = current.get(node, 0) + 1
        self._warm_standbys(self._replacement_size(), current, avoid=avoid)

    def _topology_of_workers_up(self, topology):
        """Only the slots of the workers that are up, so a restart with them never asks
        for a bundle the warming newcomers hold."""
        import dataclasses

        from rayflex.planning.topology import Topology

        slots, self._restart_slots = self._restart_slots, None
        return Topology(tuple(dataclasses.replace(n, slots=slots[n.node_id])
                              for n in topology.nodes if slots.get(n.node_id)), topology.bandwidths)

    def _restart_with_what_is_up(self, size: int) -> None:
        """With ``restart_while_warming``: if ``size`` needs workers that are not up, start
        them as standbys and restart now at the largest valid size the survivors and warm
        standbys fill; the run grows to ``size`` once the newcomers are warm."""
        from rayflex.faults.policy import best_world_size

        if not self.spec.elastic.restart_while_warming or self._group_factory is not None:
            return
        if self.standby is not None:
            self.standby.poll()
        up = len(self._survivors) + (self.standby.ready if self.standby is not None else 0)
        if up >= size:
            return
        now = best_world_size(self.spec, up)
        if now is None or now < self.spec.scaling.min_size:
            return  # too few to train with: wait for the new workers
        current: dict[str, int] = {}
        for actor_id in self._survivors:
            node = self.run_placement.node_of_actor(actor_id) if self.run_placement else None
            if node is not None:
                current[node] = current.get(node, 0) + 1
        up_slots = dict(current)
        for node in self.standby.nodes() if self.standby is not None else ():
            up_slots[node] = up_slots.get(node, 0) + self.standby.count_ready(node)
        if not self._warm_standbys(size, current):
            return  # cannot place the newcomers now: restart at ``size`` as usual
        self._target_world = now
        self._restart_slots = up_slots
        self._full_restart_size = size
        self._restart_reason += (f"; restarting at once with the {now} workers that are up, growing to {size} "
                                 f"when {size - up} more are warm")

    def _worker_error(self, fault) -> Optional[BaseException]:
        failed = [e for e in fault.events if isinstance(e, ev.WorkerFailed)]
        if failed:
            e = failed[0]
            return WorkerError(e.rank, e.node_id, e.step or 0, e.error)
        return RayflexError(fault.error) if fault.error else None

    def _absorb(self, rank: int, st) -> None:
        """Fold one rank's step records into per-step metrics once every rank reported."""
        for rec in st.records:
            self._pending.setdefault(rec.step, {})[rank] = rec
        for ck in st.checkpoints:
            if rank == 0 and ck.get("committed"):
                self._last_ckpt = {"step": ck["step"], "uri": ck.get("uri")}
                self._committed_step = max(self._committed_step, ck["step"])
                self._ckpt_seconds.append(ck.get("blocked_s", 0.0) + ck.get("total_s", 0.0))
                self._record(ev.CheckpointCommitted(step=ck["step"], uri=ck.get("uri", ""),
                                                    blocked_s=ck.get("blocked_s", 0.0),
                                                    total_s=ck.get("total_s", 0.0),
                                                    bytes=ck.get("bytes", 0), reason=ck.get("reason", "")))
            elif rank == 0 and ck.get("error"):
                self._record(ev.CheckpointFailed(step=ck.get("step"), reason=ck["error"]))
        world = self.plan.world_size
        while (self.step + 1) in self._pending and len(self._pending[self.step + 1]) == world:
            recs = self._pending.pop(self.step + 1)
            r0 = recs[0]
            step_time = max(r.step_time_s for r in recs.values())
            tokens = r0.samples * self.spec.data.seq_len
            line = {"step": r0.step, "loss": r0.loss, "step_time_s": step_time,
                    "tokens_per_s": tokens / step_time if step_time > 0 else None, "lr": r0.lr,
                    "grad_norm": r0.grad_norm, "world_size": world, "ranks_reported": len(recs),
                    "time": max(r.time for r in recs.values())}
            pp = self.plan.pp
            line["activation_peak_bytes"] = [max(r.activation_peak_bytes for r in recs.values() if r.pp_index == s)
                                              for s in range(pp)]
            if pp > 1:
                line["pipeline_wait_fraction"] = [
                    statistics.fmean(r.pipeline_wait_s / r.forward_backward_s if r.forward_backward_s else 0.0
                                     for r in recs.values() if r.pp_index == s) for s in range(pp)]
            if self.spec.data.log_samples:
                first_stage = sorted((r.dp_index, r.sample_indices) for r in recs.values() if r.pp_index == 0)
                self.rundir.add_line("samples.jsonl", {"step": r0.step, "world_size": world,
                                                       "indices": [i for _, idx in first_stage for i in idx or []]})
            if self.detector is not None:
                for event in self.detector.note_step(r0.step, step_time,
                                                     {r: rec.sync_wait_s for r, rec in recs.items()}):
                    self._record(event)
            if self._first_step_at is None:
                self._first_step_at = line["time"]
            with self._lock:
                self._metrics.append(line)
            self.rundir.add_line("metrics.jsonl", line)
            self._exporter.on_metrics(line)
            self.step = r0.step

    # ----------------------------------------------------------------- teardown
    def _finish(self) -> dict:
        if self.state is RunState.FINISHED:
            self._record(ev.RunFinished(step=self.step))
        elif self.state is RunState.FAILED:
            self._record(ev.RunFailedEvent(step=self.step, reason=self.reason))
        self._teardown()
        self._finish_flushes()
        result = self.result()
        self.rundir.write_json("result.json", result)
        try:  # the report is a convenience: never fail a run over a plot
            from rayflex.telemetry.report import write_report

            write_report(self.spec.run.run_dir)
        except Exception as e:  # noqa: BLE001
            log.warning("could not write the run report: %s", e)
        return result

    def _teardown(self) -> None:
        if self.group is not None:
            try:
                self.group.shutdown()
            except Exception:  # noqa: BLE001
                log.warning("worker shutdown failed:\n%s", traceback.format_exc())
        for actor in self._survivors.values():
            _kill(actor)
        if self.standby is not None:
            self.standby.clear()
        if self.watcher is not None:
            self.watcher.close()
        if self.run_placement is not None:
            try:
                self.run_placement.remove()
            except Exception:  # noqa: BLE001
                log.warning("placement removal failed:\n%s", traceback.format_exc())

    def result(self) -> dict:
        metrics = self._metrics
        wall = time.time() - self._started_at
        steady = [m["tokens_per_s"] for m in metrics[1:] if m["step"] > self.start_step + 1
                  and m.get("tokens_per_s")]
        err = self.error
        return {
            "name": self.spec.run.name,
            "status": self.state.value.lower(),
            "reason": self.reason,
            "error_type": type(err).__name__ if err else None,
            "error": (err.traceback if isinstance(err, WorkerError) else str(err)) if err else None,
            "error_rank": getattr(err, "rank", None),
            "steps_completed": self.step,
            "target_steps": self.spec.run.steps,
            "start_step": self.start_step,
            "first_loss": metrics[0]["loss"] if metrics else None,
            "final_loss": metrics[-1]["loss"] if metrics else None,
            "tokens_per_s": statistics.median(steady) if steady else None,
            "time_to_first_step_s": (self._first_step_at - self._started_at) if self._first_step_at else None,
            "wall_time_s": wall,
            "world_size": self.plan.world_size if self.plan else None,
            "restarts": len(self.timeline.of(ev.Restarted)),
            "failures": len(self.timeline.of(ev.WorkerFailed)) + len(self.timeline.of(ev.WorkerDied)),
            "last_checkpoint": self._last_ckpt,
            "run_dir": self.spec.run.run_dir,
            "goodput": _goodput(metrics, self.timeline),
            "preemptions": len({e.node_id for e in self.timeline.of(ev.PreemptionNotice) if e.ranks}),
            "lost_steps": sum(e.lost_steps for e in self.timeline.of(ev.Restarted)),
        }


def _describe_spec(spec: TrainSpec) -> dict:
    import dataclasses

    out = {}
    for name in ("data", "run", "scaling", "parallel", "checkpoint", "elastic"):
        out[name] = dataclasses.asdict(getattr(spec, name))
    out["model"] = {"name": spec.model.name, "num_blocks": spec.model.num_blocks}
    return out


def _goodput(metrics: list[dict], timeline) -> Optional[float]:
    try:
        from rayflex.telemetry.goodput import goodput

        return goodput(metrics, [e.to_dict() for e in timeline.events])
    except Exception as e:  # noqa: BLE001 - a report number must not fail the run
        log.warning("goodput unavailable: %s", e)
        return None


def _ray_group(spec, plan, members):
    from rayflex.group.worker_group import RayWorkerGroup

    return RayWorkerGroup(spec, plan, members)


def _actor_id(actor) -> str:
    return actor._actor_id.hex()


def _kill(actor) -> None:
    import ray

    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already dead
        pass


def _alive_nodes() -> set[str]:
    import ray

    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def _request_capacity(spec: TrainSpec) -> None:
    """Ask Ray's autoscaler for bundles up to max_workers (a no-op without an autoscaler)."""
    try:
        from ray.autoscaler.sdk import request_resources

        request_resources(bundles=[spec.scaling.worker_resources() for _ in range(spec.scaling.max_size)])
    except Exception as e:  # noqa: BLE001 - clusters without an autoscaler
        log.debug("request_resources unavailable: %s", e)
