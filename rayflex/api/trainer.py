"""Public entry points: ``Trainer.fit()`` (blocking) and ``Trainer.submit()`` (a handle).

Everything is validated on the driver before Ray is touched; then the driver connects to
Ray (or starts a local one: the embedded default) and creates the run's Controller actor,
named after the run so other processes (``rayflex status``) can find it. The actor is not
detached: it fate-shares with the driver, so a killed driver takes its run down cleanly.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import Optional

from rayflex.config import (CheckpointConfig, CommConfig, DataConfig, ElasticConfig, MemoryConfig, ParallelConfig,
                            PrecisionConfig, RunConfig, ScalingConfig, TrainSpec)
from rayflex.local_ray import ensure_ray
from rayflex.errors import (CheckpointError, PlacementError, RayflexError, RunFailed, StorageError,
                            WorkerError)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Result:
    """What a finished run reports; ``metrics`` holds one dict per step."""

    status: str
    steps_completed: int
    first_loss: Optional[float]
    final_loss: Optional[float]
    tokens_per_s: Optional[float]
    time_to_first_step_s: Optional[float]
    run_dir: str
    metrics: list
    raw: dict

    @classmethod
    def from_dict(cls, d: dict, metrics: list) -> "Result":
        return cls(status=d["status"], steps_completed=d["steps_completed"], first_loss=d.get("first_loss"),
                   final_loss=d.get("final_loss"), tokens_per_s=d.get("tokens_per_s"),
                   time_to_first_step_s=d.get("time_to_first_step_s"), run_dir=d["run_dir"],
                   metrics=metrics, raw=d)


class RunHandle:
    """A run in progress: poll it from a notebook, stop it, wait for its result."""

    def __init__(self, name: str, controller, result_ref):
        self.name = name
        self.controller = controller
        self._ref = result_ref
        self._result: Optional[dict] = None

    def status(self) -> dict:
        import ray

        if self._result is not None:
            return {**self._result, "state": self._result["status"].upper(), "step": self._result["steps_completed"]}
        try:
            return ray.get(self.controller.status.remote(), timeout=30)
        except Exception:  # noqa: BLE001 - the controller may have just exited
            self._collect(timeout=5)
            if self._result is None:
                raise
            return self.status()

    def metrics(self, since_step: int = 0) -> list[dict]:
        import ray

        if self._result is not None:
            return [m for m in self._metrics_final if m["step"] > since_step]
        return ray.get(self.controller.metrics.remote(since_step), timeout=30)

    def events(self) -> list[dict]:
        import ray

        return ray.get(self.controller.events.remote(), timeout=30)

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self._ref], timeout=0)
        return bool(ready)

    def stop(self, wait: bool = True, timeout_s: float = 120) -> Optional[Result]:
        """Stop at the next step boundary (every rank agrees on it); keeps checkpoints."""
        if self._result is None:
            self.controller.request_stop.remote("stopped by user")
        return self.wait(timeout_s, raise_on_failure=False) if wait else None

    def _release(self) -> None:
        """The run is over and its result fetched: free the name for a resubmission."""
        from rayflex.group.actors import kill_quietly

        kill_quietly(self.controller)

    def _collect(self, timeout: Optional[float]) -> None:
        import ray

        if self._result is None:
            result = ray.get(self._ref, timeout=timeout)
            self._metrics_final = ray.get(self.controller.metrics.remote(0), timeout=timeout)
            self._result = result
            self._release()

    def wait(self, timeout_s: Optional[float] = None, *, raise_on_failure: bool = True,
             progress: bool = False) -> Result:
        """Block until the run ends; raise the worker's error if it failed."""
        import ray

        if self._result is None:
            if progress:
                _show_progress(self)
            ready, _ = ray.wait([self._ref], timeout=timeout_s)
            if not ready:
                raise TimeoutError(f"run {self.name!r} still running after {timeout_s}s")
            self._collect(timeout=60)
        res = Result.from_dict(self._result, self._metrics_final)
        if raise_on_failure and res.status == "failed":
            d = self._result
            if d.get("error_type") == "WorkerError":
                raise WorkerError(d.get("error_rank", -1), d.get("error_node") or "", d.get("error_step") or
                                  d["steps_completed"] + 1, d.get("error") or "")
            typed = {"PlacementError": PlacementError, "StorageError": StorageError,
                     "CheckpointError": CheckpointError}.get(d.get("error_type") or "")
            if typed is not None:  # keep the type the controller raised
                raise typed(f"run {self.name!r} failed: {d.get('error')}")
            raise RunFailed(self.name, d.get("reason") or d.get("error") or "unknown")
        return res


