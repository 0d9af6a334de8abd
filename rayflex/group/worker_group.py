"""WorkerGroup: the TrainWorker actors of one run attempt, indexed by rank.

The controller talks to workers only through this class, so controller logic can be tested
with a stand-in group. A group is built from, per rank, either a scheduling strategy (spawn
a new actor in that bundle) or a surviving actor of the previous attempt (reconfigured to
its new rank: no new process, no re-import of torch).

Polls are asynchronous: each rank has at most one poll in flight, a cycle collects the
answers that arrived, and a rank whose poll stays unanswered is reported with how long it
has been silent — a frozen process never blocks the controller's loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from rayflex.mesh.plan import MeshPlan
from rayflex.worker.actor import TrainWorkerActor
from rayflex.worker.status import Leaving, WorkerStatus
from rayflex.config import TrainSpec
from rayflex.constants import knob, knob_env
from rayflex.group.actors import kill_quietly

log = logging.getLogger(__name__)


@dataclass
class PollResult:
    """One poll cycle: answers, ranks whose actor is gone (with the error), silent ranks."""

    statuses: dict[int, WorkerStatus]
    dead: dict[int, str]
    unresponsive: list[int]
    silent_s: dict[int, float] = field(default_factory=dict)


def worker_actor_class(spec: TrainSpec, worker_cls: type = TrainWorkerActor):
    import ray

    res = spec.scaling.worker_resources()
    return ray.remote(num_cpus=res.pop("CPU", 0), num_gpus=res.pop("GPU", 0), resources=res or None,
                      max_concurrency=4)(worker_cls)


class RayWorkerGroup:
    def __init__(self, spec: TrainSpec, plan: MeshPlan, members: list[Any], *, worker_cls: type = TrainWorkerActor):
        """``members[rank]``: a scheduling strategy (spawn) or an existing actor (reuse)."""
        from ray.actor import ActorHandle

        self.spec, self.plan = spec, plan
        remote_cls = None
        self.actors = []
        self.reused: list[int] = []
        self._reconfigured: list[Any] = []
        for rank, member in enumerate(members):
            if isinstance(member, ActorHandle):
                # Awaited before any other call: a threaded actor does not keep call order.
                self._reconfigured.append(member.reconfigure.remote(rank, plan))
                self.actors.append(member)
                self.reused.append(rank)
            else:
                remote_cls = remote_cls or worker_actor_class(spec, worker_cls)
                self.actors.append(remote_cls.options(scheduling_strategy=member).remote(
                    rank, spec, plan, knobs=knob_env()))
        self.node_of: dict[int, str] = {}
        self.pids: dict[int, int] = {}
        self._inflight: dict[int, tuple[Any, float]] = {}
        self._last_answer: dict[int, float] = {}

    def setup(self, restore: bool = True, timeout_s: Optional[float] = None,
              while_waiting: Optional[Callable[[], None]] = None, live: Optional[dict] = None) -> list[dict]:
        """Rendezvous at rank 0's address and build every stage. Returns per-rank setup info.
        ``while_waiting`` is called about once a second until every rank answered (the
        controller keeps storing its run directory, so an outage during a restore is named
        while the restore rides it out, not after). ``live``: restore the survivors'
        snapshots (live recovery) instead of a checkpoint."""
        timeout_s = timeout_s or knob("SETUP_TIMEOUT_S")
        t0 = time.time()
        # Ranks whose process is up answer liveness pings from another actor thread while
        # they reconfigure, rendezvous, build and restore: one frozen then (SIGSTOP, a
        # frozen node) is named within the heartbeat timeout instead of stalling the
        # restart for the whole setup timeout. (New processes cannot answer until built.)
        reused = {r: self.actors[r] for r in self.reused}
        _gather(self._reconfigured, timeout_s, "reconfigure", ranks=self.reused, while_waiting=while_waiting,
                liveness=reused)
        infos = _gather([a.node_info.remote() for a in self.actors], timeout_s, "start", while_waiting=while_waiting)
        self.spawn_s = time.time() - t0  # process start + imports (0 for reused workers)
        self.node_of = {i["rank"]: i["node_id"] for i in infos}
        self.pids = {i["rank"]: i["pid"] for i in infos}
        master = infos[0]
        refs = [a.setup.remote(master["ip"], master["port"], restore, live) for a in self.actors]
        out = _gather(refs, timeout_s, "rendezvous, build and restore", while_waiting=while_waiting,
                      liveness=dict(enumerate(self.actors)))
        now = time.time()
        self._last_answer = {r: now for r in range(len(self.actors))}
        return out

    def start(self, end_step: int) -> list[int]:
        import ray

        return ray.get([a.start.remote(end_step) for a in self.actors], timeout=knob("ACTOR_CALL_TIMEOUT_S"))

    def poll(self, timeout_s: Optional[float] = None) -> PollResult:
        import ray
        from ray.exceptions import RayActorError

        wait_s = knob("POLL_INTERVAL_S") if timeout_s is None else timeout_s
        now = time.time()
        for rank, actor in enumerate(self.actors):
            if rank not in self._inflight:
                self._inflight[rank] = (actor.poll.remote(), now)
        refs = {ref: rank for rank, (ref, _) in self._inflight.items()}
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s)
        out = PollResult({}, {}, [])
        now = time.time()
        for ref in ready:
            rank = refs[ref]
            del self._inflight[rank]
            try:
                out.statuses[rank] = ray.get(ref)
                self._last_answer[rank] = now
            except RayActorError as e:
                out.dead[rank] = _short_error(e)
            except Exception as e:  # noqa: BLE001 - any other failure to answer is a death
                out.dead[rank] = _short_error(e)
        for rank in self._inflight:
            out.unresponsive.append(rank)
            out.silent_s[rank] = now - self._last_answer.get(rank, now)
        return out

    def flight_records(self, timeout_s: float, skip: frozenset = frozenset()) -> tuple[dict[int, Any], set[int]]:
        """Every rank's flight record (``TrainWorker.flight_record``), asked of all at once
        (but ``skip``: ranks known to be frozen); returns the records that came within
        ``timeout_s`` and the ranks that did not answer (frozen, dead, or too slow)."""
        import ray

        refs = {a.flight_record.remote(): rank for rank, a in enumerate(self.actors) if rank not in skip}
        if not refs:
            return {}, set(range(len(self.actors)))
        ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        records: dict[int, Any] = {}
        for ref in ready:
            try:
                records[refs[ref]] = ray.get(ref)
            except Exception as e:  # noqa: BLE001 - a rank that cannot answer is silent
                log.info("rank %d could not give its flight record: %s", refs[ref], _short_error(e))
        return records, set(range(len(self.actors))) - set(records)

    def broadcast(self, method: str, *args) -> None:
        for a in self.actors:
            getattr(a, method).remote(*args)

    def request_checkpoint(self, reason: str) -> None:
        """A checkpoint at the next step boundary. One rank is asked: the control all-reduce
        carries its request to the others (asking all could split it over two steps)."""
        self.actors[0].request_checkpoint.remote(reason)

    def kill(self, ranks) -> None:
        for r in ranks:
            kill_quietly(self.actors[r])

    def release(self, ranks, timeout_s: float = 10.0, checkpoint_grace_s: float = 3.0,
                abort: bool = False, snapshot: bool = False) -> "Release":
        """Ask surviving ranks to leave the attempt (``abort``: the attempt is broken, fail
        its pending collectives); says which left cleanly and which died meanwhile.
        ``snapshot``: each rank that leaves keeps its state for ``take_live``."""
        import ray
        from ray.exceptions import RayActorError

        refs = {r: self.actors[r].release.remote(timeout_s, checkpoint_grace_s, abort, snapshot) for r in ranks}
        pending, ready = list(refs.values()), []
        deadline = time.time() + timeout_s + 5
        last_progress = time.time()
        while pending and time.time() < deadline:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.1)
            if done:
                ready += done
                last_progress = time.time()
            elif ready and time.time() - last_progress > knob("RELEASE_SETTLE_S"):
                break  # the rest wait on a frozen or dead peer: the caller kills them
        left, uploading, died = set(), set(), {}
        for r, ref in refs.items():
            if ref not in ready:
                continue
            try:
                answer = ray.get(ref)
            except RayActorError as e:  # its process is gone (killed, or its node with it)
                died[r] = _short_error(e)
                continue
            except Exception:  # noqa: BLE001 - it could not leave: the caller kills it
                continue
            if answer == Leaving.LEFT:
                left.add(r)
            elif answer == Leaving.UPLOADING:
                uploading.add(r)
        return Release(frozenset(left), died, frozenset(uploading))

    def held_steps(self, ranks: list[int]) -> dict:
        """After ``release(snapshot=True)``: rank -> what it holds (``TrainWorker.held_step``)
        for each of ``ranks`` that answers in time; the live-recovery policy decides on them."""
        import ray

        deadline = time.time() + knob("ACTOR_CALL_TIMEOUT_S")
        out = {}
        for r, ref in [(r, self.actors[r].held_step.remote()) for r in ranks]:
            try:
                out[r] = ray.get(ref, timeout=max(0.0, deadline - time.time()))
            except Exception:  # noqa: BLE001 - its take_live says why it has no live state
                pass
        return out

    def take_live(self, ranks: list[int], roll_forward: Optional[dict] = None) -> dict:
        """rank -> (what its snapshot says, a reference to its files). ``roll_forward``:
        rank -> the agreed record of the step it applies first (``TrainWorker.take_live``).
        The files stay in the object store of the rank's node, owned by this process: they
        outlive the rank (one let go, or replaced) until the next attempt has read them."""
        import ray

        roll_forward = roll_forward or {}
        pending = {r: self.actors[r].take_live.options(num_returns=2).remote(roll_forward.get(r)) for r in ranks}
        deadline = time.time() + knob("ACTOR_CALL_TIMEOUT_S")  # one wait for all: they snapshot at once
        out = {}
        for r, (info_ref, files_ref) in pending.items():
            try:
                out[r] = (ray.get(info_ref, timeout=max(0.0, deadline - time.time())), files_ref)
            except Exception as e:  # noqa: BLE001 - no live copy from this rank: the policy says so
                out[r] = ({"rank": r, "error": f"its snapshot did not arrive: {_short_error(e)}"}, None)
        return out

    def drop_live(self, ranks: list[int]) -> None:
        """After ``release(snapshot=True)``: ``ranks`` drop the state they kept (no snapshot
        of theirs is needed); waited for, so a reused process holds one attempt's state."""
        import ray

        refs = [self.actors[r].drop_live.remote() for r in ranks]
        if refs:
            ray.wait(refs, num_returns=len(refs), timeout=knob("ACTOR_CALL_TIMEOUT_S"))

    def shutdown(self, graceful_s: float = 5.0) -> None:
        """Let ranks release their process groups, then kill every actor."""
        import ray

        try:
            ray.wait([a.shutdown.remote() for a in self.actors], num_returns=len(self.actors),
                     timeout=graceful_s)
        except Exception:  # noqa: BLE001 - the kill below is what matters
            pass
        self.kill(range(len(self.actors)))


