"""StepLedger: a step whose checkpoint committed is written even when a fault ended the
attempt before every rank's record of it was polled (it is never trained again)."""

from __future__ import annotations

import rayflex as rf
from rayflex.control.ledger import StepLedger
from rayflex.mesh.plan import plan_mesh
from rayflex.models.summary import ModelSummary
from rayflex.worker.status import StepRecord, WorkerState, WorkerStatus


class _RunDir:
    def __init__(self):
        self.lines = {}

    def add_line(self, name, line):
        self.lines.setdefault(name, []).append(line)

    def rewrite(self, name, keep):
        self.lines[name] = [line for line in self.lines.get(name, []) if keep(line)]


class _Recorder:
    def __init__(self):
        self.rundir, self.events, self.metrics, self.step = _RunDir(), [], [], 0

    def record(self, event):
        self.events.append(event)

    def add_metrics(self, line):
        self.metrics.append(line)


class _Detector:
    def note_step(self, *args):
        return []


def _spec(tmp_path):
    model = ModelSummary(name="m", num_blocks=4, hidden_size=8, init_seed=1, block_params=(10, 10, 10, 10))
    return rf.TrainSpec(model=model, data=rf.DataConfig(uri="file:///x", seq_len=8, global_batch=8, log_samples=True),
                        run=rf.RunConfig(name="r", storage=f"file://{tmp_path}", steps=8),
                        scaling=rf.ScalingConfig(num_workers=4))


def _ledger(spec, recorder):
    return StepLedger(spec.data, spec.checkpoint, recorder)


def _status(rank, step, ckpt=None):
    rec = StepRecord(step=step, loss=2.0, step_time_s=0.1, lr=1e-3, grad_norm=1.0, time=1.0 + step, samples=8,
                     dp_index=rank, sample_indices=[2 * rank + 8 * (step - 1), 2 * rank + 1 + 8 * (step - 1)])
    return WorkerStatus(rank=rank, node_id="n", state=WorkerState.RUNNING, step=step, phase="collective",
                        records=[rec], checkpoints=[ckpt] if ckpt else [])


def test_a_committed_step_some_ranks_had_not_reported_is_written_when_the_next_attempt_starts(tmp_path):
    recorder = _Recorder()
    ledger = _ledger(_spec(tmp_path), recorder)
    spec = _spec(tmp_path)
    plan = plan_mesh(spec.model, spec.parallel, spec.data, 4)
    for rank in range(4):
        ledger.absorb(rank, _status(rank, 1), plan, _Detector())
    committed = {"committed": True, "step": 2, "uri": "mem://2", "blocked_s": 0.1, "total_s": 0.2}
    for rank in (0, 1, 2):  # rank 3's answer for step 2 never came: the attempt failed first
        ledger.absorb(rank, _status(rank, 2, committed if rank == 0 else None), plan, _Detector())
    assert ledger.step == 1 and ledger.committed_step == 2
    lost = ledger.restored(2)
    assert lost == 0 and ledger.step == 2
    assert [(m["step"], m["ranks_reported"]) for m in recorder.metrics] == [(1, 4), (2, 3)]
    assert recorder.metrics[-1]["loss"] == 2.0
    samples = recorder.rundir.lines["samples.jsonl"]
    assert [s["step"] for s in samples] == [1, 2]


def test_steps_no_live_rank_reported_are_written_from_the_metrics_the_checkpoint_carries(tmp_path):
    """Every rank died between the commit of step 3 and the next poll (a one-worker run, or a
    single-node job losing its node): steps 2-3 reached no rank's poll; the restored
    checkpoint carries their metrics, so the run's curve has no hole."""
    from rayflex.worker.status import recent_step

    recorder, spec = _Recorder(), _spec(tmp_path)
    ledger = _ledger(spec, recorder)
    plan = plan_mesh(spec.model, spec.parallel, spec.data, 4)
    for rank in range(4):
        ledger.absorb(rank, _status(rank, 1), plan, _Detector())
    carried = [recent_step(_status(0, s).records[0], 4) for s in (1, 2, 3)]
    assert ledger.restored(3, recovered=carried) == 0 and ledger.step == 3
    lines = recorder.metrics
    assert [(m["step"], m["ranks_reported"], m.get("from_checkpoint")) for m in lines] == \
        [(1, 4, None), (2, 0, True), (3, 0, True)]
    assert lines[-1]["loss"] == 2.0 and lines[-1]["world_size"] == 4 and lines[-1]["tokens_per_s"] == 8 * 8 / 0.1
    # A run resumed by name (a new controller: its first attempt restores) already has the
    # earlier job's lines: the carried steps are not written again.
    recorder2 = _Recorder()
    ledger2 = _ledger(spec, recorder2)
    assert ledger2.restored(3, recovered=carried) == 0 and ledger2.step == 3
    assert recorder2.metrics == []


