"""StepLedger: what the run has done, folded from the ranks' poll answers.

A step counts once every rank of the attempt reported it; its metrics line (loss, step
time, throughput, per-stage activation peaks and pipeline waits) is then written, and the
detector hears the step time and each rank's wait at the end-of-step all-reduce (the
straggler signal). Rank 0's checkpoint reports become commit/failure events.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
from typing import Any, Optional

from rayflex.config import CheckpointConfig, DataConfig
from rayflex.constants import knob
from rayflex.telemetry import events as ev



def replicate_tier(recs) -> dict:
    """The metrics line's view of the replicate tier (``CommConfig``), where it was crossed:
    bytes every rank sent over it, DiLoCo fragments synchronised, and the norm of what int8
    rounding still owes over all ranks."""
    recs = list(recs)
    out: dict = {}
    sent = sum(r.replicate_bytes for r in recs)
    if sent:
        out["replicate_bytes"] = sent
    synced = max((r.outer_synced for r in recs), default=0)
    if synced:
        out["outer_synced"] = synced
    owed = [r.residual_norm for r in recs if r.residual_norm is not None]
    if owed:
        out["residual_norm"] = math.sqrt(sum(n * n for n in owed))
    return out


def sent_by_tier(recs) -> dict:
    """Bytes every rank sent in the step, by process-group role: each tier's traffic (inside a
    replica, between replicas, between pipeline stages, the step's control all-reduce)."""
    total: dict[str, int] = {}
    for r in recs:
        for role, n in (r.sent_bytes or {}).items():
            total[role] = total.get(role, 0) + n
    return {"sent_bytes": dict(sorted(total.items()))} if total else {}

