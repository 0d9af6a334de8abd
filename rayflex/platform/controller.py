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
from typing import Any, Callable, Optional

from rayflex.actors.parallel import MeshPlan, plan_mesh
from rayflex.config import TrainSpec
from rayflex.constants import knob
from rayflex.errors import RayflexError, WorkerError
from rayflex.platform import events as ev
from rayflex.storage.rundir import RunDirectory

log = logging.getLogger(__name__)

CONTROLLER_NAMESPACE = "rayflex"


def controller_name(run_name: str) -> str:
    return f"rayflex-controller:{run_name}"


class RunState(str, enum.Enum):
    INITIALIZING = "INITIALIZING"
    PLACING = "PLACING"
    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    FAILED = "FAILED"
    STOPPED = "STOPPED"

    @property
    def terminal(self) -> bool:
        return self in (RunState.FINISHED, RunState.FAILED, RunState.STOPPED)


class Controller:
    def __init__(self, spec: TrainSpec, *, group_factory: Optional[Callable] = None,
                 placer: Optional[Callable] = None):
        self.spec = spec
        self.state = RunState.INITIALIZING
        self.rundir = RunDirectory(spec.run.run_dir)
        self.timeline = ev.Timeline()
        self._group_factory = group_factory
        self._placer = placer
        self.group = None
        self.placement = None
        self.plan: Optional[MeshPlan] = None
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
                    RunState.RUNNING: self._running}
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

    def _record(self, event: ev.Event) -> ev.Event:
        self.timeline.add(event)
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

    def _place(self) -> RunState:
        world = self.spec.scaling.num_workers
        self.plan = plan_mesh(self.spec.model, self.spec.parallel, self.spec.data, world)
        t0 = time.time()
        placer = self._placer or _topology_placer
        self.placement, strategies, placement_info = placer(self.spec, self.plan)
        factory = self._group_factory or _ray_group
        self.group = factory(self.spec, self.plan, strategies)
        infos = self.group.setup(restore=self.spec.checkpoint.resume)
        self._record(ev.PlanChosen(world_size=world, pp=self.plan.pp, dp=self.plan.dp,
                                   schedule=self.plan.schedule,
                                   stage_blocks=[list(b) for b in self.plan.stage_blocks],
                                   stage_costs=list(self.plan.stage_costs), balance=self.plan.balance,
                                   microbatches=self.plan.microbatches, micro_batch=self.plan.micro_batch,
                                   accum_steps=self.plan.accum_steps,
                                   rank_to_node=[self.group.node_of.get(r, "") for r in range(world)],
                                   **placement_info))
        steps = {i["step"] for i in infos}
        if len(steps) != 1:
            raise RayflexError(f"ranks restored different steps {sorted(steps)}; checkpoint is inconsistent")
        self.step = self.start_step = steps.pop()
        restored = infos[0].get("restored")
        if restored:
            self._record(ev.CheckpointLoaded(step=self.step, uri=restored.get("uri", ""), world_size=world,
                                             saved_world_size=restored.get("world_size", 0),
                                             skipped=restored.get("skipped", [])))
            # Metrics past the restored step belong to a timeline that was rolled back.
            with self._lock:
                self._metrics = [m for m in self._metrics if m["step"] <= self.step]
        self._record(ev.WorkersStarted(step=self.step, world_size=world, setup_s=time.time() - t0))
        if self.step >= self.spec.run.steps:
            return RunState.FINISHED
        self.group.start(self.spec.run.steps)
        return RunState.RUNNING

    def _running(self) -> RunState:
        interval = knob("POLL_INTERVAL_S")
        stop_sent = False
        last_flush = time.time()
        while True:
            if self._stop.is_set() and not stop_sent:
                self.group.broadcast("request_stop")
                stop_sent = True
            result = self.group.poll()
            for rank, st in sorted(result.statuses.items()):
                self._absorb(rank, st)
            failed = [st for st in result.statuses.values() if st.state == "failed"]
            if failed:
                st = min(failed, key=lambda s: s.error_step or 0)
                self._record(ev.WorkerFailed(step=st.error_step, rank=st.rank, node_id=st.node_id,
                                             error=st.error or ""))
                self.error = WorkerError(st.rank, st.node_id, st.error_step or 0, st.error or "")
                self.reason = f"worker rank {st.rank} raised at step {st.error_step}"
                return RunState.FAILED
            if result.dead:
                rank, err = sorted(result.dead.items())[0]
                self._record(ev.WorkerDied(step=self.step + 1, rank=rank,
                                           node_id=self.group.node_of.get(rank, ""), error=err))
                self.reason = f"worker rank {rank} died: {err}"
                return RunState.FAILED
            states = {st.state for st in result.statuses.values()}
            if len(result.statuses) == self.plan.world_size and states <= {"done", "stopped"}:
                self.rundir.flush()
                if states == {"done"} and self.step >= self.spec.run.steps:
                    return RunState.FINISHED
                self._record(ev.RunStopped(step=self.step, reason=self.reason or "stopped"))
                return RunState.STOPPED
            if time.time() - last_flush > 1.0:
                self.rundir.flush()
                last_flush = time.time()
            time.sleep(interval)

    def _absorb(self, rank: int, st) -> None:
        """Fold one rank's step records into per-step metrics once every rank reported."""
        for rec in st.records:
            self._pending.setdefault(rec.step, {})[rank] = rec
        for ck in st.checkpoints:
            if rank == 0 and ck.get("committed"):
                self._last_ckpt = {"step": ck["step"], "uri": ck.get("uri")}
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
            if self._first_step_at is None:
                self._first_step_at = line["time"]
            with self._lock:
                self._metrics.append(line)
            self.rundir.add_line("metrics.jsonl", line)
            self.step = r0.step

    # ----------------------------------------------------------------- teardown
    def _finish(self) -> dict:
        if self.state is RunState.FINISHED:
            self._record(ev.RunFinished(step=self.step))
        elif self.state is RunState.FAILED:
            self._record(ev.RunFailedEvent(step=self.step, reason=self.reason))
        self._teardown()
        result = self.result()
        self.rundir.write_json("result.json", result)
        self.rundir.flush()
        return result

    def _teardown(self) -> None:
        if self.group is not None:
            try:
                self.group.shutdown()
            except Exception:  # noqa: BLE001
                log.warning("worker shutdown failed:\n%s", traceback.format_exc())
        if self.placement is not None:
            try:
                self.placement.remove()
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
        }


def _describe_spec(spec: TrainSpec) -> dict:
    import dataclasses

    out = {}
    for name in ("data", "run", "scaling", "parallel", "checkpoint", "elastic"):
        out[name] = dataclasses.asdict(getattr(spec, name))
    out["model"] = {"name": spec.model.name, "num_blocks": spec.model.num_blocks}
    return out


def _topology_placer(spec, plan):
    from rayflex.platform.placement_policy import place_run

    return place_run(spec, plan)


def _ray_group(spec, plan, strategies):
    from rayflex.platform.worker_group import RayWorkerGroup

    return RayWorkerGroup(spec, plan, strategies)