def test_after_a_live_recovery_every_step_has_its_samples_line_even_one_no_rank_reported(tmp_path):
    """The survivors' snapshots carry every dp rank's rows of their recent steps: a step the
    killed rank never reported (3 of 4 lines) and one no rank reported before the fault
    (the metrics the snapshot carries) both get the step's whole batch in samples.jsonl."""
    from rayflex.worker.status import recent_step

    recorder, spec = _Recorder(), _spec(tmp_path)
    ledger = _ledger(spec, recorder)
    plan = plan_mesh(spec.model, spec.parallel, spec.data, 4)
    for rank in range(4):
        ledger.absorb(rank, _status(rank, 1), plan, _Detector())
    for rank in (0, 1, 2):
        ledger.absorb(rank, _status(rank, 2), plan, _Detector())
    rows = {s: list(range(8 * (s - 1), 8 * s)) for s in (1, 2, 3)}
    carried = [recent_step(_status(0, s).records[0], 4) for s in (1, 2, 3)]
    assert ledger.restored(3, recovered=carried, committed=False, sample_rows=rows) == 0
    samples = recorder.rundir.lines["samples.jsonl"]
    assert [(s["step"], s["indices"]) for s in samples] == [(1, rows[1]), (2, rows[2]), (3, rows[3])]
    assert ledger.committed_step == 0, "a live step is not a commit"


def test_a_saves_cost_is_what_it_blocked_plus_the_slowdown_of_the_steps_beside_its_upload(tmp_path):
    import dataclasses

    import pytest

    recorder, spec = _Recorder(), _spec(tmp_path)
    ledger = _ledger(spec, recorder)
    plan = plan_mesh(spec.model, spec.parallel, spec.data, 1)
    # 0.1 s steps; a save after step 10 blocks 0.05 s and uploads for 1 s, during which three
    # steps take 0.3 s each; the step after the upload is back to 0.1 s.
    step_time = {11: 0.3, 12: 0.3, 13: 0.3}
    t = 0.0
    for step in range(1, 21):
        t += step_time.get(step, 0.1) + (0.05 if step == 11 else 0.0)
        rec = StepRecord(step=step, loss=1.0, step_time_s=step_time.get(step, 0.1), lr=1e-3, grad_norm=1.0,
                         time=t, samples=8)
        ckpt = {"committed": True, "step": 10, "uri": "mem://10", "blocked_s": 0.05, "total_s": 1.0} \
            if step == 14 else None
        ledger.absorb(0, dataclasses.replace(_status(0, step, ckpt), records=[rec]), plan, _Detector())
    assert ledger.save_costs_s() == [pytest.approx(0.05 + 3 * 0.2)]
    # What a failure now would lose: the steps trained since the save of step 10.
    assert ledger.training_s_since(10) == pytest.approx(3 * 0.3 + 7 * 0.1)
    # A save whose upload was still running when its attempt failed: its cost is unknown.
    unfinished = {"committed": True, "step": 20, "uri": "mem://20", "blocked_s": 0.05, "total_s": 1.0}
    rec = StepRecord(step=21, loss=1.0, step_time_s=0.1, lr=1e-3, grad_norm=1.0, time=t + 0.1, samples=8)
    ledger.absorb(0, dataclasses.replace(_status(0, 21, unfinished), records=[rec]), plan, _Detector())
    ledger.restored(20)
    # The new attempt has none of the old one's steps, but the costs measured there stay
    # (recomputed now, the save of step 10 would look free: only its 0.05 s blocked copy).
    assert ledger.save_costs_s() == [pytest.approx(0.05 + 3 * 0.2)]


def test_with_memory_replicas_a_spot_notice_needs_time_to_replicate_not_to_upload(tmp_path):
    import dataclasses

    import pytest

    recorder = _Recorder()
    spec = _spec(tmp_path)
    plan = plan_mesh(spec.model, spec.parallel, spec.data, 1)
    save = {"committed": True, "step": 2, "uri": "mem://2", "blocked_s": 0.1, "total_s": 6.0, "replicated_s": 0.4}
    ledgers = {}
    for replicas in (0, 1):
        s = dataclasses.replace(spec, checkpoint=rf.CheckpointConfig(every_steps=2, memory_replicas=replicas))
        ledger = ledgers[replicas] = _ledger(s, recorder)
        ledger.absorb(0, _status(0, 1), plan, _Detector())
        ledger.absorb(0, _status(0, 2, save), plan, _Detector())
    # a step (0.1 s) + the save + a 1 s margin: the whole upload without replicas, the copy to memory with
    assert ledgers[0].emergency_notice_s(1.0) == pytest.approx(0.1 + 6.1 + 1.0)
    assert ledgers[1].emergency_notice_s(1.0) == pytest.approx(0.1 + 0.5 + 1.0)
    # An emergency save handed to the keepers is the controller's to commit: not committed yet.
    handed = {"committed": False, "step": 3, "uri": "mem://3", "handed_off": {"world_size": 1, "mesh": {}, "keep": 2}}
    ledgers[1].absorb(0, _status(0, 3, handed), plan, _Detector())
    assert ledgers[1].handed_off["step"] == 3 and ledgers[1].committed_step == 2