def _show_progress(handle: RunHandle, interval_s: float = 0.5) -> None:
    """A progress bar (tqdm.auto: a widget in notebooks, a line in terminals and job logs).

    Created once the run is RUNNING, starting at the step it resumed from, so a resumed
    run neither shows 0/N while placing nor a burst of steps/s when it jumps. A run that
    ended before a poll saw it running (a short run, a busy machine) still ends with its bar."""
    from tqdm.auto import tqdm

    def new_bar(st: dict):
        return tqdm(total=st["target_steps"], initial=st["step"], desc=handle.name, unit="step", file=sys.stderr,
                    mininterval=0.5 if sys.stderr.isatty() else 5.0)

    bar, last = None, 0
    while not handle.done():
        try:
            st = handle.status()
        except Exception:  # noqa: BLE001 - the controller just exited
            break
        if bar is None and st["state"] == "RUNNING":
            last = st["step"]
            bar = new_bar(st)
        if bar is not None:
            bar.update(max(0, st["step"] - last))
            last = max(last, st["step"])
            loss, tps = st.get("loss"), st.get("tokens_per_s")
            bar.set_postfix_str(f"loss={loss:.4f} tok/s={tps:,.0f} world={st.get('world_size')} state={st['state']}"
                                if loss is not None and tps else f"state={st['state']}", refresh=False)
        time.sleep(interval_s)
    try:
        st = handle.status()
    except Exception:  # noqa: BLE001 - nothing more to show
        st = None
    if bar is None and st is not None and st.get("target_steps"):
        bar = new_bar(st)
    elif bar is not None and st is not None:
        bar.update(max(0, st["step"] - last))
    if bar is not None:
        bar.close()


