"""Stand-ins for everything outside the controller: a fake clock, and a cluster whose
workers train by script (one step per poll), die, freeze, raise, lose their node or get a
spot notice at the step a test names. No Ray, no processes, no sleeping."""

from __future__ import annotations


import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from rayflex.data.sampler import SAMPLE_ORDER
from rayflex.errors import SetupFailed
from rayflex.faults.preemption import Notice
from rayflex.group.standby import Readiness
from rayflex.group.worker_group import PollResult, Release
from rayflex.planning.topology import NodeInfo, Topology
from rayflex.worker.status import FlightRecord, StepRecord, WorkerStatus

_ids = itertools.count()
FAKE_GFLOPS = 10.0  # what every fake rank measures at setup, and a healthy node's check


class FakeClock:
    def __init__(self, start: float = 1_000_000.0):
        self.now = start
        self._tickers: list[list] = []  # [interval, next due, fn, running]

    def time(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += max(seconds, 0.01)
        for ticker in self._tickers:  # what a real ticker's thread would have done meanwhile
            interval, due, fn, running = ticker
            if running and self.now >= due:
                ticker[1] = self.now + interval
                fn()

    def every(self, seconds: float, fn, name: str):
        ticker = [seconds, self.now + seconds, fn, True]
        self._tickers.append(ticker)
        return lambda: ticker.__setitem__(3, False)


@dataclass(eq=False)
class FakeActor:
    node: str
    id: str = field(default_factory=lambda: f"actor-{next(_ids)}")
    alive: bool = True
    frozen: bool = False


@dataclass
class FakeSlot:
    node: str


class FakeReservation:
    """Bundles per node as a mapping actor id -> node; a spawn 'strategy' names the node."""

    def __init__(self, cluster: "FakeCluster"):
        self.cluster = cluster
        self.bound: dict[str, str] = {}
        self.removed = False

    def slot_of(self, actor_id: str) -> Optional[FakeSlot]:
        return FakeSlot(self.bound[actor_id]) if actor_id in self.bound else None

    def node_of_actor(self, actor_id: str) -> Optional[str]:
        return self.bound.get(actor_id)

    def vacate(self, actor_id: str) -> None:
        self.bound.pop(actor_id, None)

    def assign(self, plan, survivors: dict[str, Any]):
        members: list[Any] = [None] * len(plan.rank_to_node)
        pool = dict(survivors)
        for node, ranks in plan.node_ranks().items():
            here = [aid for aid in pool if self.bound.get(aid) == node]
            for rank in ranks:
                members[rank] = pool.pop(here.pop(0)) if here else ("spawn", node)
        for aid in pool:
            self.vacate(aid)
        return members, list(pool.values())

    def bind_slot(self, slot: FakeSlot, actor_id: str) -> None:
        self.bound[actor_id] = slot.node

    def bind(self, rank: int, actor_id: str) -> None:
        self.bound[actor_id] = self.cluster.actors[actor_id].node

    def release_unused(self) -> None:
        pass

    def reserve_standby(self, node: str):
        return FakeSlot(node), ("spawn", node)

    def remove(self) -> None:
        self.removed = True


class FakeStandbyPool:
    """Standbys are warm one poll after they start."""

    def __init__(self, cluster: "FakeCluster", reservation: FakeReservation):
        self.cluster, self.reservation = cluster, reservation
        self.standbys: dict[str, tuple[FakeActor, bool]] = {}  # id -> (actor, ready)

    def count(self, node_id=None) -> int:
        return sum(1 for a, _ in self.standbys.values() if node_id is None or a.node == node_id)

    def count_ready(self, node_id) -> int:
        return sum(1 for a, ready in self.standbys.values() if a.node == node_id and ready)

    def nodes(self) -> set:
        return {a.node for a, _ in self.standbys.values()}

    @property
    def warming(self) -> int:
        return sum(1 for _, ready in self.standbys.values() if not ready)

    @property
    def ready(self) -> int:
        return sum(1 for _, ready in self.standbys.values() if ready)

    def start(self, node_id: str, count: int) -> None:
        for _ in range(count):
            actor = self.cluster.new_actor(node_id)
            self.reservation.bind_slot(FakeSlot(node_id), actor.id)
            self.standbys[actor.id] = (actor, False)
            self.cluster.standbys_started += 1

    def adopt(self, actor_id, actor, node_id) -> None:
        self.standbys[actor_id] = (actor, True)

    def poll(self) -> list[str]:
        self.standbys = {aid: (a, True) for aid, (a, _) in self.standbys.items() if a.node in self.cluster.alive}
        return []

    def wait(self, timeout_s: float) -> list[str]:
        return self.poll()

    def readiness(self, timeout_s: float) -> Readiness:
        self.poll()
        return Readiness.READY if self.warming == 0 else Readiness.WARMING

    def take(self) -> dict:
        out = {aid: a for aid, (a, ready) in self.standbys.items() if ready}
        for aid in out:
            del self.standbys[aid]
        return out

    def clear(self) -> None:
        for aid, (actor, _) in list(self.standbys.items()):
            self.cluster.kill(actor)
            self.reservation.vacate(aid)
        self.standbys = {}


class FakeWatcher:
    def __init__(self, cluster: "FakeCluster"):
        self.cluster = cluster

    def watch_nodes(self, nodes) -> None:
        pass

    def poll(self) -> list[Notice]:
        # Like Ray's drain list, a node's notice is gone with the node.
        out, self.cluster.notices = [n for n in self.cluster.notices if n.node_id in self.cluster.alive], []
        return out

    def close(self) -> None:
        pass


class FakeGroup:
    """The ranks of one attempt, in lockstep: every poll, each live rank finishes a step."""

    def __init__(self, cluster: "FakeCluster", plan, members: list):
        self.cluster, self.plan = cluster, plan
        self.actors, self.reused = [], []
        for rank, m in enumerate(members):
            if isinstance(m, FakeActor):
                self.actors.append(m)
                self.reused.append(rank)
            else:
                self.actors.append(cluster.new_actor(m[1]))
        self.node_of = {r: a.node for r, a in enumerate(self.actors)}
        self.pids = {r: 1000 + r for r in range(len(self.actors))}
        self.step = 0
        self.end = 0
        self.stopping = False
        self.failed: dict[int, str] = {}

    def setup(self, restore: bool = True, while_waiting=None, live=None) -> list[dict]:
        # A test queues what goes wrong while the next attempts start (may raise SetupFailed).
        failures = getattr(self.cluster, "setup_failures", [])
        if failures:
            failures.pop(0)(self)
        # A test sets how long the next restore takes (a store riding out an outage); the
        # controller is called back every second meanwhile, as by the real group.
        slow, self.cluster.restore_s = getattr(self.cluster, "restore_s", 0.0), 0.0
        for _ in range(int(slow)):
            self.cluster.clock.sleep(1.0)
            if while_waiting is not None:
                while_waiting()
            if self.cluster.during_restore:  # one action a second, as a test queued them
                self.cluster.during_restore.pop(0)(self)
        stuck = sorted(r for r, a in enumerate(self.actors)
                       if a.node in self.cluster.frozen_nodes or a.node not in self.cluster.alive)
        if stuck:  # a process placed on a frozen node, or one Ray has since declared dead, never answers
            self.cluster.clock.sleep(60.0)
            raise SetupFailed("start", dead={}, slow=stuck, timeout_s=60.0)
        self.cluster.live_restores.append(live)
        if live is not None:  # the survivors' snapshots: the step they finished, nothing committed
            self.step = live["step"]
            restored = {"uri": "live peers", "world_size": live.get("world_size", 0), "total_steps": None,
                        "sample_order": SAMPLE_ORDER}
            return [{"step": self.step, "restored": restored, "probe_gflops": FAKE_GFLOPS} for _ in self.actors]
        self.step = self.cluster.committed if restore else 0
        # A test sets cluster.saved_total_steps to the run.steps the checkpoint was trained
        # toward (unset: a checkpoint without that record).
        restored = ({"uri": f"mem://ckpt/{self.step}", "world_size": 0,
                     "total_steps": getattr(self.cluster, "saved_total_steps", None),
                     "sample_order": getattr(self.cluster, "saved_sample_order", SAMPLE_ORDER)} if self.step else None)
        return [{"step": self.step, "restored": restored, "probe_gflops": FAKE_GFLOPS} for _ in self.actors]

    def start(self, end_step: int) -> list[int]:
        self.end = end_step
        return [self.step] * len(self.actors)

    def request_checkpoint(self, reason: str) -> None:
        self.checkpoint_request = reason
        self.cluster.checkpoint_requests.append((self.step, reason))

    checkpoint_request: Optional[str] = None

    def _live(self, rank: int) -> bool:
        a = self.actors[rank]
        return a.alive and a.node in self.cluster.alive

    def poll(self) -> PollResult:
        out = PollResult({}, {}, [])
        world = range(len(self.actors))
        healthy = all(self._live(r) and not self.actors[r].frozen for r in world) and not self.failed \
            and self.cluster.hang_at_step != self.step + 1
        finished_now = None
        if healthy and not self.stopping and self.step < self.end:
            self.step += 1
            finished_now = self.step
        for r in world:
            if not self._live(r):
                out.dead[r] = "ActorDiedError: the actor died"
            elif self.actors[r].frozen:
                out.unresponsive.append(r)
            else:
                out.statuses[r] = self._status(r, finished_now)
        if finished_now is not None:
            for action in self.cluster.script.pop(finished_now, []):
                action(self)
        return out

    def _status(self, rank: int, finished_now: Optional[int]) -> WorkerStatus:
        state = ("failed" if rank in self.failed else "stopped" if self.stopping
                 else "done" if self.step >= self.end else "running")
        now = self.cluster.clock.time()
        records, checkpoints = [], []
        if finished_now is not None:
            pp_index, dp_index = self.plan.coords(rank)
            # A slow node's ranks arrive last at the step's sync: the others wait for them.
            late = max((self.cluster.slow_nodes.get(n, 0.0) for n in self.node_of.values()), default=0.0)
            wait = 0.0 if self.cluster.slow_nodes.get(self.node_of[rank]) else late
            records.append(StepRecord(step=finished_now, loss=5.0 / finished_now, step_time_s=0.1 + late, lr=1e-3,
                                      grad_norm=1.0, time=now, samples=self.plan.per_rank_batch,
                                      pp_index=pp_index, dp_index=dp_index, sync_wait_s=wait))
            every = self.cluster.every_steps
            if rank == 0 and isinstance(every, int) and every and finished_now % every == 0:
                checkpoints.append(self._commit(finished_now, "periodic"))
            elif rank == 0 and self.checkpoint_request is not None:
                checkpoints.append(self._commit(finished_now, self.checkpoint_request))
                self.checkpoint_request = None
        if rank == 0 and self.stopping and not self._stop_saved:
            self._stop_saved = True
            checkpoints.append(self._commit(self.step, "stop"))
        return WorkerStatus(rank=rank, node_id=self.node_of[rank], state=state, step=self.step,
                            phase="collective" if state == "running" else "idle",
                            records=records, error=self.failed.get(rank), error_step=self.step + 1 if rank in
                            self.failed else None, checkpoints=checkpoints)

    _stop_saved = False

    def _commit(self, step: int, reason: str) -> dict:
        self.cluster.committed = max(self.cluster.committed, step)
        return {"committed": True, "step": step, "uri": f"mem://ckpt/{step}", "blocked_s": 0.1, "total_s": 0.2,
                "bytes": 1, "reason": reason}

    def broadcast(self, method: str, *args) -> None:
        if method == "request_stop":
            self.stopping = True

    def flight_records(self, timeout_s: float, skip=frozenset()):
        if self.cluster.flight is not None:
            return self.cluster.flight(self)
        answering = [r for r in range(len(self.actors)) if self._live(r) and not self.actors[r].frozen]
        records = {r: FlightRecord(rank=r, step=self.step, phase="collective", available=False,
                                   error="no recorder in the fake cluster") for r in answering}
        return records, set(range(len(self.actors))) - set(answering)

    def kill(self, ranks) -> None:
        for r in ranks:
            self.cluster.kill(self.actors[r])

    def release(self, ranks, timeout_s=10.0, checkpoint_grace_s=3.0, abort=False, snapshot=False) -> Release:
        self.cluster.releases.append((tuple(ranks), abort))
        for act in self.cluster.on_release:  # what a test makes happen while the survivors leave
            act(self)
        self.cluster.on_release = []
        leaving = getattr(self.cluster, "die_while_leaving", ())  # a test kills these as they leave
        uploading = frozenset(getattr(self.cluster, "upload_while_leaving", ()))  # these still upload
        released = Release(left=frozenset(r for r in ranks if self._live(r) and not self.actors[r].frozen
                                          and r not in leaving and r not in uploading),
                           died={r: "ActorDiedError: the actor died" for r in ranks
                                 if not self._live(r) or r in leaving},
                           uploading=uploading & frozenset(ranks))
        for act in self.cluster.after_release:  # what happens once they were let go (a node declared dead)
            act(self)
        self.cluster.after_release = []
        return released

    def held_steps(self, ranks) -> dict:
        return {r: {"rank": r, "step": self.step, "pending": None, "recent": None} for r in ranks}

    def take_live(self, ranks, roll_forward=None) -> dict:
        """Each rank that left hands over the step it finished (a test may say one failed)."""
        broken = getattr(self.cluster, "snapshot_errors", {})
        self.cluster.live_asked.append(tuple(ranks))
        return {r: ({"rank": r, "step": self.step, **({"error": broken[r]} if r in broken else {})}, f"files-{r}")
                for r in ranks}

    def drop_live(self, ranks) -> None:
        self.cluster.live_dropped.append(tuple(ranks))

    def shutdown(self, graceful_s: float = 5.0) -> None:
        self.kill(range(len(self.actors)))


class FakeCluster:
    """``nodes``: node id -> worker slots. ``script``: step -> actions run when the ranks
    finish that step (see the helpers below)."""

    def __init__(self, nodes: dict[str, int], clock: FakeClock, *, every_steps: int = 0, watch: bool = False):
        self.nodes, self.clock, self.every_steps = dict(nodes), clock, every_steps
        self.live_asked: list[tuple] = []  # the survivors asked for snapshots, per take_live
        self.live_dropped: list[tuple] = []  # the survivors told to drop their kept state
        self.alive = set(nodes)
        self.watch = watch
        self.actors: dict[str, FakeActor] = {}
        self.groups: list[FakeGroup] = []
        self.script: dict[int, list[Callable]] = {}
        self.notices: list[Notice] = []
        self.during_restore: list[Callable] = []  # one a second while the next restore waits (restore_s)
        self.on_release: list[Callable] = []  # run once, as the survivors of a failed attempt leave
        self.after_release: list[Callable] = []  # run once, when they have left
        self.committed = 0
        self.killed: list[FakeActor] = []
        self.releases: list[tuple] = []
        self.live_restores: list = []  # what each attempt's setup was given to restore live (None: a checkpoint)
        self.capacity_requests = 0
        self.checkpoint_requests: list[tuple[int, str]] = []  # (step, reason) of each request
        self.standbys_started = 0
        # A collective hang: the ranks answer but never finish this step (every attempt),
        # and what their flight records say (FakeGroup -> (records, silent ranks)).
        self.hang_at_step: Optional[int] = None
        self.flight: Optional[Callable] = None
        self.frozen_nodes: set[str] = set()  # up in the cluster's view; run nothing (freeze_node)
        self.slow_nodes: dict[str, float] = {}  # node -> seconds its ranks arrive late at each step (slow_node)
        self.probed: list[tuple[str, ...]] = []
        # Health checks: node -> the report its check gives now (default: as fast as the run's ranks).
        self.health: dict[str, dict] = {}
        self.health_checked: list[str] = []

    # the controller's view
    def topology(self) -> Topology:
        return Topology(tuple(NodeInfo(node_id=n, slots=s) for n, s in self.nodes.items() if n in self.alive))

    def alive_nodes(self) -> set[str]:
        return set(self.alive)

    def request_capacity(self) -> None:
        self.capacity_requests += 1

    def kill(self, actor) -> None:
        actor.alive = False
        self.killed.append(actor)

    @staticmethod
    def actor_id(actor) -> str:
        return actor.id

    def reservation(self) -> FakeReservation:
        return FakeReservation(self)

    def worker_group(self, plan, members) -> FakeGroup:
        group = FakeGroup(self, plan, members)
        self.groups.append(group)
        return group

    def standby_pool(self, reservation, plan_now) -> FakeStandbyPool:
        return FakeStandbyPool(self, reservation)

    def replica_keepers(self):
        return None  # no memory replicas in the fake cluster

    def preemption_watcher(self):
        return FakeWatcher(self) if self.watch else None

    def set_fail_at(self, actor, at_step: int, message: str) -> int:
        return 0

    def probe_nodes(self, nodes) -> dict[str, str]:
        self.probed.append(tuple(nodes))
        return {n: n for n in nodes}

    def unanswered(self, probes: dict[str, str], timeout_s: float) -> set[str]:
        silent = {n for n in probes if n in self.frozen_nodes or n not in self.alive}
        if silent:
            self.clock.sleep(timeout_s)
        return silent

    def check_health(self, expected_gpus: dict[str, int], start_at: Optional[float] = None) -> dict[str, str]:
        self.health_checked.extend(expected_gpus)
        return {n: n for n in expected_gpus}

    def health_reports(self, probes: dict[str, str]) -> dict[str, dict]:
        return {n: dict(self.health.get(n, {"gflops": FAKE_GFLOPS})) for n in probes if n in self.alive}

    # test helpers
    def new_actor(self, node: str) -> FakeActor:
        actor = FakeActor(node=node)
        self.actors[actor.id] = actor
        return actor

    def at(self, step: int, action: Callable[[FakeGroup], None]) -> None:
        self.script.setdefault(step, []).append(action)


def kill_rank(rank: int):
    return lambda group: group.cluster.kill(group.actors[rank])


def lose_node(node: str, *, forever: bool = True):
    def act(group):
        group.cluster.alive.discard(node)
        if forever:
            group.cluster.nodes.pop(node, None)
    return act


def freeze_rank(rank: int):
    def act(group):
        group.actors[rank].frozen = True
    return act


def freeze_node(node: str):
    """The whole machine stops answering: its ranks freeze, it runs nothing new, and the
    cluster still lists it (Ray's health check has not given up yet)."""
    def act(group):
        group.cluster.frozen_nodes.add(node)
        for actor in group.actors:
            if actor.node == node:
                actor.frozen = True
    return act


def raise_in_rank(rank: int, message: str, *, every_attempt: bool = False):
    """The rank's loop raises after this step (again in every attempt that reaches it)."""
    def act(group):
        group.failed[rank] = message
        if every_attempt:
            group.cluster.at(group.step, act)
    return act


def notice(node: str, seconds_left: float):
    def act(group):
        group.cluster.notices.append(Notice(node_id=node, deadline=group.cluster.clock.time() + seconds_left,
                                            source="test"))
    return act


def slow_node(node: str, late_s: float):
    """From now on ``node``'s ranks finish each step ``late_s`` after the others (0: healed)."""
    def act(group):
        group.cluster.slow_nodes[node] = late_s
    return act


def add_node(node: str, slots: int):
    def act(group):
        group.cluster.nodes[node] = slots
        group.cluster.alive.add(node)
    return act
