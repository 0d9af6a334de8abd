"""Injects a planned sequence of faults into a live run.

Sequential mode: the next fault goes in once the run has recovered from the previous
one: it is running at full size again, nothing is still scheduled (a node's return, the
object store coming back), and a checkpoint has committed since — so every fault hits a
healthy run and a failure never repeats without progress. Overlap mode (``overlap.py``):
every second fault instead lands in a seeded window of the recovery from the one before
it; the pair after that waits for a healthy run again. Node additions and removals happen
on the calling (main) thread; ``tick()`` is called from its loop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, Optional

from rayflex.telemetry import events as ev

log = logging.getLogger(__name__)


class InjectionLost(Exception):
    """A fault could not be put in: its target went away between the status read and the
    injection (a restart replaced the process, the node had just left). Nothing happened,
    so nothing is recorded; the fault is tried again once the run is healthy."""


@dataclass
class Injected:
    index: int
    kind: str
    time: float  # when the fault happened (epoch seconds)
    step: int  # the run's step then
    rank: Optional[int] = None
    node_id: Optional[str] = None
    detail: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class FaultTiming:
    long_notice_s: float = 15.0
    short_notice_s: float = 1.0
    node_return_s: float = 2.0  # a replacement node joins this long after one went
    # Longer than the storage retries ride out (a 4 s outage only delays a save), so a
    # save fails, is reported, and the next one must succeed.
    s3_down_s: float = 12.0
    min_steps_between: int = 10
    # A slow machine: its processes share this much of one core for this long (longer than
    # the straggler window and confirmation of a chaos run's SLOW_NODE_KNOBS, so the policy
    # weighs it while it is slow).
    slow_node_cores: float = 0.1
    slow_node_s: float = 40.0


class Injector:
    def __init__(self, cluster, handle, gate, kinds: list[str], seed: int, *, workers: int,
                 checkpoint_root: str, timing: FaultTiming = FaultTiming(),
                 corrupt: Optional[Callable[[str, int], str]] = None, steps: Optional[int] = None,
                 fault_log: Optional[str] = None, arm: Optional[Callable[[int, int, str], int]] = None,
                 mode: str = "sequential", growth: bool = False):
        from rayflex.testing.chaos.overlap import MODES, plan_overlaps

        if mode not in MODES:
            raise ValueError(f"injector mode {mode!r}: use one of {', '.join(MODES)}")
        self.cluster, self.handle, self.gate = cluster, handle, gate
        self.kinds = list(kinds)
        # Fault index -> the window of the previous fault's recovery it lands in.
        self.overlaps = plan_overlaps(seed, self.kinds, growth=growth) if mode == "overlap" else {}
        self._gone_nodes: set[str] = set()  # removed or drained: no longer a victim
        self.rng = random.Random(seed * 7919 + 1)  # targets: independent of the kind order
        self.workers = workers
        self.checkpoint_root = checkpoint_root
        self.timing = timing
        self._corrupt = corrupt
        self.injected: list[Injected] = []
        self.stopped_pids: list[int] = []  # SIGSTOPped: continued and killed at the end
        self._actions: list[tuple[float, str, Optional[str]]] = []  # (when, what, node)
        self._quiet_since = 0.0  # time of the last disturbance (fault, node change, s3 back)
        self._last_step_injected = 0
        # A fault this close to the end could not be recovered from and checked before the
        # run finishes (a corrupted checkpoint would stay the newest): it is left out, and
        # the report says how many went in.
        self.last_step = (steps - timing.min_steps_between) if steps else None
        # Where workers record an injected failure the moment they raise it
        # (RAYFLEX_FAULT_LOG): the ground truth of whether a raise_once took effect.
        self.fault_log = fault_log
        self._armed: Optional[Injected] = None  # a raise_once that has not fired yet
        self._arm_call = arm or self._arm_through_controller
        self._armed_at = 0.0
        self._throttles: dict[str, contextlib.ExitStack] = {}  # slow nodes: node -> its quota

    @property
    def done(self) -> bool:
        return len(self.injected) == len(self.kinds) and not self._actions and self._armed is None

    # ----------------------------------------------------------------- loop
    def tick(self) -> None:
        now = time.time()
        for action in [a for a in self._actions if a[0] <= now]:
            self._actions.remove(action)
            self._act(action[1], action[2])
        if self._armed is not None:
            self._follow_armed()
        elif len(self.injected) < len(self.kinds):
            overlap = self.overlaps.get(len(self.injected))
            if overlap is not None:
                self._overlap(overlap.window)
            elif not self._actions:
                status = self.handle.status()
                if self._healthy(status):
                    self._inject(self.kinds[len(self.injected)], status)

    def _overlap(self, window: str) -> None:
        """Put the next fault in once the recovery from the last one reaches ``window``; if
        the recovery is over before it does (a quick restart skips a window it polls too
        slowly to see), put it in anyway and record that it did not overlap."""
        from rayflex.testing.chaos.overlap import phase_of, window_over

        first = self.injected[-1]
        status = self.handle.status()
        events = ev.Timeline.from_dicts(self.handle.events())
        restarts = [e for e in events.of(ev.Restarted) if e.time >= first.time - 0.5]
        loaded = [e for e in events.of(ev.CheckpointLoaded) if e.time >= first.time - 0.5]
        phase = phase_of(status, restart_step=loaded[-1].step if loaded else None, restarted=bool(restarts),
                         store_down=self.gate is not None and not self.gate.is_up)
        since = time.time() - first.time
        hit = phase == window or (window == "at_once" and since <= 1.0)
        if hit or window_over(window, phase, since_s=since, restart_reasons=[e.reason for e in restarts]):
            self._inject(self.kinds[len(self.injected)], status,
                         overlap={"window": window, "phase": "at_once" if hit and window == "at_once" else phase,
                                  "overlapped": hit, "after_previous_s": round(since, 2)})

    def settled(self) -> bool:
        """Every planned fault is in, has taken effect, and the run has recovered from the
        last one (full size, a commit since, ``min_steps_between`` steps on): nothing is
        left to learn from training further."""
        return self.done and len(self.kinds) > 0 and self._healthy(self.handle.status())

    def _follow_armed(self) -> None:
        """An armed raise_once either fired (the fault's time becomes the moment the rank
        raised, so detection is timed from the real fault), or a restart renumbered the
        ranks first and took the arming with it: then it is armed again, on the new
        attempt, once the run is healthy. Only the workers' own record says it fired, so
        a raise the controller missed still shows as undetected."""
        fault = self._armed
        fired = self._fired(fault.detail["message"])
        if fired is not None:
            fault.time, fault.step, fault.rank = fired["time"], fired["step"], fired["rank"]
            fault.detail["fired_at_step"] = fired["step"]
            self._quiet_since = max(self._quiet_since, fired["time"])
            self._armed = None
            log.warning("chaos fault %d: rank %d raised at step %d", fault.index + 1, fired["rank"], fired["step"])
            return
        lost = fault.detail.get("arm_failed") or any(e.time > self._armed_at for e in self._events(ev.Restarted))
        if not lost:
            return
        status = self.handle.status()
        if self._healthy(status, after=self._armed_at):
            fault.detail["rearmed"] = fault.detail.get("rearmed", 0) + 1
            log.warning("chaos fault %d: raise_once did not take (a restart came first, or arming failed: %s); "
                        "arming it again", fault.index + 1, fault.detail.get("arm_failed", "restarted"))
            self._arm(fault, sorted(status["workers"], key=lambda w: w["rank"]), status["step"])

    def _fired(self, message: str) -> Optional[dict]:
        import json

        try:
            with open(self.fault_log) as f:
                lines = [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return None
        return next((r for r in lines if r["message"] == message), None)

    def _events(self, cls: type[ev.Event]) -> list[ev.Event]:
        """The run's events of one class, as the controller has them now."""
        return ev.Timeline.from_dicts(self.handle.events()).of(cls)

    def _healthy(self, status: dict, after: Optional[float] = None) -> bool:
        """Running at full size, far enough from the last fault and from the end, with a
        checkpoint committed since the last restart. ``after`` (re-arming): only that."""
        if status.get("state") != "RUNNING" or status.get("world_size") != self.workers:
            return False
        if len(status.get("workers") or []) != self.workers:
            return False
        if self.last_step is not None and status["step"] > self.last_step:
            return False
        if after is None and status["step"] < self._last_step_injected + self.timing.min_steps_between:
            return False
        events = ev.Timeline.from_dicts(self.handle.events())
        last_restart = max((e.time for e in events.of(ev.Restarted)), default=0.0)
        committed = [e.time for e in events.of(ev.CheckpointCommitted)]
        since = max(last_restart, self._quiet_since if after is None else after)
        return any(t > since for t in committed)

    def _act(self, what: str, node: Optional[str]) -> None:
        if what == "remove":
            self.cluster.remove_node(node)
        elif what == "add":
            self.cluster.add_node()
        elif what == "s3_up":
            self.gate.up()
        elif what == "unthrottle":
            self._throttles.pop(node).close()
        log.info("chaos: %s %s", what, (node or "")[:8])
        self._quiet_since = time.time()

    # ----------------------------------------------------------------- faults
    def _inject(self, kind: str, status: dict, overlap: Optional[dict] = None) -> None:
        workers = sorted(status.get("workers") or [], key=lambda w: w["rank"])
        fault = Injected(index=len(self.injected), kind=kind, time=0.0, step=status.get("step", 0),
                         detail={"overlap": overlap} if overlap else {})
        try:
            getattr(self, f"_{kind}")(fault, workers)
        except InjectionLost as e:
            log.warning("chaos fault %d/%d (%s) did not go in: %s; trying again", fault.index + 1,
                        len(self.kinds), kind, e)
            return
        if not fault.time:
            fault.time = time.time()
        self._quiet_since = max(self._quiet_since, fault.time)
        self._last_step_injected = status["step"]
        self.injected.append(fault)
        log.warning("chaos fault %d/%d at step %d: %s rank=%s node=%s %s", fault.index + 1, len(self.kinds),
                    fault.step, kind, fault.rank, (fault.node_id or "")[:8], fault.detail or "")

    def _victim(self, fault: Injected, workers: list[dict]) -> dict:
        workers = [w for w in workers if w.get("pid") and w["node_id"] not in self._gone_nodes]
        if not workers:  # between attempts (an overlapping fault): no process to hit yet
            raise InjectionLost("no live worker process listed")
        w = self.rng.choice(workers)
        fault.rank, fault.node_id = w["rank"], w["node_id"]
        return w

    def _victim_node(self, fault: Injected, workers: list[dict]) -> str:
        """A node (not the head: it hosts the driver) that runs at least one rank."""
        nodes = sorted({w["node_id"] for w in workers} - {self.cluster.head_id} - self._gone_nodes)
        if not nodes:  # a node fault there would hit no rank: wait for a layout where it does
            raise InjectionLost("no node but the head runs a rank")
        fault.node_id = self.rng.choice(nodes)
        fault.detail["ranks"] = [w["rank"] for w in workers if w["node_id"] == fault.node_id]
        return fault.node_id

    @staticmethod
    def _signal(pid: int, sig: int) -> None:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            raise InjectionLost(f"process {pid} is already gone") from None

    def _kill_actor(self, fault: Injected, workers: list[dict]) -> None:
        self._signal(self._victim(fault, workers)["pid"], signal.SIGKILL)

    def _sigstop(self, fault: Injected, workers: list[dict]) -> None:
        pid = self._victim(fault, workers)["pid"]
        self._signal(pid, signal.SIGSTOP)
        self.stopped_pids.append(pid)

    def _remove_node(self, fault: Injected, workers: list[dict]) -> None:
        node = self._victim_node(fault, workers)
        fault.time = time.time()
        if not self.cluster.remove_node(node):
            raise InjectionLost(f"node {node[:8]} had already left")
        self._gone_nodes.add(node)
        self._actions.append((time.time() + self.timing.node_return_s, "add", None))

    def _preempt(self, fault: Injected, workers: list[dict], notice_s: float) -> None:
        node = self._victim_node(fault, workers)
        fault.time = time.time()
        try:
            deadline = self.cluster.drain(node, notice_s)
        except RuntimeError as e:  # Ray refused the drain: the node is leaving already
            raise InjectionLost(str(e)) from None
        self._gone_nodes.add(node)
        fault.detail["deadline_s"] = notice_s
        self._actions += [(deadline, "remove", node), (deadline + self.timing.node_return_s, "add", None)]

    def _preempt_long(self, fault: Injected, workers: list[dict]) -> None:
        """A notice long enough for an emergency checkpoint *on this machine now*: the run
        says how much it needs (a step + its recent save time + the margin), and under a
        loaded CI machine that can exceed ``long_notice_s``; a shorter notice would make the
        controller (rightly) restore the last commit instead, and the fault would test the
        short-notice path twice and this one never."""
        needed = float(self.handle.status().get("emergency_notice_s") or 0.0)
        notice = max(self.timing.long_notice_s, 1.5 * needed + 1.0)
        fault.detail["needed_s"] = round(needed, 2)
        self._preempt(fault, workers, notice)

    def _preempt_short(self, fault: Injected, workers: list[dict]) -> None:
        self._preempt(fault, workers, self.timing.short_notice_s)

    def _s3_down(self, fault: Injected, workers: list[dict]) -> None:
        fault.time = time.time()
        self.gate.down()
        fault.detail["down_s"] = self.timing.s3_down_s
        self._actions.append((time.time() + self.timing.s3_down_s, "s3_up", None))

    def _slow_node(self, fault: Injected, workers: list[dict]) -> None:
        """A machine turned slow: its raylet and every process it started (ranks, and the
        workers it starts later) share ``slow_node_cores`` of a core for ``slow_node_s``."""
        from rayflex.testing.throttle import cpu_throttled

        node = self._victim_node(fault, workers)
        try:
            pids = self.cluster.processes(node)
        except (StopIteration, KeyError, ProcessLookupError) as e:
            raise InjectionLost(f"node {node[:8]} is not listed any more ({type(e).__name__})") from None
        stack = contextlib.ExitStack()
        stack.enter_context(cpu_throttled(pids, self.timing.slow_node_cores, name="rayflex_chaos_slow"))
        self._throttles[node] = stack
        fault.time = time.time()
        fault.detail.update(cores=self.timing.slow_node_cores, slow_s=self.timing.slow_node_s)
        self._actions.append((fault.time + self.timing.slow_node_s, "unthrottle", node))

    def _raise_once(self, fault: Injected, workers: list[dict]) -> None:
        fault.detail["message"] = f"chaos: injected failure {fault.index}"
        self._arm(fault, workers, fault.step)

    def _arm_through_controller(self, rank: int, at_step: int, message: str) -> int:
        import ray

        return ray.get(self.handle.controller.inject_failure.remote(rank, at_step, message), timeout=60)

    def _arm(self, fault: Injected, workers: list[dict], step: int) -> None:
        """Arm the victim to raise at the next step it starts. If the call does not get
        through (a restart began meanwhile), the next tick sees the restart and re-arms."""
        w = self._victim(fault, workers)
        fault.step, fault.time = step, time.time()
        fault.detail["at_step"] = step + 1
        self._armed, self._armed_at = fault, time.time()
        fault.detail.pop("arm_failed", None)
        try:
            fault.detail["rank_step"] = self._arm_call(w["rank"], step + 1, fault.detail["message"])
        except Exception as e:  # noqa: BLE001 - the attempt ended under the call: re-armed
            fault.detail["arm_failed"] = f"{type(e).__name__}: {e}"[:200]
            log.warning("chaos: arming raise_once on rank %d failed (%s); it is armed again after the restart",
                        w["rank"], e)

    def _corrupt_checkpoint(self, fault: Injected, workers: list[dict]) -> None:
        """Kill a worker, then flip a byte in the newest committed checkpoint before the
        restart loads it (killing first: a broken attempt commits nothing newer)."""
        self._signal(self._victim(fault, workers)["pid"], signal.SIGKILL)
        fault.time = time.time()
        deadline = time.time() + 5
        while time.time() < deadline and not any(e.time >= fault.time - 0.5 for e in self._events(ev.WorkerDied)):
            time.sleep(0.02)
        from rayflex.checkpoint import manifest as mf

        step = mf.latest_committed(self.checkpoint_root)
        fault.detail["step"] = step
        fault.detail["file"] = self._corrupt(self.checkpoint_root, step)

    # ----------------------------------------------------------------- cleanup
    def cleanup(self) -> None:
        for pid in self.stopped_pids:
            if not _is_ray_worker(pid):  # already gone (the controller killed it); the pid may be reused
                continue
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    break
        if self.gate is not None and not self.gate.is_up:
            self.gate.up()
        for stack in self._throttles.values():
            stack.close()
        self._throttles.clear()


def _is_ray_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"ray" in f.read()
    except OSError:
        return False


def corrupt_newest_file(root: str, step: int) -> str:
    """Flip one byte in the middle of the largest data file of checkpoint ``step``."""
    from rayflex.storage import fs as rfs
    from rayflex.checkpoint.manifest import step_dir

    fs, path = rfs.resolve(step_dir(root, step))
    fs.invalidate_cache()
    files = [f for f in fs.find(path, detail=True).values() if f["name"].endswith(".distcp")]
    target = max(files, key=lambda f: f["size"])["name"]
    with fs.open(target, "rb") as f:
        data = bytearray(f.read())
    data[len(data) // 2] ^= 0xFF
    with fs.open(target, "wb") as f:
        f.write(bytes(data))
    return target
