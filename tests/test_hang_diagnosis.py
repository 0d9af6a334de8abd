"""Deadlocks on a live loopback cluster, each named by the hang diagnosis: the rank, the
process group and the collective, within the hang timeout + the diagnosis's timeout + 2 s of
the last step every rank finished.

Each rank's misbehaviour is injected at step 3 of every attempt
(``RAYFLEX_COLLECTIVE_FAULT``, worker/collective_faults.py); the frozen rank (SIGSTOP) is
in tests/test_elastic_cluster.py. Two workers each: on two CPU ranks the dp (or pp) group
is the world group, so every collective of a step shares one sequence.
"""

import json
import os

import pytest

import rayflex as rf
from rayflex.cli.main import main
from rayflex.errors import RunFailed

from conftest import run_events, small_gpt

pytestmark = pytest.mark.cluster
HANG_FLOOR_S = 4.0


@pytest.fixture(autouse=True)
def fast_detection(monkeypatch):
    monkeypatch.setenv("RAYFLEX_HANG_TIMEOUT_FLOOR_S", str(HANG_FLOOR_S))
    monkeypatch.setenv("RAYFLEX_RELEASE_TIMEOUT_S", "4")


def _hang(monkeypatch, two_node_cluster, dataset_uri, tmp_path, name, fault, *, pp=1, max_failures=0):
    """Run until the injected fault fails the run; (why it failed, its events, when the
    fault was committed in each attempt)."""
    log = tmp_path / "faults.jsonl"
    monkeypatch.setenv("RAYFLEX_COLLECTIVE_FAULT", fault)
    monkeypatch.setenv("RAYFLEX_FAULT_LOG", str(log))
    trainer = rf.Trainer(model=small_gpt(n_layers=2),
                         data=rf.DataConfig(uri=dataset_uri, seq_len=32, global_batch=8),
                         run=rf.RunConfig(name=name, storage=f"file://{tmp_path}/runs", steps=6),
                         parallel=rf.ParallelConfig(pp=pp),
                         scaling=rf.ScalingConfig(num_workers=2),
                         checkpoint=rf.CheckpointConfig(every_steps=2),
                         elastic=rf.ElasticConfig(max_failures=max_failures, resource_wait_s=30))
    handle = trainer.submit()
    try:
        with pytest.raises(RunFailed) as failed:
            # Two attempts, each a start, a hang timeout and a diagnosis: ~1 min here, 3-4x
            # that on a slow host. A guard, not a bound.
            handle.wait(timeout_s=600)
    finally:
        if not handle.done():  # never leave a run holding the shared cluster's CPUs
            handle.stop(timeout_s=60)
    events = run_events(tmp_path, name)
    injected = [json.loads(line)["time"] for line in log.read_text().splitlines()]
    return failed.value.reason, events, injected


def _diagnosed_in_time(events, injected_at: float) -> dict:
    """Named and diagnosed on the mechanism's clock, which runs from the last step every rank
    finished (the injected step may still finish on some layouts: the hang is then in the
    next one): the hang timeout, a poll, then the diagnosis's own timeout."""
    hang = next(e for e in events if e["kind"] == "hang_detected")
    diagnosed = next(e for e in events if e["kind"] == "hang_diagnosed")
    stalled_from = hang["time"] - hang["stalled_s"]
    assert hang["time"] > injected_at and stalled_from >= injected_at - hang["timeout_s"], (injected_at, hang)
    # Named at the first poll past the timeout, diagnosed within the diagnosis timeout after:
    # each plus one controller cycle as this host ran it then (poll_gap_s), no fixed slack.
    assert hang["timeout_s"] < hang["stalled_s"] <= hang["timeout_s"] + hang["poll_gap_s"], hang
    bound = float(os.environ.get("RAYFLEX_DIAGNOSIS_TIMEOUT_S", 3.0)) + hang["poll_gap_s"]
    assert diagnosed["time"] - hang["time"] <= bound, (diagnosed["time"] - hang["time"], bound, hang)
    assert diagnosed["answered"] == [0, 1] and diagnosed["table"], diagnosed
    return diagnosed


