"""TrainWorker: one rank of a run. A plain class, made a Ray actor at spawn time.

The training loop runs in a thread so the actor always answers ``poll()`` (step, loss,
phase, error) even while a collective blocks. Every decision that must be the
same on all ranks (stop here, checkpoint now) travels in a tiny all-reduce at the end of
each step, so ranks agree on the step boundary where it happens.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import os
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Optional

import torch

from rayflex.data.dataset import Prefetcher, open_dataset
from rayflex.data.sampler import SAMPLE_ORDER
from rayflex.worker.process_groups import open_process_groups, process_group_layout
from rayflex.worker.rendezvous import RendezvousPort, rendezvous_store
from rayflex.worker.instrument import (ActivationCounter, collective_wait_timer, count_sends,
                                       pipeline_wait_timer, sent_bytes_counter)
from rayflex.mesh.plan import MeshPlan
from rayflex.worker import flight_recorder, sharding_caches
from rayflex.worker.collective_faults import collective_fault_for, committed
from rayflex.worker.slow_tier.tier import SlowTier
from rayflex.worker.status import (RECENT_STEPS, FlightRecord, Leaving, StepRecord, WorkerState, WorkerStatus,
                                   recent_step)
from rayflex.worker.meta_init import build_sharded_stages
from rayflex.worker.float8 import check_device as check_float8_device
from rayflex.worker.health_probe import compute_speed
from rayflex.worker.parallelize import (DTYPES, build_device_mesh, build_schedule, clip_grads_,
                                        data_parallel_mesh, shard_stage, tp_grad_summed_params)
from rayflex.config import TrainSpec
from rayflex.checkpoint.save_timing import DEFERRABLE_REQUESTS, save_timing
from rayflex.constants import fault_log_path, injected_failure_steps, knob, node_ip

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class InjectedFailure:
    """A failure this rank raises on purpose (tests, chaos runs).

    ``or_later``: raise at the first step started at or after ``step``. An injector that
    arms a live run reads the step from the controller, which lags the workers by a poll
    or two; "exactly at step s" would then silently never fire if the rank was already
    past s when the call arrived.
    """

    step: int
    message: str
    or_later: bool = False

    def due(self, step: int) -> bool:
        return step >= self.step if self.or_later else step == self.step


@dataclass(frozen=True)
class StepAgreement:
    """What every rank agreed on at a step boundary (the control all-reduce): the step's
    mean loss, whether to stop, whether to checkpoint (and whether a save may be deferred:
    ``checkpoint.save_timing``), and how long the reduce waited."""

    loss: float
    stop: bool
    checkpoint: bool  # a rank was asked for a checkpoint (rank 0, by the controller or a user)
    must_save: bool  # ... one that is never deferred (not the controller's scheduled "auto")
    busy: bool  # some rank's previous save is still being written
    wait_s: float


def _fail_at_from_env(rank: int) -> Optional[InjectedFailure]:
    """Fault injection (tests): ``RAYFLEX_FAIL_AT="RANK:STEP[,RANK:STEP...]"`` makes that
    rank raise when it starts that step (in every attempt that reaches it)."""
    step = injected_failure_steps().get(rank)
    return InjectedFailure(step, f"injected failure (RAYFLEX_FAIL_AT) at rank {rank} step {step}") \
        if step is not None else None


def _log_injected_failure(rank: int, step: int, message: str) -> None:
    """Append that an injected failure fired to ``RAYFLEX_FAULT_LOG`` (if set): the chaos
    harness's ground truth, independent of whether the controller noticed."""
    path = fault_log_path()
    if not path:
        return
    line = json.dumps({"time": time.time(), "rank": rank, "step": step, "message": message, "pid": os.getpid()})
    try:
        with open(path, "a") as f:  # one short O_APPEND write: lines of several ranks never interleave
            f.write(line + "\n")
    except OSError as e:
        log.warning("could not record the injected failure in %s: %s", path, e)


def _freeze_long_lived() -> None:
    """Move what the process keeps for its whole life (torch, its distributed packages,
    rayflex, Ray) out of the cyclic collector's sight: a full collection of a process
    with torch loaded scans ~10^6 objects (0.2-0.7 s), and the collector runs them on
    its own mid-step. The distributed packages are imported here (every setup imports
    them anyway) so that they are frozen too. Called once the process holds no attempt
    state; frozen objects are still freed by reference counting. No collection first: it
    would find a few dozen import-time cycles for 0.13 CPU-s (measured), paid again by
    every worker process of every restart."""
    import gc

    import torch._dynamo  # noqa: F401 - imported by the first DTensor anyway (DTensor.__new__ is dynamo-disabled)
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401

    gc.freeze()


