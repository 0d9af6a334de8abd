"""What the controller needs from the world outside it: a clock and a cluster.

The controller's states never call Ray themselves; they go through a :class:`Clock` and a
:class:`RayCluster` (spawning a worker group, reserving bundles, killing an actor, asking
the autoscaler for capacity, reading the topology). Unit tests pass stand-ins with a fake
clock and scripted workers, and drive every transition without Ray.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

from rayflex.config import TrainSpec
from rayflex.constants import knob, knob_env
from rayflex.group.actors import actor_id, kill_quietly


class Clock:
    """Wall-clock seconds and sleeping; tests pass one whose time they advance."""

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))

    def every(self, seconds: float, fn: Callable[[], None], name: str) -> Callable[[], None]:
        """Call ``fn`` every ``seconds`` on a thread of its own, whatever the controller's
        states are doing meanwhile (a restart can block them for seconds); returns the
        function that stops it. An exception in ``fn`` is logged and the ticks go on."""
        stopped = threading.Event()

        def loop() -> None:
            while not stopped.wait(seconds):
                try:
                    fn()
                except Exception:  # noqa: BLE001 - a tick must not end the thread
                    logging.getLogger(__name__).exception("%s failed", name)

        threading.Thread(target=loop, name=name, daemon=True).start()
        return stopped.set


class RayCluster:
    """The controller's side effects on a real Ray cluster."""

    def __init__(self, spec: TrainSpec):
        self.spec = spec

    def topology(self):
        from rayflex.planning.topology import Topology

        return Topology.from_ray(cpus_per_worker=self.spec.scaling.cpus_per_worker, use_gpu=self.spec.scaling.use_gpu)

    def alive_nodes(self) -> set[str]:
        import ray

        return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}

    def request_capacity(self) -> None:
        """Ask Ray's autoscaler for bundles up to max_workers (a no-op without an autoscaler)."""
        import logging

        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[self.spec.scaling.worker_resources() for _ in range(self.spec.scaling.max_size)])
        except Exception as e:  # noqa: BLE001 - clusters without an autoscaler
            logging.getLogger(__name__).debug("request_resources unavailable: %s", e)

    kill = staticmethod(kill_quietly)
    actor_id = staticmethod(actor_id)

    def probe_nodes(self, nodes) -> dict[str, Any]:
        """A no-op task pinned to each node (0 CPUs): a node whose raylet answers runs it
        in about a second, a frozen one never; ``unanswered`` reads the outcome."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe = ray.remote(num_cpus=0, max_retries=0)(_node_answers)
        return {n: probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False)).remote()
                for n in nodes}

    def unanswered(self, probes: dict[str, Any], timeout_s: float) -> set[str]:
        """The nodes whose probe has not run within ``timeout_s`` (or failed: the node is gone)."""
        import ray

        refs = {ref: node for node, ref in probes.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        answered = set()
        for ref in ready:
            try:
                ray.get(ref)
                answered.add(refs[ref])
            except Exception:  # noqa: BLE001 - unschedulable: the node left
                pass
        return set(probes) - answered

    def check_health(self, expected_gpus: dict[str, int], start_at: Optional[float] = None) -> dict[str, Any]:
        """Start each node's health check (``worker.health_probe.probe_node``), pinned to it,
        with the GPUs it should have (node -> count; it holds them while it runs), its speed
        timed from ``start_at`` (epoch seconds) if given."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from rayflex.worker.health_probe import probe_node

        probe = ray.remote(num_cpus=0, max_retries=0)(probe_node)
        return {n: probe.options(num_gpus=gpus, scheduling_strategy=NodeAffinitySchedulingStrategy(
                    node_id=n, soft=False)).remote(gpus, start_at) for n, gpus in expected_gpus.items()}

    def health_reports(self, probes: dict[str, Any]) -> dict[str, dict]:
        """The reports of the checks that finished (without waiting); a check that could not
        run (its node left) reports that as its error."""
        import ray

        refs = {ref: node for node, ref in probes.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0) if refs else ([], [])
        reports = {}
        for ref in ready:
            try:
                reports[refs[ref]] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - unschedulable, the node left, the worker died
                reports[refs[ref]] = {"error": f"the check could not run: {type(e).__name__}: {e}"[:300]}
        return reports

    def reservation(self):
        from rayflex.group.reservation import RunPlacement

        return RunPlacement(self.spec)

    def worker_group(self, plan, members: list[Any]):
        from rayflex.group.worker_group import RayWorkerGroup

        return RayWorkerGroup(self.spec, plan, members)

    def standby_pool(self, reservation, plan_now):
        """Workers started ahead of need in ``reservation``'s bundles; ``plan_now()`` is the
        mesh they are first configured with (a standby gets its real rank on reuse)."""
        from rayflex.group.standby import StandbyPool
        from rayflex.group.worker_group import worker_actor_class

        def spawn(strategy):
            return worker_actor_class(self.spec).options(scheduling_strategy=strategy).remote(
                -1, self.spec, plan_now(), knobs=knob_env())

        return StandbyPool(spawn, reservation, actor_id)

    def replica_keepers(self):
        """The run's memory-replica keepers (one per node, spawned by ``cover``)."""
        from rayflex.checkpoint.replicas.keepers import KeeperSet

        ckpt = self.spec.checkpoint
        return KeeperSet(self.spec.run.name, ckpt.memory_replicas, ckpt.memory_budget_bytes)

    def preemption_watcher(self) -> Optional[Any]:
        from rayflex.faults import preemption as pre

        cfg = self.spec.elastic
        sources: list = []
        if cfg.watch_ray_drain:
            sources.append(pre.RayDrainSource())
        if cfg.metadata_url:
            sources.append(pre.MetadataSource(cfg.metadata_url, cfg.metadata_kind))
        if cfg.notice_file:
            sources.append(pre.NoticeFileSource(cfg.notice_file))
        return pre.PreemptionWatcher(sources) if sources else None

    def set_fail_at(self, actor, at_step: int, message: str) -> int:
        import ray

        return ray.get(actor.set_fail_at.remote(at_step, message), timeout=knob("ACTOR_CALL_TIMEOUT_S"))


def _node_answers() -> bool:
    return True
