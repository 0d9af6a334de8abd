"""What must hold after a chaos run, each check returning (ok, detail)."""

from __future__ import annotations

from typing import Callable, Optional, Union

from rayflex.telemetry import events as ev
from rayflex.testing.chaos.bounds import DetectionTiming, bound_s

def all_steps_finished(result, steps: int, *, stopped: bool = False) -> tuple[bool, str]:
    """The run ended at ``steps`` with every step in its metrics once: ``finished`` at its
    target, or ``stopped`` there when the harness ended it (``stopped=True``)."""
    got = [m["step"] for m in result.metrics]
    status = "stopped" if stopped else "finished"
    ok = result.status == status and result.steps_completed == steps and got == list(range(1, steps + 1))
    return ok, f"status={result.status} (expected {status}) steps_completed={result.steps_completed}/{steps}, " \
               f"metrics steps {'1..%d once each' % steps if got == list(range(1, steps + 1)) else 'NOT 1..%d' % steps}"


def checkpoints_verify(root: str, corrupted: dict[int, float]) -> tuple[bool, str]:
    """Every committed checkpoint verifies; the ones the run corrupted (step -> when) are no
    longer committed — unless the run trained that step again and committed it anew after
    the corruption (an overlap run that went back past it), which then verifies too."""
    from datetime import datetime

    from rayflex.errors import CheckpointError
    from rayflex.checkpoint import manifest as mf

    committed = mf.list_committed(root)
    bad = []
    for step in committed:
        try:
            mf.verify(root, step, deep=True)
        except CheckpointError as e:
            bad.append(f"step {step}: {e}")
    still, again = [], []
    for step in sorted(set(corrupted) & set(committed)):
        made = datetime.fromisoformat(mf.read_manifest(root, step).created_at).timestamp()
        (again if made > corrupted[step] else still).append(step)
    ok = bool(committed) and not bad and not still
    anew = f"; re-committed after their corruption: {again}" if again else ""
    return ok, (f"{len(committed)} committed ({committed}) all verify{anew}" if ok else
                f"failed: {bad[:3]} corrupted still committed: {still}")


def stragglers_only_on_slow_nodes(events: list[ev.Event], faults: list[dict]) -> tuple[bool, str]:
    """A straggler is named or weighed only on a node a ``slow_node`` fault slowed, after it
    did. No other chaos kind slows a rank for long (a SIGSTOP freezes one: a hang), so any
    other is a false positive of the straggler signal, e.g. a rank held up by a shared CPU."""
    slowed = {f["node_id"]: f["time"] for f in faults if f["kind"] == "slow_node"}
    named = [e for e in events if isinstance(e, (ev.StragglerDetected, ev.StragglerDecided))]
    wrong = [e for e in named if not (e.node_id in slowed and e.time >= slowed[e.node_id] - 0.5)]
    if wrong:
        return False, "false positives: " + "; ".join(e.describe()[:200] for e in wrong[:3])
    if slowed:
        return True, f"{len(named)} straggler events, all on the slowed node(s) after they slowed"
    return True, "no straggler named or weighed"