class Trainer:
    """Configure once, then ``fit()`` / ``submit()`` / ``plan()``."""

    def __init__(self, *, model, data: DataConfig, run: RunConfig, scaling: ScalingConfig | None = None,
                 parallel: ParallelConfig | None = None, checkpoint: CheckpointConfig | None = None,
                 elastic: ElasticConfig | None = None, precision: PrecisionConfig | None = None,
                 memory: MemoryConfig | None = None, comm: CommConfig | None = None):
        self.spec = TrainSpec(model=model, data=data, run=run, scaling=scaling or ScalingConfig(),
                              parallel=parallel or ParallelConfig(), checkpoint=checkpoint or CheckpointConfig(),
                              elastic=elastic or ElasticConfig(), precision=precision or PrecisionConfig(),
                              memory=memory or MemoryConfig(), comm=comm or CommConfig())

    @classmethod
    def from_spec(cls, spec: TrainSpec) -> "Trainer":
        t = cls.__new__(cls)
        t.spec = spec
        return t

    def with_overrides(self, overrides: dict[str, str]) -> "Trainer":
        return Trainer.from_spec(self.spec.with_overrides(overrides))

    def submit(self, *, checked: bool = False) -> RunHandle:
        """Start the run and return at once. ``checked``: :meth:`preflight` already passed
        (``rayflex run`` checks before it connects to Ray, then submits)."""
        import ray

        from rayflex.constants import CONTROLLER_NAMESPACE, controller_name
        from rayflex.control.controller import Controller
        from rayflex.models.summary import summarized

        if not checked:
            self.preflight()
        ensure_ray(self.spec.scaling.num_workers * self.spec.scaling.cpus_per_worker)
        name = controller_name(self.spec.run.name)
        try:
            ray.get_actor(name, namespace=CONTROLLER_NAMESPACE)
        except ValueError:
            pass
        else:
            raise RayflexError(f"run {self.spec.run.name!r} is already running on this cluster; "
                               f"stop it first (`rayflex status {self.spec.run.name}`) or pick another name")
        from rayflex.constants import knob_env

        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # The controller lives on the driver's node (the head under `ray job submit`), never
        # on a worker node whose loss (a spot preemption) would take the run down with it.
        here = NodeAffinitySchedulingStrategy(node_id=ray.get_runtime_context().get_node_id(), soft=False)
        remote = ray.remote(num_cpus=0, max_concurrency=8)(Controller)
        # The controller gets the model's sizes, not its code: it never imports torch.
        controller = remote.options(name=name, namespace=CONTROLLER_NAMESPACE, scheduling_strategy=here).remote(
            summarized(self.spec), knobs=knob_env())
        return RunHandle(self.spec.run.name, controller, controller.run.remote())

    def fit(self, *, progress: bool = True, checked: bool = False) -> Result:
        """Run to the end, showing progress; raises the worker's error if the run fails."""
        handle = self.submit(checked=checked)
        return handle.wait(progress=progress)

    def plan(self, topology=None, *, world_size: Optional[int] = None):
        """Where the ranks would go, and why: a dry run of the placement planner.

        ``topology``: a :class:`rayflex.planning.topology.Topology`, a YAML/JSON file
        describing nodes and labels (no cluster needed), or None for the connected (or
        embedded local) cluster. Returns a ``Plan`` (``print(plan.format(ranks=True))``).
        With ``ParallelConfig(pp="auto")`` the mesh is the capacity planner's choice for this
        world size, and its reasoning heads the explanation.
        """
        import dataclasses

        from rayflex.mesh.plan import plan_mesh
        from rayflex.planning.capacity.auto import resolve_parallel
        from rayflex.planning.comm_profile import plan_for
        from rayflex.planning.topology import Topology

        if isinstance(topology, str):
            topology = Topology.from_file(topology)
        elif topology is None:
            ensure_ray(self.spec.scaling.num_workers * self.spec.scaling.cpus_per_worker)
            # the snapshot plan_for would take, taken once so pp="auto" plans on the same one
            topology = Topology.from_ray(cpus_per_worker=self.spec.scaling.cpus_per_worker or 1.0,
                                         use_gpu=self.spec.scaling.use_gpu)
        world = world_size or self.spec.scaling.num_workers
        resolved = resolve_parallel(self.spec, world, topology)  # as the controller does at launch
        mesh = plan_mesh(self.spec.model, resolved.parallel, resolved.data, world,
                         memory=resolved.memory, replicate_choice=resolved.replicate_choice)
        plan = plan_for(self.spec, mesh, topology)
        if resolved.explanation:
            plan = dataclasses.replace(plan, explanation=f"{resolved.explanation}\n{plan.explanation}")
        return plan

    def preflight(self) -> None:
        """Everything that can be checked before Ray is touched: storage, checkpoints, data,
        the model contract (on the meta device). ``fit()`` and ``submit()`` run it first;
        call it alone to check a configuration without starting anything."""
        import warnings

        from rayflex.constants import check_knobs
        from rayflex.storage.fs import check_storage
        from rayflex.telemetry.report import drawn_at_run_end

        from rayflex.errors import ConfigError

        bad, unknown = check_knobs()
        if bad:  # read only where used, a bad knob would fail once the workers started
            raise ConfigError(*bad[0])
        for line in unknown:
            warnings.warn(line, stacklevel=3)
        drawn_at_run_end()  # a RAYFLEX_RUN_REPORT it cannot read fails now, not as the run ends
        check_storage(self.spec.run.storage)
        if self.spec.checkpoint.uri:
            check_storage(self.spec.checkpoint.uri)
        ckpt = self.spec.checkpoint
        if ckpt.every_steps and not ckpt.resume:
            from rayflex.checkpoint import manifest as mf

            latest = mf.latest_committed(self.spec.checkpoint_uri)
            if latest is not None:
                raise ConfigError("CheckpointConfig.resume",
                                  f"resume=False but {self.spec.checkpoint_uri} already holds committed "
                                  f"checkpoints (latest step {latest}); a fresh run would mix two timelines",
                                  "set resume=True to continue it, or use a new RunConfig.name")
        if self.spec.parallel.is_auto and self.spec.parallel.cluster:
            # A missing description, or a model that fits nowhere at the requested size, fails
            # here rather than in the controller. (Without a description the controller plans
            # on the live topology, which the driver has not seen yet.)
            from rayflex.planning.capacity.auto import resolve_parallel

            resolve_parallel(self.spec, self.spec.scaling.num_workers)
        from rayflex.data.dataset import check_dataset
        from rayflex.models.contract import DEFAULT_BATCH, check_model_contract

        check_dataset(self.spec.data)
        from rayflex.data.prepare import check_manifest

        check_manifest(self.spec.data, self.spec.model.vocab_size)
        check_model_contract(self.spec.model, batch=self.spec.data.micro_batch or DEFAULT_BATCH,
                             seq_len=self.spec.data.seq_len)
        if ckpt.resume:
            from rayflex.api.resume import check_model_fits

            check_model_fits(self.spec.model, self.spec.checkpoint_uri, self.spec.run.name)
