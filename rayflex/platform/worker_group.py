"""WorkerGroup: the set of TrainWorker actors of one run attempt.

The controller talks to workers only through this class, so controller logic can be tested
with a stand-in group. Placement (which bundle of which placement group each rank lands
in) is decided before and handed in as one scheduling strategy per rank.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rayflex.actors.parallel import MeshPlan
from rayflex.actors.worker import TrainWorker, WorkerStatus
from rayflex.config import TrainSpec
from rayflex.constants import knob, knob_env
from rayflex.errors import RayflexError

log = logging.getLogger(__name__)


@dataclass
class PollResult:
    """One poll of every rank: answers, and ranks whose actor is gone (with the error)."""

    statuses: dict[int, WorkerStatus]
    dead: dict[int, str]
    unresponsive: list[int]


class RayWorkerGroup:
    def __init__(self, spec: TrainSpec, plan: MeshPlan, strategies: list[Any],
                 *, worker_cls: type = TrainWorker):
        import ray

        self.spec, self.plan = spec, plan
        env = dict(knob_env())
        env.setdefault("OMP_NUM_THREADS", str(spec.scaling.torch_threads))
        res = spec.scaling.worker_resources()
        opts: dict[str, Any] = {"num_cpus": res.pop("CPU", 0), "num_gpus": res.pop("GPU", 0),
                                "resources": res or None, "max_concurrency": 4,
                                "runtime_env": {"env_vars": env}}
        remote_cls = ray.remote(**opts)(worker_cls)
        self.actors = [remote_cls.options(scheduling_strategy=strategies[r], name=None).remote(r, spec, plan)
                       for r in range(plan.world_size)]
        self.node_of: dict[int, str] = {}

    def setup(self, restore: bool = True, timeout_s: Optional[float] = None) -> list[dict]:
        """Rendezvous at rank 0's address and build every stage. Returns per-rank setup info."""
        import ray

        timeout_s = timeout_s or knob("SETUP_TIMEOUT_S")
        infos = ray.get([a.node_info.remote() for a in self.actors], timeout=timeout_s)
        self.node_of = {i["rank"]: i["node_id"] for i in infos}
        self.pids = {i["rank"]: i["pid"] for i in infos}
        master = infos[0]
        refs = [a.setup.remote(master["ip"], master["port"], restore) for a in self.actors]
        return ray.get(refs, timeout=timeout_s)

    def start(self, end_step: int) -> list[int]:
        import ray

        return ray.get([a.start.remote(end_step) for a in self.actors], timeout=60)

    def poll(self, timeout_s: Optional[float] = None) -> PollResult:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        timeout_s = timeout_s or knob("POLL_TIMEOUT_S")
        refs = {r: a.poll.remote() for r, a in enumerate(self.actors)}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
        ready = set(ready)
        out = PollResult({}, {}, [])
        for rank, ref in refs.items():
            if ref not in ready:
                out.unresponsive.append(rank)
                continue
            try:
                out.statuses[rank] = ray.get(ref)
            except RayActorError as e:
                out.dead[rank] = str(e).splitlines()[0] if str(e) else type(e).__name__
            except GetTimeoutError:
                out.unresponsive.append(rank)
        return out

    def call(self, rank: int, method: str, *args) -> Any:
        return getattr(self.actors[rank], method).remote(*args)

    def broadcast(self, method: str, *args) -> None:
        for a in self.actors:
            getattr(a, method).remote(*args)

    def wait_all(self, method: str, *args, timeout_s: float = 60.0) -> list[Any]:
        import ray

        return ray.get([getattr(a, method).remote(*args) for a in self.actors], timeout=timeout_s)

    def shutdown(self, graceful_s: float = 5.0) -> None:
        """Let ranks release their process groups, then kill every actor."""
        import ray

        try:
            ray.wait([a.shutdown.remote() for a in self.actors], num_returns=len(self.actors),
                     timeout=graceful_s)
        except Exception:  # noqa: BLE001 - the kill below is what matters
            pass
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # already dead
                pass
