"""StandbyPool: worker processes started before the run needs them.

A new worker process costs seconds on a laptop and tens of seconds on a GPU node
(interpreter, torch import, CUDA context). When that cost sits between "stop" and "start"
every GPU of the run idles through it. The pool starts the newcomers while the run keeps
training; the controller stops the run at a step boundary only once every newcomer is
warm, and the next attempt reuses them like survivors (``TrainWorker.reconfigure``).

A standby sits in its own bundle of the run's placement (so the resources are held for
it) with no rank yet. The pool owns no policy: the controller decides how many standbys
to start where, and when to give up on them.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from rayflex.group.actors import kill_quietly

log = logging.getLogger(__name__)


class Readiness(str, enum.Enum):
    READY = "ready"  # every standby is up (or there are none)
    WARMING = "warming"
    FAILED = "failed"  # one could not start, or they took too long: the pool was emptied


@dataclass
class Standby:
    actor: Any
    node_id: str
    started: float
    ready_ref: Any = None
    ready_at: Optional[float] = None


class StandbyPool:
    """``spawn(strategy) -> actor handle`` starts one worker; ``placement`` is the run's
    ``RunPlacement`` (bundles are reserved and bound through it)."""

    def __init__(self, spawn: Callable[[Any], Any], placement, actor_id: Callable[[Any], str]):
        self._spawn = spawn
        self._placement = placement
        self._actor_id = actor_id
        self._standbys: dict[str, Standby] = {}

    # ----------------------------------------------------------------- queries
    def count(self, node_id: Optional[str] = None) -> int:
        return sum(1 for s in self._standbys.values() if node_id is None or s.node_id == node_id)

    def count_ready(self, node_id: str) -> int:
        return sum(1 for s in self._standbys.values() if s.node_id == node_id and s.ready_at is not None)

    def nodes(self) -> set[str]:
        return {s.node_id for s in self._standbys.values()}

    @property
    def warming(self) -> int:
        return sum(1 for s in self._standbys.values() if s.ready_at is None)

    @property
    def ready(self) -> int:
        return sum(1 for s in self._standbys.values() if s.ready_at is not None)

    def oldest_warming_s(self) -> float:
        now = time.time()
        return max((now - s.started for s in self._standbys.values() if s.ready_at is None), default=0.0)

    def readiness(self, timeout_s: float) -> Readiness:
        """Whether the standbys are up; gives up on them (emptying the pool) if one failed
        to start or they take longer than ``timeout_s``."""
        errors = self.poll()
        if errors or self.oldest_warming_s() > timeout_s:
            log.warning("standby workers given up: %s", "; ".join(errors) or f"not up after {timeout_s:.0f}s")
            self.clear()
            return Readiness.FAILED
        return Readiness.READY if self.warming == 0 else Readiness.WARMING

    # ----------------------------------------------------------------- actions
    def start(self, node_id: str, count: int) -> None:
        """Reserve ``count`` bundles on ``node_id`` and start a worker in each."""
        for _ in range(count):
            slot, strategy = self._placement.reserve_standby(node_id)
            actor = self._spawn(strategy)
            actor_id = self._actor_id(actor)
            self._placement.bind_slot(slot, actor_id)
            self._standbys[actor_id] = Standby(actor=actor, node_id=node_id, started=time.time(),
                                               ready_ref=actor.node_info.remote())
        if count:
            log.info("warming %d standby worker(s) on node %s", count, node_id[:12])

    def adopt(self, actor_id: str, actor: Any, node_id: str) -> None:
        """Keep an idle, already-warm worker (a survivor the new plan has no rank for)."""
        now = time.time()
        self._standbys[actor_id] = Standby(actor=actor, node_id=node_id, started=now, ready_at=now)

    def poll(self) -> list[str]:
        """Mark the standbys whose process is up; drop (and return the errors of) those
        that failed to start."""
        import ray

        pending = {s.ready_ref: actor_id for actor_id, s in self._standbys.items() if s.ready_at is None}
        if not pending:
            return []
        done, _ = ray.wait(list(pending), num_returns=len(pending), timeout=0)
        errors = []
        for ref in done:
            actor_id = pending[ref]
            standby = self._standbys[actor_id]
            try:
                ray.get(ref)
                standby.ready_at = time.time()
                log.info("standby worker on node %s warm after %.1fs", standby.node_id[:12],
                         standby.ready_at - standby.started)
            except Exception as e:  # noqa: BLE001 - its node went, or the process died
                errors.append(f"standby on node {standby.node_id[:12]}: {type(e).__name__}: {e}")
                self._drop(actor_id)
        return errors

    def wait(self, timeout_s: float) -> list[str]:
        """Block until every standby is up (or failed), at most ``timeout_s``: one started
        earlier is never slower than a process the caller would start now."""
        import ray

        pending = [s.ready_ref for s in self._standbys.values() if s.ready_at is None]
        if pending:
            ray.wait(pending, num_returns=len(pending), timeout=timeout_s)
        return self.poll()

    def take(self) -> dict[str, Any]:
        """Hand the warm standbys over (actor id -> handle), keeping their bundles bound;
        the ones still warming stay in the pool."""
        out = {aid: s.actor for aid, s in self._standbys.items() if s.ready_at is not None}
        for actor_id in out:
            del self._standbys[actor_id]
        return out

    def clear(self) -> None:
        for actor_id in list(self._standbys):
            self._drop(actor_id)

    def _drop(self, actor_id: str) -> None:
        standby = self._standbys.pop(actor_id)
        kill_quietly(standby.actor)
        self._placement.vacate(actor_id)