class TrainWorker:
    def __init__(self, rank: int, spec: TrainSpec, plan: MeshPlan, knobs: Optional[dict] = None):
        from rayflex.constants import adopt_knobs

        adopt_knobs(knobs)
        self._rendezvous: Optional[RendezvousPort] = None  # rank 0: the port node_info offered, held
        # Before the first process group: torch reads the size once per process.
        self._p2p_log = (flight_recorder.P2PLog.install(spec.elastic.flight_recorder)
                         if flight_recorder.enable(spec.elastic.flight_recorder) else None)
        self.spec = spec
        torch.set_num_threads(spec.scaling.torch_threads)
        self.node_id = self._node_id()
        self.device = torch.device("cuda", 0) if spec.scaling.use_gpu else torch.device("cpu")
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self.reconfigure(rank, plan)
        _freeze_long_lived()
        if spec.checkpoint.async_save and (spec.checkpoint.every_steps or spec.checkpoint.resume) \
                and spec.checkpoint.upload == "process":
            from rayflex.checkpoint.upload_process import prewarm_uploader

            prewarm_uploader()  # its imports overlap the rendezvous and build, not the first save


    def reconfigure(self, rank: int, plan: MeshPlan) -> None:
        """Take a (new) rank in a (new) mesh. An elastic restart reuses a surviving process
        this way: its imports and caches stay warm, only the rank's state starts over."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"rank {self.rank}: cannot reconfigure while the training loop runs")
        if getattr(self, "_keeping_for_snapshot", False):  # kept for a snapshot nobody took
            self.shutdown(checkpoint_grace_s=0)
        self._keeping_for_snapshot = False
        self.rank = rank
        self.plan = plan
        coords = plan.mesh_coords(rank)
        self.pp_index, self.dp_index, self.tp_index = coords.pp, coords.dp, coords.tp
        self._records: list[StepRecord] = []
        self._recent: collections.deque = collections.deque(maxlen=RECENT_STEPS)  # saved with checkpoints
        self._checkpoint_events: list[dict] = []
        self._state = WorkerState.IDLE
        self._phase = "idle"
        self._step = 0
        self._error: Optional[str] = None
        self._error_step: Optional[int] = None
        self._stop = threading.Event()
        self._stop_reason = "stop"
        self._checkpoint_request: Optional[str] = None
        self._request_reason: Optional[str] = None  # of the request a save taken now or pending serves
        self._pending_save: Optional[int] = None  # the step a deferred save fell due at
        self._updating: Optional[int] = None  # the step whose optimizer update is being applied
        # The step whose closing agreement this rank entered and has not yet applied: it holds
        # that step's reduced gradients (live recovery may roll it forward).
        self._agreeing: Optional[int] = None
        self._save_at_start: Optional[str] = None  # a save after the first step of the attempt (live recovery)
        # An armed injected failure belongs to this attempt: a reused process forgets it.
        self.fail_at: Optional[InjectedFailure] = _fail_at_from_env(rank)
        self.collective_fault = collective_fault_for(rank)
        self._close_checkpointer()
        self._last_saved_step: Optional[int] = None
        self.activations = ActivationCounter()
        # For the flight record: this attempt's start and when each step began.
        self._attempt_start = time.time()
        self._step_starts: list[tuple[float, int]] = []
        self._group_labels: Optional[flight_recorder.GroupLabels] = None

    # ----------------------------------------------------------------- identity
    @staticmethod
    def _node_id() -> str:
        try:
            import ray

            if ray.is_initialized():
                return ray.get_runtime_context().get_node_id()
        except Exception:  # not inside Ray (unit tests)
            pass
        return "local"

    def node_info(self) -> dict[str, Any]:
        """Where this rank lives; rank 0 also offers the rendezvous address."""
        ip = node_ip()
        if ip is None:
            try:
                import ray

                ip = ray.util.get_node_ip_address()
            except Exception:
                ip = "127.0.0.1"
        if self._rendezvous is not None:  # offered for an attempt that never set up
            self._rendezvous.close()
        # Rank 0's port is held (bound, listening) until this attempt's setup serves the store on it.
        self._rendezvous = RendezvousPort() if self.rank == 0 else None
        port = self._rendezvous.port if self._rendezvous is not None else None
        return {"rank": self.rank, "node_id": self.node_id, "ip": ip, "pid": os.getpid(), "port": port}

    def ping(self) -> int:
        """Liveness while a setup call runs on another actor thread (the controller names
        a rank frozen mid-setup by its silence)."""
        return os.getpid()

    # ----------------------------------------------------------------- setup
    def setup(self, master_addr: str, master_port: int, restore: bool = True,
              live: Optional[dict] = None) -> dict[str, Any]:
        """Join the process group, build and shard this rank's stage(s), restore state.

        ``restored`` in the answer is None or the checkpoint loaded: its ``step``, ``uri``,
        saved ``world_size`` and ``mesh``, ``skipped`` steps, and ``total_steps`` (the
        run.steps it was trained toward; None for a checkpoint older than that record).
        ``live``: restore the survivors' snapshots instead (``checkpoint.live``; the
        controller's live recovery), then save after the first resumed step when saves are on.
        """
        self._set_phase("setup")
        t0 = self._attempt_start = time.time()
        sharding_caches.new_attempt()  # a reused process may hold decisions about its old rank
        if self.spec.precision.float8:  # what the driver could not know: this rank's GPU
            check_float8_device(self.device, tp=self.plan.tp)
        # The world groups (worker/process_groups.py): the default one on the training
        # device's backend, a gloo control group for host scalars where that backend cannot
        # take them (NCCL), and the checkpoint's own gloo group (DCP runs in a background
        # thread, so its collectives must never interleave with training's).
        timeout = timedelta(seconds=knob("COLLECTIVE_TIMEOUT_S"))
        store = functools.partial(rendezvous_store, master_addr, master_port, rank=self.rank,
                                  world_size=self.plan.world_size, timeout=timeout,
                                  held=self._rendezvous)
        self.groups = open_process_groups(process_group_layout(self.device.type), store=store, rank=self.rank,
                                          world_size=self.plan.world_size, timeout=timeout, device=self.device)
        self._gloo = self.groups.sockets
        self.ckpt_group = self.groups.checkpoint
        t_pg = time.time()
        self.mesh = build_device_mesh(self.plan, self.device.type)
        # The planner's pick under CommConfig(replicate="auto"), else the spec's own.
        comm, precision = self.plan.comm_config(self.spec.comm), self.plan.precision_config(self.spec.precision)
        self.dp_mesh = data_parallel_mesh(self.mesh, self.plan, replicas_by_fsdp=not comm.custom)
        self.tp_mesh = self.mesh["tp"] if self.plan.tp > 1 else None
        self._group_labels = self._label_groups()
        count_sends()  # before any audit wraps the collectives for a while (it puts back what it found)
        pipelined = self.plan.pp > 1
        if self._p2p_log is not None:
            self._p2p_log.reset()
            if pipelined:
                self._p2p_log.attach()

        def shard(s: int, module):
            return shard_stage(module, self.dp_mesh, pipelined=pipelined, precision=precision,
                               memory=self.plan.memory_config(self.spec.memory), last=s == self.plan.num_stages - 1,
                               tp_mesh=self.tp_mesh,
                               spec=self.spec.model)

        # Built on the meta device, sharded, then filled block by block: a rank never holds
        # more than its shards and one full block (weights identical to a plain build).
        self.stages = build_sharded_stages(self.spec.model, self.plan, self.rank, self.device, shard=shard)
        self.params = [p for _, m in self.stages for p in m.parameters()]
        # Whole on every tp rank but fed only that rank's heads (tp_plan's
        # replicated_with_grad_allreduce): their gradients are summed over tp each step.
        self._tp_summed = ([p for _, m in self.stages for p in tp_grad_summed_params(m, self.spec.model)]
                           if self.tp_mesh is not None else [])
        opt = self.spec.run.optimizer
        # One optimizer per stage module: checkpoint keys then stay per-FQN whatever the split.
        # No LR scheduler object: each step sets its learning rate from (step, run.steps)
        # (_train_step), so a restore cannot bring back a stale one.
        self.optimizers = [opt.build(m.parameters()) for _, m in self.stages]
        self.slow_tier = SlowTier(comm, self.plan, self.mesh, self.stages, reduce_dtype=DTYPES[precision.reduce_dtype])
        self.schedule = (build_schedule(self.plan, self.stages, self.mesh["pp"].get_group(), self.device,
                                        self.spec.model.loss_fn) if pipelined else None)
        data = self.spec.data
        if getattr(self, "_dataset_of", None) != (data.uri, data.sources):
            # Kept by a reused process: its footers and cached row groups stay warm. The
            # cache holds a shuffle window (a block spans <= 2 row groups) and the prefetch.
            self.dataset = open_dataset(data)
            self._dataset_of = (data.uri, data.sources)
        need = data.seq_len + 1
        if self.dataset.row_len < need:
            raise ValueError(f"dataset rows have {self.dataset.row_len} tokens but DataConfig.seq_len="
                             f"{data.seq_len} needs {need}; lower seq_len or rewrite the data")
        self.sampler = self.dataset.sampler(data)
        if getattr(self, "_prefetcher", None) is not None:
            self._prefetcher.close()  # a setup retried without a teardown in between
        self._prefetcher = (Prefetcher(self.dataset, self.sampler, self.dp_index, self.plan.dp, data.prefetch_steps)
                            if data.prefetch_steps else None)
        self._has_first = 0 in [s for s, _ in self.stages]
        self._has_last = (self.plan.num_stages - 1) in [s for s, _ in self.stages]
        # Every gloo group of the attempt exists now (on CPU the mesh's subgroups are gloo
        # too): publish their listeners so an abort finds all of their connections.
        self.groups.register_sockets(self.rank, self.plan.world_size)
        restored = None
        t_build = time.time()
        if self.spec.checkpoint.every_steps or self.spec.checkpoint.resume:
            from rayflex.checkpoint.checkpointer import AsyncCheckpointer

            self._close_checkpointer()
            replicas = None
            if self.spec.checkpoint.memory_replicas and self.node_id != "local":
                from rayflex.checkpoint.replicas.client import ReplicaClient

                replicas = ReplicaClient(self.spec.run.name, self.node_id)
            self.checkpointer = AsyncCheckpointer(self.spec.checkpoint_uri, rank=self.rank,
                                                  group=self.ckpt_group, use_async=self.spec.checkpoint.async_save,
                                                  keep=self.spec.checkpoint.keep, mesh=self.plan,
                                                  upload=self.spec.checkpoint.upload,
                                                  upload_threads=self.spec.checkpoint.upload_threads,
                                                  replicas=replicas)
            if restore and self.spec.checkpoint.resume and live is None:
                restored = self.checkpointer.load_latest(self._stateful())
        if live is not None:
            restored = self._load_live_or_checkpoint(live, restore)
            if "live_failed" in restored:
                live = None  # fell back to the checkpoint: from here on as a restore from storage
        if live is not None:
            self._step = restored["step"]
            if self.rank == 0 and self.checkpointer is not None:
                # As a restore from storage does: saves the failed attempt left unfinished go,
                # so this attempt writes its steps into empty directories.
                from rayflex.checkpoint import manifest as mf

                mf.clear_after(self.checkpointer.store, -1)
            if self.checkpointer is not None and self.spec.checkpoint.every_steps and live.get("save", True):
                # Committed in the background as soon as possible: a second failure then
                # loses no more than a failure did before this one.
                self._save_at_start = "live_recovery"
        elif restored is not None:
            self._step = self._last_saved_step = restored["step"]
        if restored is not None:
            self.slow_tier.after_restore(restored)
        self._set_phase("idle")
        t_end = time.time()
        # The speed a newcomer node's health check is judged against (faults.health).
        speed = compute_speed(str(self.device)) if self.spec.elastic.health_checks else None
        return {"rank": self.rank, "setup_s": t_end - t0, "step": self._step, "restored": restored,
                "rendezvous_s": t_pg - t0, "build_s": t_build - t_pg, "restore_s": t_end - t_build,
                "probe_gflops": speed}

    def _load_live_or_checkpoint(self, live: dict, restore: bool) -> Optional[dict]:
        """The survivors' state (``live``), or — when their snapshots turn out not to hold
        every shard (``LiveStateIncomplete``, raised before anything is loaded) — the
        newest checkpoint, as a restart without live recovery would: a run that could not
        recover from memory loses the steps since its last commit, not the run. Every rank
        merges the same snapshots' metadata, so every rank takes the same branch."""
        from rayflex.checkpoint.live import LiveStateIncomplete, load_live

        try:
            return load_live(self._stateful(), live, group=self.ckpt_group, node_id=self.node_id)
        except LiveStateIncomplete as e:
            if self.checkpointer is None or not (restore and self.spec.checkpoint.resume):
                raise
            log.warning("rank %d: the survivors' state is incomplete (%s); loading the last checkpoint", self.rank, e)
            restored = self.checkpointer.load_latest(self._stateful())
            if restored is None:
                raise
            return {**restored, "live_failed": str(e)}

    def _label_groups(self) -> flight_recorder.GroupLabels:
        """Name this attempt's process groups by their role (the mesh's first: a mesh
        dimension spanning the world may be the world group itself)."""
        import torch.distributed as dist

        labels = flight_recorder.GroupLabels()
        labels.add_mesh(self.mesh, self.plan)
        labels.add(dist.group.WORLD, "world")
        labels.add(self.groups.control, "control")
        labels.add(self.groups.checkpoint, "checkpoint")
        return labels

    def _by_role(self, by_group: dict[str, int]) -> dict[str, int]:
        """Bytes by process-group name -> by the group's role (``dp_shard``, ``dp_replicate``, ...)."""
        out: dict[str, int] = {}
        for name, n in by_group.items():
            role = self._group_labels.of(name)[0] if self._group_labels else name
            out[role] = out.get(role, 0) + n
        return out

    def _role_of(self, group) -> str:
        import torch.distributed as dist

        group = group if group is not None else dist.group.WORLD
        return self._group_labels.of(group.group_name)[0] if self._group_labels else "world"

    def _lr_of_step(self, step: int) -> float:
        return self.spec.run.optimizer.lr_of_step(step, self.spec.run.steps)

    def _stateful(self):
        from rayflex.checkpoint.checkpointer import TrainState

        replica, replicas = self.slow_tier.own_state(self.plan, self.rank)
        return TrainState(modules=[m for _, m in self.stages], optimizers=self.optimizers,
                          get_step=lambda: self._step, total_steps=self.spec.run.steps,
                          sample_order=SAMPLE_ORDER, recent_steps=lambda: list(self._recent),
                          config={"run": self.spec.run.name, "world_size": self.plan.world_size,
                                  "pp": self.plan.pp, "dp": self.plan.dp, "tp": self.plan.tp,
                                  "dp_replicate": self.plan.dp_replicate},
                          outer=self.slow_tier.checkpoint_state(), replica=replica, replicas=replicas,
                          own=self.slow_tier.rank_own(self.plan, self.rank))

    # ----------------------------------------------------------------- loop
    def start(self, end_step: int) -> int:
        """Run steps ``self._step + 1 .. end_step`` in a background thread."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError(f"rank {self.rank}: training loop already running")
        self._stop.clear()
        self._state = WorkerState.RUNNING
        self._thread = threading.Thread(target=self._loop, args=(end_step,), name=f"rayflex-rank{self.rank}",
                                        daemon=True)
        self._thread.start()
        return self._step

    def _set_phase(self, phase: str) -> None:
        self._phase = phase

    def _loop(self, end_step: int) -> None:
        sharding_caches.in_this_thread()
        try:
            stop_agreed = False
            self._probe_until = self._step + 2  # activation memory: the attempt's first steps, then sampled
            while self._step < end_step and not stop_agreed:
                step = self._step + 1
                if self.fail_at is not None and self.fail_at.due(step):
                    failure = self.fail_at
                    if failure.or_later:
                        self.fail_at = None  # once
                    _log_injected_failure(self.rank, step, failure.message)
                    raise RuntimeError(failure.message)
                t0 = time.perf_counter()
                self._note_step_start(step)
                with sent_bytes_counter() as sent:
                    with committed(self.collective_fault, step, self._role_of,
                                   on_fire=lambda message: _log_injected_failure(self.rank, step, message),
                                   stopped=self._stop.is_set):
                        with collective_wait_timer() as comm:
                            loss_sum, grad_norm, probe = self._train_step(step)
                        self._set_phase("collective")
                        # The step's last collective comes before its update: a rank that fails
                        # in a collective of step s has not applied s, and a survivor's state is
                        # always that of a finished step (live recovery reads it) — or, failing
                        # inside this agreement, that step's gradients ready to apply.
                        self._agreeing = step
                        agreed = self._agree(loss_sum)
                    # How long this rank waited for its peers in the step: inside its collectives
                    # (a slow rank holds the others up there) and at the closing agreement.
                    probe["sync_wait_s"] = comm["wait_s"] + agreed.wait_s
                    loss = agreed.loss
                    stop_agreed = agreed.stop
                    self._updating, self._agreeing = step, None
                    self._apply_update(step)
                probe["sent_bytes"] = self._by_role(sent)
                dt = time.perf_counter() - t0
                record = StepRecord(step=step, loss=loss, step_time_s=dt, lr=self._lr_of_step(step),
                                    grad_norm=grad_norm, time=time.time(), samples=self.spec.data.global_batch,
                                    pp_index=self.pp_index, dp_index=self.dp_index, tp_index=self.tp_index, **probe,
                                    **self.slow_tier.step_metrics())
                with self._lock:
                    self._step = step
                    self._records.append(record)
                self._updating = None
                self._recent.append(recent_step(record, self.plan.world_size))
                if self.checkpointer is not None:
                    self._note_checkpoint(self.checkpointer.completed())
                if self._save_at_start is not None and step < end_step:
                    # After the first resumed step, not before it: that step trains without an
                    # upload beside it, and the commit a second failure falls back to is this step.
                    reason, self._save_at_start = self._save_at_start, None
                    self._save(step, reason)
                    continue
                self._maybe_save(step, end_step, agreed)
            self.slow_tier.settle()  # DiLoCo: no reduction left in flight behind the loop
            if self.checkpointer is not None:
                # The end of a run and a graceful stop both leave a checkpoint of the last
                # step, so a resubmitted run loses nothing; a 0-step run exists to save its
                # initial weights.
                # A stop the controller asked for to restart (a spot notice, a straggler's
                # eviction) saves even with periodic checkpoints off: the restart resumes there.
                emergency = self._stop_reason in ("preemption", "straggler")
                if (self.spec.checkpoint.every_steps or emergency or end_step == 0) \
                        and self._last_saved_step != self._step:
                    self._save(self._step, "final" if self._step >= end_step else
                               "emergency" if emergency else "stop")
                self._set_phase("checkpoint")
                self._note_checkpoint(self.checkpointer.wait())
            self._state = WorkerState.DONE if self._step >= end_step else WorkerState.STOPPED
            self._set_phase("done")
        except BaseException:  # noqa: BLE001 - every failure must reach the controller
            self._error = traceback.format_exc()
            self._error_step = self._step + 1
            self._state = WorkerState.FAILED
            log.error("rank %d failed at step %d:\n%s", self.rank, self._error_step, self._error)

    def _note_step_start(self, step: int) -> None:
        self._step_starts.append((time.time(), step))
        if len(self._step_starts) > 512:  # the recorder's ring holds far fewer steps than this
            del self._step_starts[:256]

    def _train_step(self, step: int) -> tuple[float, float, dict]:
        self._set_phase("data")
        indices = self.sampler.indices(step - 1, self.dp_index, self.plan.dp)
        t_data = time.perf_counter()
        rows = self.dataset.rows(indices)
        data_wait_s = time.perf_counter() - t_data
        if self._prefetcher is not None:
            # After this step's read, not before: the prefetch thread then reads while the
            # step computes, instead of contending for the GIL with the read above.
            self._prefetcher.ahead_of(step - 1)
        seq = self.spec.data.seq_len
        x, y = rows[:, :seq].to(self.device), rows[:, 1:seq + 1].to(self.device)
        self._set_phase("forward_backward")
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)
        loss_fn = self.spec.model.loss_fn
        self.activations.reset_peak()
        probe_every = int(knob("ACTIVATION_PROBE_EVERY"))
        measure = step <= getattr(self, "_probe_until", step) or (probe_every > 0 and step % probe_every == 0)
        t_fb = time.perf_counter()
        with (self.activations.track() if measure else contextlib.nullcontext()), \
                pipeline_wait_timer(self.schedule is not None) as waits:
            loss_contrib = self._forward_backward(x, y, loss_fn)
        if self._tp_summed:
            from rayflex.models.tp_plan import sum_replicated_grads

            sum_replicated_grads(self._tp_summed, self.tp_mesh.get_group())
        probe = {"activation_peak_bytes": self.activations.peak, "pipeline_wait_s": waits["wait_s"],
                 "data_wait_s": data_wait_s,
                 "forward_backward_s": time.perf_counter() - t_fb,
                 "sample_indices": indices.tolist() if self.spec.data.log_samples else None}
        self._set_phase("optimizer")
        grad_norm = self._clip_grads()
        return loss_contrib, grad_norm, probe

    def _apply_update(self, step: int) -> None:
        """The optimizer step: local work only (no collective), once the step's agreement
        is done. The learning rate is set, not stepped: a LambdaLR restored from a
        checkpoint left the optimizer at the saved run's last LR for one step (its lambda,
        and so the current run.steps, took effect only at the next scheduler step)."""
        self._set_phase("optimizer")
        lr = self._lr_of_step(step)
        for o in self.optimizers:
            for group in o.param_groups:
                group["lr"] = lr
            o.step()
        self.slow_tier.after_update(step)  # DiLoCo's outer step, when one is due

    def _clip_grads(self) -> float:
        """The global grad norm (clipping to ``grad_clip`` if set). The norm is a host
        scalar reduced over the world, so it goes to the host group: on GPU the gloo
        control group (NCCL would refuse it), on CPU the default group."""
        from rayflex.worker.parallelize import global_grad_norm

        clip = self.spec.run.optimizer.grad_clip
        stage_ranks = self.plan.dp * self.plan.tp  # the ranks holding one stage (tp copies counted once)
        if clip is not None:
            return clip_grads_(self.params, clip, self.groups.host, stage_ranks)
        return float(global_grad_norm(self.params, self.groups.host, stage_ranks))

    def _agree(self, loss_sum: float) -> "StepAgreement":
        """One tiny all-reduce carries the loss and the control flags, so every rank agrees
        at this step boundary on stopping and on checkpointing. Host scalars: it runs on
        the host group (see ``_clip_grads``)."""
        import torch.distributed as dist

        request = self._checkpoint_request
        must = request is not None and request not in DEFERRABLE_REQUESTS
        busy = self.checkpointer is not None and self.checkpointer.busy()
        # The tp ranks of a dp rank computed the same loss: one of them reports it.
        loss_share = loss_sum if self.tp_index == 0 else 0.0
        # Three doubles, as ever (the hang diagnosis names this reduce by its shape): two
        # counts share a slot, the second weighted past the most the first can sum to.
        w = float(dist.get_world_size(self.groups.host) + 1)
        control = torch.tensor([loss_share, float(self._stop.is_set()) + w * busy,
                                float(request is not None) + w * must], dtype=torch.float64)
        t_sync = time.perf_counter()
        dist.all_reduce(control, group=self.groups.host)
        stop_busy, asked_must = float(control[1]), float(control[2])
        return StepAgreement(loss=float(control[0]) / self.plan.dp, stop=stop_busy % w > 0, busy=stop_busy >= w,
                             checkpoint=asked_must % w > 0, must_save=asked_must >= w,
                             wait_s=time.perf_counter() - t_sync)

    def _forward_backward(self, x: torch.Tensor, y: torch.Tensor, loss_fn) -> float:
        """Forward and backward of this rank's share of the step; returns its loss share."""
        if self.schedule is None:
            (_, model), = self.stages
            accum = self.plan.accum_steps
            losses = []
            for i, (xc, yc) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
                model.set_requires_gradient_sync(i == accum - 1)
                loss = loss_fn(model(xc), yc)
                (loss / accum).backward()
                losses.append(loss.detach())
            # One device-to-host copy per step, not a sync per microbatch; the same sum.
            total = 0.0
            for value in torch.stack(losses).tolist():
                total += value / accum
            loss_contrib = total
        else:
            losses: list[torch.Tensor] = []
            kwargs: dict[str, Any] = {}
            if self._has_last:
                kwargs = {"target": y, "losses": losses}
            args = (x,) if self._has_first else ()
            # return_outputs=False: the last stage would otherwise keep every microbatch's
            # logits alive until the next step.
            self.schedule.step(*args, return_outputs=False, **kwargs)
            # Only last-stage ranks hold a loss; the control all-reduce divides by dp.
            loss_contrib = float(torch.stack(losses).detach().mean()) if self._has_last else 0.0
        return loss_contrib

    # ----------------------------------------------------------------- checkpoints
    def _maybe_save(self, step: int, end_step: int, agreed: "StepAgreement") -> None:
        """Save at this boundary if one is due and the previous upload allows it
        (``CheckpointConfig.when_busy``): every rank decides from the agreed flags."""
        every = self.spec.checkpoint.periodic_steps
        periodic = bool(every) and step % every == 0 and step < end_step
        timing = save_timing(due=periodic or agreed.checkpoint, required=agreed.must_save, busy=agreed.busy,
                             pending=self._pending_save is not None, when_busy=self.spec.checkpoint.when_busy)
        if agreed.checkpoint:  # the request is in this decision (taken now, or pending)
            self._request_reason = self._checkpoint_request or self._request_reason
            self._checkpoint_request = None
        if timing.deferred_now:
            self._pending_save = step
            if self.rank == 0:
                self._note_checkpoint({"deferred": True, "step": step, "behind_step": self._last_saved_step,
                                       "reason": self._request_reason or "periodic"})
        if timing.save:
            due_step, self._pending_save = self._pending_save, None
            reason, self._request_reason = self._request_reason or "periodic", None
            self._save(step, reason, due_step=due_step)

    def _save(self, step: int, reason: str, due_step: Optional[int] = None) -> None:
        if self.checkpointer is None:
            return
        self._last_saved_step = step
        if step == self.spec.run.steps:
            self.slow_tier.finish(step)  # DiLoCo: the run's last checkpoint is one synchronised model
        self._set_phase("checkpoint")
        info = self.checkpointer.save(self._stateful(), step=step, reason=reason, due_step=due_step)
        self._note_checkpoint(info)

    def _note_checkpoint(self, info) -> None:
        if not info:
            return
        with self._lock:
            self._checkpoint_events.extend(info if isinstance(info, list) else [info])

    def request_checkpoint(self, reason: str = "on_demand") -> None:
        """Ask for a checkpoint at the next step boundary (all ranks agree through the
        control all-reduce, so asking one rank is enough)."""
        self._checkpoint_request = reason

    # ----------------------------------------------------------------- control
    def poll(self) -> WorkerStatus:
        """Progress since the last poll. Cheap; never blocks on training."""
        with self._lock:
            records, self._records = self._records, []
            ckpts, self._checkpoint_events = self._checkpoint_events, []
            return WorkerStatus(rank=self.rank, node_id=self.node_id, state=self._state, step=self._step,
                                phase=self._phase, records=records, error=self._error,
                                error_step=self._error_step, checkpoints=ckpts)

    def flight_record(self) -> FlightRecord:
        """This attempt's recent collectives (torch's flight recorder), for a hang
        investigation. Answers while the training loop is blocked in a collective."""
        return flight_recorder.read_flight_record(self.rank, self._step, self._phase, self._group_labels,
                                                  self._attempt_start, list(self._step_starts), self._p2p_log)

    def request_stop(self, reason: str = "stop", leaving_nodes: Optional[list[str]] = None) -> None:
        """Stop at the next step boundary (agreed by every rank), leaving a checkpoint there
        (``reason="preemption"`` or ``"straggler"``: even if periodic checkpoints are off; ``leaving_nodes``:
        the nodes the notices named, whose ranks hand their uploads to memory replicas
        elsewhere)."""
        replicas = getattr(getattr(self, "checkpointer", None), "replicas", None)
        if leaving_nodes and replicas is not None:
            replicas.leaving(leaving_nodes)
        self._stop_reason = reason
        self._stop.set()

    def set_fail_at(self, step: int, message: str = "injected failure") -> int:
        """Test hook: raise ``message`` once, at the first step this attempt starts at or
        after ``step``. Returns the last step this rank finished."""
        self.fail_at = InjectedFailure(step, message, or_later=True)
        return self._step

    def join(self, timeout_s: float) -> bool:
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    def release(self, timeout_s: float = 10.0, checkpoint_grace_s: float = 3.0, abort: bool = False,
                snapshot: bool = False) -> Leaving:
        """Leave the current attempt so this process can be reused by the next one.

        The loop is asked to stop. ``abort`` (a peer died or raised: the attempt is broken):
        once an in-flight save had ``checkpoint_grace_s`` to commit (0 when a peer died: it
        cannot), this rank's process-group connections are shut down, so a collective
        blocked here or in a peer waiting on this rank fails now instead of at the
        collective timeout (see ``gloo_abort``). Then the groups and every object holding
        them are freed. Returns ``Leaving.STUCK`` if the loop is still blocked after
        ``timeout_s``, ``Leaving.UPLOADING`` if a checkpoint upload still runs after the grace
        (a reused process must never write into a later attempt's checkpoints): the
        controller then kills this process. Else ``Leaving.LEFT``; with ``snapshot``, keeping
        the attempt's state until ``take_live`` has written it into memory (its time is not
        this call's: a large state takes seconds, a release only waits for the loop)."""
        self._stop.set()
        grace = min(checkpoint_grace_s, timeout_s / 2)
        if abort:
            if self.checkpointer is not None and grace > 0:
                self.checkpointer.settle(grace)  # the loop thread may be blocked: do not race it
            self._abort_collectives()
            if self.checkpointer is not None:
                self.checkpointer.abandon()  # it cannot commit now: let it stop before its next file
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                log.warning("rank %d: training loop still blocked in phase %r after %.0fs", self.rank,
                            self._phase, timeout_s)
                return Leaving.STUCK
        # An upload whose peers are gone (aborted above) fails within moments: give it one
        # second even with no grace, so only a truly stuck upload costs a process.
        self._wait_for_save(max(grace, 1.0))
        # Kept for ``take_live`` even when the process is not reusable (an upload still runs):
        # its state is a finished step's all the same.
        self._keeping_for_snapshot = snapshot
        if self.checkpointer is not None and self.checkpointer.busy():
            # Its upload thread would go on writing after this process joined the next
            # attempt: into a step directory that attempt writes too (or committing a step
            # of a timeline that was rolled back). Only a dead process cannot do that.
            log.warning("rank %d: a checkpoint upload is still running after %.1fs; this process is not "
                        "reused (it is killed, so the upload can never land later)", self.rank, grace)
            return Leaving.UPLOADING
        if not snapshot:
            self.shutdown(checkpoint_grace_s=0)
        self._state = WorkerState.RELEASED
        return Leaving.LEFT

    def _snapshot(self) -> tuple[dict, dict]:
        """(info, files) of this rank's state at its last finished step, or (info with
        ``error``, {}) saying why there is none."""
        base = {"rank": self.rank, "node_id": self.node_id, "step": self._step}
        if self._updating is not None:
            return {**base, "error": f"its update of step {self._updating} was being applied"}, {}
        if getattr(self, "stages", None) is None:
            return {**base, "error": "it holds no training state"}, {}
        from rayflex.checkpoint.live import take_snapshot

        sharding_caches.in_this_thread()  # an actor call thread may have served an earlier attempt
        try:
            info, files = take_snapshot(self._stateful(), rank=self.rank, step=self._step, node_id=self.node_id,
                                        misplaced=sharding_caches.stale_shards)
            if self.spec.data.log_samples:
                # Every dp rank's rows of the recent steps: a dead rank's share of a step it
                # finished but never reported is still written to samples.jsonl.
                first = max(1, self._step - RECENT_STEPS + 1)
                info["sample_rows"] = {s: self.sampler.indices(s - 1, 0, 1).tolist() for s in range(first, self._step + 1)}
            return info, files
        except Exception as e:  # noqa: BLE001 - no live copy from this rank: said, not raised
            log.warning("rank %d: no live snapshot: %s", self.rank, e, exc_info=True)
            return {**base, "error": f"snapshot failed: {type(e).__name__}: {e}"}, {}

    def held_step(self) -> dict:
        """After ``release(snapshot=True)``: the last finished step, the step whose closing
        agreement this rank was left inside (``pending``: its gradients reduced, its update
        not applied), and the agreed record of its last finished step — what live
        recovery's roll-forward decides on (``faults.live_recovery.roll_forward``)."""
        kept = self._keeping_for_snapshot
        return {"rank": self.rank, "step": self._step, "pending": self._agreeing if kept else None,
                "recent": dict(self._recent[-1]) if kept and self._recent else None}

    def take_live(self, roll_forward: Optional[dict] = None) -> tuple[dict, dict]:
        """After ``release(snapshot=True)``: the state of the last finished step written
        into memory, (info, files), then the attempt's state dropped. ``roll_forward``: the
        agreed record of the step this rank was left inside the agreement of, which a peer
        finished: its update is applied first (``_roll_forward``). The caller owns the
        result (Ray keeps a returned value for whoever called), so it outlives this process."""
        if not self._keeping_for_snapshot:
            return {"rank": self.rank, "node_id": self.node_id, "step": self._step,
                    "error": "it did not keep its state when it left"}, {}
        try:
            if roll_forward is not None:
                try:
                    self._roll_forward(roll_forward)
                except Exception as e:  # noqa: BLE001 - no live copy from this rank: said, not raised
                    log.warning("rank %d: could not roll forward: %s", self.rank, e, exc_info=True)
                    return {"rank": self.rank, "node_id": self.node_id, "step": self._step,
                            "error": f"could not apply step {roll_forward.get('step')}: {type(e).__name__}: {e}"}, {}
                info, files = self._snapshot()
                return {**info, "rolled_forward": self._step}, files
            return self._snapshot()
        finally:
            self.drop_live()  # written into memory (or failed): the attempt's state goes

    def drop_live(self) -> None:
        """After ``release(snapshot=True)``: another survivor's snapshot holds this rank's
        shards, so the state it kept for one is dropped."""
        self._keeping_for_snapshot = False
        if self._state == WorkerState.RELEASED:  # else still uploading: the controller kills it
            self.shutdown(checkpoint_grace_s=0)

    def _roll_forward(self, agreed: dict) -> None:
        """Apply the update of step ``agreed["step"]``, whose closing agreement this rank was
        left inside. A peer finished that agreement, so every rank had entered it, each with
        the step's gradient collectives (and clipping) done: the gradients this rank holds
        are the step's, and its update is local work — the same bytes the peer's update gave.
        The step's agreed record (loss, LR, grad norm) is the peer's."""
        step = int(agreed["step"])
        if self._agreeing != step or self._step != step - 1:
            raise RuntimeError(f"it holds step {self._step} (inside the agreement of {self._agreeing}), "
                               f"not step {step}'s gradients")
        sharding_caches.in_this_thread()  # an actor call thread may have served an earlier attempt
        self._updating, self._agreeing = step, None
        self._apply_update(step)
        with self._lock:
            self._step = step
        self._updating = None
        self._recent.append(dict(agreed))

    def _wait_for_save(self, timeout_s: float) -> None:
        if self.checkpointer is not None and timeout_s > 0:
            try:
                self.checkpointer.wait(timeout_s=timeout_s)
            except Exception:  # noqa: BLE001 - a peer died mid-upload: it never commits
                pass

    def _abort_collectives(self) -> None:
        import torch.distributed as dist

        if self.device.type == "cuda" and dist.is_initialized():
            try:
                dist.distributed_c10d._abort_process_group()  # nccl: ncclCommAbort
            except Exception:  # noqa: BLE001 - best effort, the sockets below still go
                log.warning("rank %d: nccl abort failed", self.rank, exc_info=True)
        gloo = getattr(self, "_gloo", None)
        if gloo is not None:
            n = gloo.abort()
            log.info("rank %d: shut down %d process-group connections", self.rank, n)

    def _close_checkpointer(self) -> None:
        checkpointer, self.checkpointer = getattr(self, "checkpointer", None), None
        if checkpointer is not None:
            checkpointer.close()

    def _drop_training_state(self) -> None:
        """Forget the model, optimizer, schedule and meshes of this attempt, and collect them:
        FSDP and DTensor hold the process groups, whose sockets close only when freed."""
        import gc

        for name in ("stages", "params", "_tp_summed", "optimizers", "slow_tier", "schedule", "mesh", "dp_mesh",
                     "tp_mesh", "_gloo", "groups", "ckpt_group"):
            self.__dict__.pop(name, None)
        self._close_checkpointer()
        self._thread = None
        prefetcher, self._prefetcher = getattr(self, "_prefetcher", None), None
        if prefetcher is not None:
            prefetcher.close()
        sharding_caches.new_attempt()
        gc.collect()  # the attempt's cycles (FSDP hooks, DTensor specs) hold sockets open
        _freeze_long_lived()  # what survived is the process's own (caches filled this attempt)

    def shutdown(self, checkpoint_grace_s: float = 4.0) -> None:
        """Give an in-flight checkpoint a moment to commit, then leave the process group."""
        import torch.distributed as dist

        self._wait_for_save(checkpoint_grace_s)
        self._drop_training_state()
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # best effort; the process is about to go away
                pass