def samples_exact(samples: list[dict], sampler, steps: int) -> tuple[bool, str]:
    """Each step consumed exactly its global batch of the seeded stream (so after every
    restart the stream continued where the committed step left it), and no row was seen
    twice within an epoch or skipped."""
    import numpy as np

    by_step = {}
    for line in samples:
        by_step[line["step"]] = line  # a rolled-back step's line is replaced by its re-run
    if sorted(by_step) != list(range(1, steps + 1)):
        missing = sorted(set(range(1, steps + 1)) - set(by_step))
        return False, f"samples.jsonl misses steps {missing[:10]}"
    wrong = [s for s in range(1, steps + 1) if by_step[s]["indices"] != sampler.indices(s - 1).tolist()]
    if wrong:
        return False, f"steps {wrong[:10]} consumed other rows than the stream's"
    seen: dict[int, set] = {}
    n = sampler.num_samples
    for s in range(1, steps + 1):
        positions = np.arange((s - 1) * sampler.global_batch, s * sampler.global_batch)
        # The line lists the step's rows in dataset order (each rank's share in turn); the
        # stream order says which epoch each belongs to.
        for pos, idx in zip(positions, sampler.step_rows(s - 1).tolist()):
            epoch = int(pos // n)
            if idx in seen.setdefault(epoch, set()):
                return False, f"row {idx} seen twice in epoch {epoch} (step {s})"
            seen[epoch].add(idx)
    complete = [e for e in seen if len(seen[e]) == n]
    return True, (f"{steps} steps, each its own {sampler.global_batch} rows; {len(seen)} epoch(s) touched, "
                  f"{len(complete)} complete with every row once")


def _kill_actor(fault: dict, after: list[ev.Event]) -> Optional[ev.Event]:
    """Ray's death notice (``worker_died``) — or, when Ray is slower to propagate the death
    than the heartbeat timeout (seen under a fully loaded CI machine: no notice within 3 s),
    the heartbeat naming the rank unresponsive: to the controller a killed process whose
    death Ray has not reported is a silent one, and it is named and replaced as such (the
    bound then includes the heartbeat timeout, as for a frozen process)."""
    return next((e for e in after if (isinstance(e, ev.WorkerDied) and e.rank == fault["rank"])
                 or (isinstance(e, ev.HangDetected) and fault["rank"] in e.ranks
                     and e.phases.get(str(fault["rank"])) == "unresponsive")), None)


def _corrupt_checkpoint(fault: dict, after: list[ev.Event]) -> Optional[ev.Event]:
    """The restart after the kill skipped the corrupted step's checkpoint — or read none:
    it resumed from the survivors' memory (live recovery), and the corrupted step, never
    loaded, must then be gone by the end (``checkpoints_verify``)."""
    if _kill_actor(fault, after) is None:
        return None
    chosen = next((e for e in after if isinstance(e, ev.RecoveryChosen)), None)
    if chosen is not None and chosen.source == "live_peers":
        return chosen
    skipped = f"step {fault['detail']['step']}:"
    return next((e for e in after if isinstance(e, ev.CheckpointLoaded)
                 and any(skipped in s for s in e.skipped)), None)


def _remove_node(fault: dict, after: list[ev.Event]) -> Optional[ev.Event]:
    return next((e for e in after if isinstance(e, (ev.NodeLost, ev.WorkerDied))
                 and e.node_id == fault["node_id"]), None)


def _sigstop(fault: dict, after: list[ev.Event]) -> Optional[ev.Event]:
    return next((e for e in after if isinstance(e, ev.HangDetected) and fault["rank"] in e.ranks), None)


def _preemption(action: str) -> Callable[[dict, list[ev.Event]], Optional[ev.Event]]:
    """The notice acted on as its length says, or, when it came while the run was already
    restarting (overlap mode), its node left out of the next placement."""
    def match(fault: dict, after: list[ev.Event]) -> Optional[ev.Event]:
        return next((e for e in after if isinstance(e, ev.PreemptionNotice) and e.node_id == fault["node_id"]
                     and e.action in (action, "excluded_from_placement")), None)
    return match


def _s3_down(fault: dict, after: list[ev.Event]) -> Optional[ev.Event]:
    """Whichever notices first: the controller's run-directory writes or a save."""
    up = fault["time"] + fault["detail"]["down_s"]
    return next((e for e in after if isinstance(e, (ev.StorageUnavailable, ev.CheckpointFailed))
                 and e.time <= up + 30), None)


def _slow_node(fault: dict, after: list[ev.Event]) -> Optional[ev.Event]:
    return next((e for e in after if isinstance(e, ev.StragglerDetected) and e.node_id == fault["node_id"]), None)


def _raise_once(fault: dict, after: list[ev.Event]) -> Optional[ev.Event]:
    return next((e for e in after if isinstance(e, ev.WorkerFailed) and e.rank == fault["rank"]
                 and fault["detail"]["message"] in e.error), None)


# Fault kind -> the event that names the fault (None: not detected).
_DETECTED_BY = {"kill_actor": _kill_actor, "corrupt_checkpoint": _corrupt_checkpoint, "remove_node": _remove_node,
               "sigstop": _sigstop, "preempt_long": _preemption("emergency_checkpoint"),
               "preempt_short": _preemption("restore_last_committed"), "s3_down": _s3_down,
               "raise_once": _raise_once, "slow_node": _slow_node}


def _match(fault: dict, events: list[ev.Event]) -> Optional[ev.Event]:
    matcher = _DETECTED_BY.get(fault["kind"])
    if matcher is None:
        raise ValueError(f"unknown fault kind {fault['kind']!r}")
    return matcher(fault, [e for e in events if e.time >= fault["time"] - 0.5])


def _about_target(fault: dict, events: list[ev.Event], limit: int = 4) -> list[str]:
    """The first events after a fault that name its rank or node."""
    node, rank = fault.get("node_id"), fault.get("rank")
    about = [e for e in events if e.time >= fault["time"] - 0.5
             and ((node and getattr(e, "node_id", None) == node)
                  or (rank is not None and (getattr(e, "rank", None) == rank or rank in (getattr(e, "ranks", None) or []))))]
    return [f"+{e.time - fault['time']:.1f}s {e.describe()}"[:300] for e in about[:limit]]


def _decisions(fault: dict, events: list[ev.Event]) -> list[dict]:
    """The straggler policy's weighings of a slowed node and its health checks after."""
    return [{"after_s": round(e.time - fault["time"], 2), "event": e.kind.value, "action": e.action,
             "reason": e.reason[:160]} for e in events
            if isinstance(e, (ev.StragglerDecided, ev.NodeHealthChecked)) and e.node_id == fault["node_id"]
            and e.time >= fault["time"]]


def _recovered_after(fault: dict, named: ev.Event, events: list[ev.Event]) -> Optional[float]:
    """Seconds from the fault to the end of its recovery: the restart that followed its
    detection (an outage that restarted nothing: the store answering again)."""
    kinds = (ev.Restarted, ev.StorageRecovered) if fault["kind"] == "s3_down" else (ev.Restarted,)
    done = next((e for e in events if isinstance(e, kinds) and e.time >= named.time), None)
    return round(done.time - fault["time"], 3) if done is not None else None


def faults_accounted(faults: list[dict], events: list[Union[ev.Event, dict]],
                     timing: DetectionTiming) -> tuple[bool, list[dict]]:
    """For every injected fault: the event that named it, which detector, how fast, and the
    bound it had to meet (``bounds.bound_s``: the detector's knobs, the run's step time)."""
    events = ev.as_events(events)
    rows, ok = [], True
    for f in faults:
        e = _match(f, events)
        row = {"index": f["index"], "kind": f["kind"], "rank": f.get("rank"), "node_id": (f.get("node_id") or "")[:8],
               "detected_by": e.kind.value if e else None,
               "after_s": round(e.time - f["time"], 3) if e else None}
        bound = bound_s(f, e, events, timing)
        row["ok"] = e is not None and row["after_s"] <= bound
        row["recovered_after_s"] = _recovered_after(f, e, events) if e is not None else None
        row["bound_s"] = bound
        if e is None:  # what the run did say about the target: a missed fault or a different path
            row["seen"] = _about_target(f, events)
        if f["kind"] == "slow_node":  # what the run decided about the slow machine
            row["decisions"] = _decisions(f, events)
        ok &= row["ok"]
        rows.append(row)
    return ok, rows