@dataclass(frozen=True)
class Release:
    """How the ranks asked to leave an attempt did: ``left`` it cleanly (reusable), ``died``
    meanwhile (rank -> error), left with a checkpoint upload still running (``uploading``:
    not reusable, replaced); any other did not leave in time (stuck)."""
    left: frozenset = frozenset()
    died: dict = field(default_factory=dict)
    uploading: frozenset = frozenset()


def _gather(refs: list, timeout_s: float, phase: str, ranks: Optional[list] = None,
            while_waiting: Optional[Callable[[], None]] = None, liveness: Optional[dict] = None) -> list:
    """``ray.get`` of one call per rank (``ranks[i]``: the rank of ``refs[i]``; default i).
    Stops at the first rank whose actor died, or at the timeout, and raises
    :class:`SetupFailed` naming the ranks: the others may be waiting on the dead one (a
    rendezvous), so waiting for them would only spend the timeout. A rank that raised
    keeps its error (a bug in the model or config, not a lost node). ``while_waiting``:
    called between waits of at most a second. ``liveness``: rank -> actor pinged about
    once a second; one silent for ``HEARTBEAT_TIMEOUT_S`` fails the phase as frozen."""
    import ray
    from ray.exceptions import RayActorError

    from rayflex.errors import SetupFailed

    rank_of = {ref: (ranks[i] if ranks is not None else i) for i, ref in enumerate(refs)}
    results: dict = {}
    dead: dict[int, str] = {}
    raised: Optional[BaseException] = None
    pending, deadline = list(refs), time.time() + timeout_s
    pinger = _Pinger(liveness) if liveness else None
    frozen: list[int] = []
    while pending and not dead and not frozen:
        left = deadline - time.time()
        if left <= 0:
            break
        wait_s = min(left, 1.0) if while_waiting or pinger else left
        ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
        if while_waiting is not None:
            while_waiting()
        for ref in ready:
            try:
                results[ref] = ray.get(ref)
            except RayActorError as e:
                dead[rank_of[ref]] = _short_error(e)
            except Exception as e:  # noqa: BLE001 - re-raised below unless a rank died
                raised = raised or e
        if pinger is not None and pending and not dead:
            frozen = pinger.silent()
    if frozen:
        raise SetupFailed(phase, {}, frozen, pinger.timeout_s, frozen=True)
    if dead or pending:
        raise SetupFailed(phase, dead, [] if dead else sorted(rank_of[r] for r in pending), timeout_s)
    if raised is not None:
        raise raised
    return [results[ref] for ref in refs]


class _Pinger:
    """Liveness pings (``ping``, answered by another actor thread) while a setup phase
    runs: :meth:`silent` collects the answers, sends the next round, and names the ranks
    whose ping has gone unanswered for the heartbeat timeout. A ping that fails (the
    actor died) counts as an answer: the phase's own call reports the death."""

    def __init__(self, actors: dict):
        self.actors = actors
        self.timeout_s = knob("HEARTBEAT_TIMEOUT_S")
        self.inflight: dict[int, tuple[Any, float]] = {}  # rank -> (ping, sent at)

    def silent(self) -> list[int]:
        import ray

        if self.inflight:
            refs = [ref for ref, _ in self.inflight.values()]
            done = set(ray.wait(refs, num_returns=len(refs), timeout=0)[0])
            self.inflight = {r: (ref, t) for r, (ref, t) in self.inflight.items() if ref not in done}
        now = time.time()
        for rank, actor in self.actors.items():
            if rank not in self.inflight:
                self.inflight[rank] = (actor.ping.remote(), now)
        return sorted(r for r, (_, sent) in self.inflight.items() if now - sent > self.timeout_s)


def _short_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
