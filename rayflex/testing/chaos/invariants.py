"""What must hold after a chaos run, each check returning (ok, detail)."""

from __future__ import annotations

from typing import Optional

# How fast each kind of fault must be named, in seconds after it happened (sigstop: after
# the heartbeat timeout, which is added by the caller).
DETECTION_BOUND_S = {"kill_actor": 2.0, "remove_node": 5.0, "sigstop": 6.0, "preempt_long": 3.0,
                     "preempt_short": 3.0, "raise_once": 10.0, "corrupt_checkpoint": 60.0,
                     "s3_down": 10.0}  # RAYFLEX_STORAGE_STALL_S (5 s) + a flush interval


def all_steps_finished(result, steps: int, *, stopped: bool = False) -> tuple[bool, str]:
    """The run ended at ``steps`` with every step in its metrics once: ``finished`` at its
    target, or ``stopped`` there when the harness ended it (``stopped=True``)."""
    got = [m["step"] for m in result.metrics]
    status = "stopped" if stopped else "finished"
    ok = result.status == status and result.steps_completed == steps and got == list(range(1, steps + 1))
    return ok, f"status={result.status} (expected {status}) steps_completed={result.steps_completed}/{steps}, " \
               f"metrics steps {'1..%d once each' % steps if got == list(range(1, steps + 1)) else 'NOT 1..%d' % steps}"


def checkpoints_verify(root: str, corrupted: set[int]) -> tuple[bool, str]:
    """Every committed checkpoint verifies; the ones the run corrupted are no longer committed."""
    from rayflex.errors import CheckpointError
    from rayflex.storage import manifest as mf

    committed = mf.list_committed(root)
    bad = []
    for step in committed:
        try:
            mf.verify(root, step, deep=True)
        except CheckpointError as e:
            bad.append(f"step {step}: {e}")
    still = sorted(corrupted & set(committed))
    ok = bool(committed) and not bad and not still
    return ok, (f"{len(committed)} committed ({committed}) all verify" if ok else
                f"failed: {bad[:3]} corrupted still committed: {still}")


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
        for pos, idx in zip(positions, by_step[s]["indices"]):
            epoch = int(pos // n)
            if idx in seen.setdefault(epoch, set()):
                return False, f"row {idx} seen twice in epoch {epoch} (step {s})"
            seen[epoch].add(idx)
    complete = [e for e in seen if len(seen[e]) == n]
    return True, (f"{steps} steps, each its own {sampler.global_batch} rows; {len(seen)} epoch(s) touched, "
                  f"{len(complete)} complete with every row once")


def _match(fault: dict, events: list[dict], heartbeat_s: float) -> Optional[dict]:
    kind, t = fault["kind"], fault["time"]
    after = [e for e in events if e["time"] >= t - 0.5]
    if kind in ("kill_actor", "corrupt_checkpoint"):
        died = next((e for e in after if e["kind"] == "worker_died" and e["rank"] == fault["rank"]), None)
        if kind == "kill_actor" or died is None:
            return died
        loaded = next((e for e in after if e["kind"] == "checkpoint_loaded"
                       and any(f"step {fault['detail']['step']}:" in s for s in e.get("skipped", []))), None)
        return loaded and {**loaded, "worker_died": died}
    if kind == "remove_node":
        return next((e for e in after if (e["kind"] == "node_lost" and e["node_id"] == fault["node_id"]) or
                     (e["kind"] == "worker_died" and e["node_id"] == fault["node_id"])), None)
    if kind == "sigstop":
        return next((e for e in after if e["kind"] == "hang_detected" and fault["rank"] in e["ranks"]), None)
    if kind in ("preempt_long", "preempt_short"):
        action = "emergency_checkpoint" if kind == "preempt_long" else "restore_last_committed"
        return next((e for e in after if e["kind"] == "preemption_notice" and e["node_id"] == fault["node_id"]
                     and e["action"] == action), None)
    if kind == "s3_down":  # whichever notices first: the controller's run-directory writes or a save
        up = t + fault["detail"]["down_s"]
        return next((e for e in after if e["kind"] in ("storage_unavailable", "checkpoint_failed")
                     and e["time"] <= up + 30), None)
    if kind == "raise_once":
        return next((e for e in after if e["kind"] == "worker_failed" and e["rank"] == fault["rank"]
                     and fault["detail"]["message"] in e["error"]), None)
    raise ValueError(f"unknown fault kind {kind!r}")


def faults_accounted(faults: list[dict], events: list[dict], heartbeat_s: float) -> tuple[bool, list[dict]]:
    """For every injected fault: the event that named it, which detector, how fast."""
    rows, ok = [], True
    for f in faults:
        e = _match(f, events, heartbeat_s)
        row = {"index": f["index"], "kind": f["kind"], "rank": f.get("rank"), "node_id": (f.get("node_id") or "")[:8],
               "detected_by": e["kind"] if e else None,
               "after_s": round(e["time"] - f["time"], 3) if e else None}
        bound = DETECTION_BOUND_S.get(f["kind"])
        if f["kind"] == "sigstop":
            bound += heartbeat_s
        row["ok"] = e is not None and (bound is None or row["after_s"] <= bound)
        row["bound_s"] = bound
        ok &= row["ok"]
        rows.append(row)
    return ok, rows