def test_a_rank_that_skips_an_all_reduce_is_named(monkeypatch, two_node_cluster, dataset_uri, tmp_path, capsys):
    # Rank 1 skips step 3's control all-reduce (the step's 2nd dist.all_reduce, after the
    # grad norm's) and goes on to step 4, whose first all-gather meets rank 0's all-reduce.
    reason, events, injected = _hang(monkeypatch, two_node_cluster, dataset_uri, tmp_path, "skip",
                                     "1:3:skip:all_reduce:dp:2")
    d = _diagnosed_in_time(events, injected[0])
    assert (d["diagnosis"], d["ranks"], d["group"], d["op"]) == ("missing", [1], "dp", "all_reduce"), d
    assert d["verdict"].startswith("rank 1 skipped all_reduce #"), d["verdict"]
    assert d["verdict"].endswith("; rank 0 waits in all_reduce #%d of the dp group (ranks 0, 1)" % d["seq"])
    assert d["program_level"] and "failure budget exhausted" in reason
    # The same verdict and table from the command line.
    assert main(["diagnose", "skip", "--storage", f"file://{tmp_path}/runs"]) == 0
    out = capsys.readouterr().out
    assert d["verdict"] in out and "last_completed" in out and "waits in all_reduce(double[3])" in out


def test_a_rank_that_broadcasts_where_the_others_all_reduce_fails_the_run_after_one_restart(
        monkeypatch, two_node_cluster, dataset_uri, tmp_path):
    reason, events, injected = _hang(monkeypatch, two_node_cluster, dataset_uri, tmp_path, "bcast",
                                     "1:3:broadcast:all_reduce:dp:2", max_failures=3)
    d = _diagnosed_in_time(events, injected[0])
    assert (d["diagnosis"], d["ranks"], d["group"], d["op"]) == ("op_mismatch", [1], "dp", "broadcast"), d
    assert "where rank 0 called all_reduce(double[3])" in d["verdict"], d["verdict"]
    # The same program hangs the same step the same way after the restart: a bug, so the
    # run fails with the verdict instead of spending its failure budget.
    again = [e for e in events if e["kind"] == "hang_diagnosed"][1:]
    assert len(injected) == 2 and len(again) == 1 and again[0]["ranks"] == [1] and again[0]["op"] == "broadcast"
    assert [e["kind"] for e in events].count("restarted") == 1
    assert "a bug in the training program" in reason and again[0]["verdict"] in reason


def test_a_rank_that_passes_a_bigger_tensor_is_named(monkeypatch, two_node_cluster, dataset_uri, tmp_path):
    reason, events, injected = _hang(monkeypatch, two_node_cluster, dataset_uri, tmp_path, "grow",
                                     "1:3:grow:all_reduce:dp:2")
    d = _diagnosed_in_time(events, injected[0])
    assert (d["diagnosis"], d["ranks"], d["group"], d["op"]) == ("size_mismatch", [1], "dp", "all_reduce"), d
    assert d["verdict"].startswith("rank 1 passed double[4] to all_reduce #"), d["verdict"]
    assert "double[3] at the same point of step 2" in d["verdict"]


def test_a_stage_that_sends_one_microbatch_too_few_is_named(monkeypatch, two_node_cluster, dataset_uri, tmp_path):
    reason, events, injected = _hang(monkeypatch, two_node_cluster, dataset_uri, tmp_path, "p2p",
                                     "0:3:drop_send:p2p:pp:1", pp=2)
    d = _diagnosed_in_time(events, injected[0])
    assert (d["diagnosis"], d["ranks"], d["group"], d["op"]) == ("p2p_mismatch", [0], "pp", "send"), d
    assert d["verdict"].startswith("rank 0 sent one message too few in the pp group (ranks 0, 1) in step 3: it "
                                   "went on to recv #"), d
    assert "where step 2 sent one more; rank 1 waits in recv #" in d["verdict"], d