class StepLedger:
    def __init__(self, data: DataConfig, checkpoint: CheckpointConfig, recorder):
        self.data, self.checkpoint, self.recorder = data, checkpoint, recorder
        self.step = 0  # the last step every rank finished
        self.start_step = 0
        self.committed_step = 0
        self.last_checkpoint: Optional[dict] = None
        self.checkpoint_seconds: list[float] = []
        self._saves: list[tuple[int, float, float]] = []  # (step, blocked_s, total_s) of recent commits
        # What each save cost training, measured once, when the steps beside its upload are
        # all in: save step -> seconds. Kept across attempts; a save measured after a restart
        # would find none of its neighbours and look free.
        self._save_costs: dict[int, float] = {}
        # Memory replicas: how long recent saves took until every shard was in memory on
        # another node, and an emergency save whose keepers upload it (the controller commits).
        self.replication_seconds: list[float] = []
        self.handed_off: Optional[dict] = None
        self.first_step_at: Optional[float] = None
        self._pending: dict[int, dict[int, Any]] = {}
        self._plan = None  # the mesh of the attempt whose records are pending
        self._metrics: list[dict] = []
        self._lock = threading.Lock()

    # ----------------------------------------------------------------- reading
    def metrics(self, since_step: int = 0) -> list[dict]:
        with self._lock:
            return [m for m in self._metrics if m["step"] > since_step]

    def last_metrics(self) -> dict:
        with self._lock:
            return self._metrics[-1] if self._metrics else {}

    def checkpoint_estimate_s(self) -> float:
        """How long an emergency checkpoint takes, from this run's recent saves."""
        if self.checkpoint_seconds:
            return statistics.median(self.checkpoint_seconds[-5:])
        return knob("EMERGENCY_CHECKPOINT_DEFAULT_S")

    def step_time_estimate_s(self) -> float:
        """A step's time in this attempt (median of its recent lines; 1 s before any)."""
        with self._lock:
            times = [m["step_time_s"] for m in self._metrics[-20:] if m["step"] > self.start_step]
        return statistics.median(times) if times else 1.0

    def training_s_since(self, step: int) -> float:
        """Seconds this attempt has trained since the end of ``step`` (or since its own
        first step): the work a failure now would lose."""
        with self._lock:
            lines = [m for m in self._metrics[-2000:] if m["step"] > max(step, self.start_step)]
        if not lines:
            return 0.0
        return lines[-1]["time"] - (lines[0]["time"] - lines[0]["step_time_s"])

    def save_total_s(self) -> list[float]:
        """How long each recent save took in all (its upload included)."""
        return [total for _, _, total in self._saves]

    def save_costs_s(self) -> list[float]:
        """The training time each recent save cost: what it blocked, plus how much longer
        than the median step the steps beside its upload took (an asynchronous upload
        shares the host's cores, memory bandwidth and links with training). A step's time
        never includes the blocked copy: the save runs between two steps. Only saves whose
        upload window this ledger saw close count (a restart that cut one short, or a
        commit reported after its attempt ended, leaves that save unmeasured)."""
        self._measure_saves()
        return [self._save_costs[step] for step, _, _ in self._saves if step in self._save_costs][-5:]

    def _measure_saves(self) -> None:
        """Freeze the cost of every save whose upload window closed in this attempt."""
        with self._lock:
            recent = [m for m in self._metrics[-200:] if m["step"] > self.start_step]
        if not recent:
            return
        lines = {m["step"]: m for m in recent}
        median = statistics.median(m["step_time_s"] for m in recent[-50:])
        for step, blocked, total in self._saves:
            ended = lines.get(step, {}).get("time")
            if step not in self._save_costs and ended is not None and recent[-1]["time"] >= ended + total:
                self._save_costs[step] = blocked + steps_excess_s(lines, step + 1, ended + total, median)
        kept = {step for step, _, _ in self._saves}
        for step in [s for s in self._save_costs if s not in kept]:
            del self._save_costs[step]

    def emergency_save_estimate_s(self) -> float:
        """How long an emergency save keeps a leaving node: with memory replicas (once a
        save measured it), until its shards are in memory on nodes that stay (their
        keepers upload them afterwards); else the whole checkpoint."""
        if self.checkpoint.memory_replicas and self.replication_seconds:
            return statistics.median(self.replication_seconds[-5:])
        return self.checkpoint_estimate_s()

    def emergency_notice_s(self, margin_s: float) -> float:
        """The notice a spot preemption must give for an emergency checkpoint: finish the
        step under way, save, and keep ``margin_s`` spare."""
        return self.step_time_estimate_s() + self.emergency_save_estimate_s() + margin_s

    # ----------------------------------------------------------------- writing
    def resume(self, lines: list[str]) -> int:
        """The metric lines of an earlier run of this name; returns the last step they reached."""
        self._metrics = [json.loads(line) for line in lines]
        return self._metrics[-1]["step"] if self._metrics else 0

    def restored(self, step: int, recovered: Optional[list[dict]] = None, committed: bool = True,
                 sample_rows: Optional[dict] = None) -> int:
        """An attempt starts at ``step``; lines past it belong to a rolled-back timeline
        and are rewritten. Returns how many steps were lost.

        Steps up to ``step`` that not every rank of the last attempt had reported when it
        ended (a fault between a checkpoint's commit and the next poll) are in the restored
        state, so they are never trained again: their lines are written from the ranks that
        did report (the loss, grad norm and LR are agreed over every rank; ``ranks_reported``
        says how many did), and where no rank had (every rank died before the poll), from
        ``recovered``: the metrics the checkpoint carries of its last steps (rank 0's,
        ``ranks_reported`` 0, ``from_checkpoint``). ``committed``: ``step`` came from a
        checkpoint (a live recovery's step is not committed until its own save is).
        ``sample_rows``: step -> its rows over every dp rank (the survivors' snapshots), for
        a step some rank finished but never reported."""
        # Only after an attempt of this controller's own: a run resumed by name starts with
        # the earlier job's lines already written (its checkpoint carries steps of those).
        by_step = {r["step"]: r for r in recovered or []} if self._plan is not None else {}
        while self.step < step:
            if (self.step + 1) in self._pending and self._plan is not None:
                self._finish_step(self._pending.pop(self.step + 1), self._plan, None,
                                  rows=(sample_rows or {}).get(self.step + 1))
            elif (self.step + 1) in by_step:
                self._recovered_step(by_step[self.step + 1], rows=(sample_rows or {}).get(self.step + 1))
            else:
                break
        self._measure_saves()  # the ending attempt's steps are about to leave the window
        self.step = self.start_step = step
        if committed:
            self.committed_step = max(self.committed_step, step)
        with self._lock:
            rolled_back = [m for m in self._metrics if m["step"] > step]
            self._metrics = [m for m in self._metrics if m["step"] <= step]
        if rolled_back:
            for name in ("metrics.jsonl", "samples.jsonl"):
                self.recorder.rundir.rewrite(name, lambda line: line["step"] <= step)
        self._pending.clear()
        return len(rolled_back)

    def absorb(self, rank: int, status, plan, detector) -> None:
        """Fold one rank's poll answer in; every step all ranks reported becomes a line."""
        self._plan = plan
        for rec in status.records:
            self._pending.setdefault(rec.step, {})[rank] = rec
        if rank == 0:
            for ck in status.checkpoints:
                self._checkpoint(ck)
        while (self.step + 1) in self._pending and len(self._pending[self.step + 1]) == plan.world_size:
            self._finish_step(self._pending.pop(self.step + 1), plan, detector)

    def _checkpoint(self, ck: dict) -> None:
        if ck.get("replicated_s") is not None:
            self.replication_seconds.append(ck.get("blocked_s", 0.0) + ck["replicated_s"])
            del self.replication_seconds[:-8]
        if ck.get("deferred"):
            self.recorder.record(ev.CheckpointDeferred(step=ck["step"], behind_step=ck.get("behind_step"),
                                                       reason=ck.get("reason", "periodic")))
        elif ck.get("handed_off"):
            self.handed_off = ck  # committed by the controller (control.handoff), or never
        else:
            self.checkpoint_done(ck)

    def checkpoint_done(self, ck: dict) -> None:
        """A save ended (rank 0's report, or the controller's for a handed-off one)."""
        if ck.get("committed"):
            self.last_checkpoint = {"step": ck["step"], "uri": ck.get("uri")}
            self.committed_step = max(self.committed_step, ck["step"])
            self.checkpoint_seconds.append(ck.get("blocked_s", 0.0) + ck.get("total_s", 0.0))
            self._saves.append((ck["step"], ck.get("blocked_s", 0.0), ck.get("total_s", 0.0)))
            del self._saves[:-8]
            self.recorder.record(ev.CheckpointCommitted(step=ck["step"], uri=ck.get("uri", ""),
                                                        blocked_s=ck.get("blocked_s", 0.0),
                                                        total_s=ck.get("total_s", 0.0), bytes=ck.get("bytes", 0),
                                                        reason=ck.get("reason", ""), upload=ck.get("upload", ""),
                                                        due_step=ck.get("due_step")))
        elif ck.get("error"):
            self.recorder.record(ev.CheckpointFailed(step=ck.get("step"), reason=ck["error"]))

    def _recovered_step(self, rec: dict, rows: Optional[list] = None) -> None:
        step_time = rec["step_time_s"]
        line = {"step": rec["step"], "loss": rec["loss"], "step_time_s": step_time,
                "tokens_per_s": rec["samples"] * self.data.seq_len / step_time if step_time > 0 else None,
                "lr": rec["lr"], "grad_norm": rec["grad_norm"], "world_size": rec["world_size"],
                "ranks_reported": 0, "from_checkpoint": True, "time": rec["time"],
                "data_wait_s": rec["data_wait_s"]}
        if self.first_step_at is None:
            self.first_step_at = line["time"]
        with self._lock:
            self._metrics.append(line)
        self.recorder.add_metrics(line)
        if rows is not None and self.data.log_samples:  # a live recovery's survivors know the step's rows
            self.recorder.rundir.add_line("samples.jsonl", {"step": rec["step"], "world_size": rec["world_size"],
                                                            "indices": list(rows)})
        self.step = self.recorder.step = rec["step"]

    def _finish_step(self, recs: dict, plan, detector, rows: Optional[list] = None) -> None:
        r0 = recs[min(recs)]
        step_time = max(r.step_time_s for r in recs.values())
        tokens = r0.samples * self.data.seq_len
        line = {"step": r0.step, "loss": r0.loss, "step_time_s": step_time,
                "tokens_per_s": tokens / step_time if step_time > 0 else None, "lr": r0.lr,
                "grad_norm": r0.grad_norm, "world_size": plan.world_size, "ranks_reported": len(recs),
                "time": max(r.time for r in recs.values()),
                "data_wait_s": max(r.data_wait_s for r in recs.values()),
                # The longest any rank waited at the step's sync for the last to arrive: what
                # a straggler costs a step once one is named (rayflex.telemetry.cost).
                "sync_wait_s": max(r.sync_wait_s for r in recs.values())}
        line.update(replicate_tier(recs.values()))
        line.update(sent_by_tier(recs.values()))
        stages = range(plan.pp)
        line["activation_peak_bytes"] = [max(r.activation_peak_bytes for r in recs.values() if r.pp_index == s)
                                         for s in stages]
        if plan.pp > 1:
            line["pipeline_wait_fraction"] = [
                statistics.fmean(r.pipeline_wait_s / r.forward_backward_s if r.forward_backward_s else 0.0
                                 for r in recs.values() if r.pp_index == s) for s in stages]
        if self.data.log_samples:
            # One record per dp index: the tp ranks of a dp rank read the same samples.
            first_stage = sorted((r.dp_index, r.sample_indices) for r in recs.values()
                                 if r.pp_index == 0 and r.tp_index == 0)
            indices = [i for _, idx in first_stage for i in idx or []]
            if rows is not None and len(first_stage) < plan.dp:  # a rank that never reported: its share too
                indices = list(rows)
            self.recorder.rundir.add_line("samples.jsonl", {"step": r0.step, "world_size": plan.world_size,
                                                            "indices": indices})
        if detector is not None:
            for event in detector.note_step(r0.step, step_time, {r: rec.sync_wait_s for r, rec in recs.items()}):
                self.recorder.record(event)
        if self.first_step_at is None:
            self.first_step_at = line["time"]
        with self._lock:
            self._metrics.append(line)
        self.recorder.add_metrics(line)
        self.step = self.recorder.step = r0.step


def steps_excess_s(lines: dict[int, dict], first: int, until: float, median: float) -> float:
    """How much longer than ``median`` the steps from ``first`` on that started before
    ``until`` took (``lines``: step -> its metrics line, with ``time`` at its end and
    ``step_time_s``): what an upload in flight until then cost training."""
    excess, s = 0.0, first
    while s in lines and lines[s]["time"] - lines[s]["step_time_s"] < until:
        excess += max(0.0, lines[s]["step_time_s"] - median)
        s += 1
    return excess
