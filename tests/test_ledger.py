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


def _status(rank, step, ckpt=None):
    rec = StepRecord(step=step, loss=2.0, step_time_s=0.1, lr=1e-3, grad_norm=1.0, time=1.0 + step, samples=8,
                     dp_index=rank, sample_indices=[2 * rank + 8 * (step - 1), 2 * rank + 1 + 8 * (step - 1)])
    return WorkerStatus(rank=rank, node_id="n", state=WorkerState.RUNNING, step=step, phase="collective",
                        records=[rec], checkpoints=[ckpt] if ckpt else [])


def test_a_committed_step_some_ranks_had_not_reported_is_written_when_the_next_attempt_starts(tmp_path):
    recorder = _Recorder()
    ledger = StepLedger(_spec(tmp_path), recorder)
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
