"""Crossing the slow tier (``CommConfig``): int8 quantization with error feedback, the
replicate-group reducer, DiLoCo's outer step, and runs of four ranks that show what a user
sees — an int8 HSDP run trains as one process does within the rounding it carries, DiLoCo
with one inner step and an outer SGD of lr 1 *is* data parallelism, and a DiLoCo run saved
at two replica groups resumes at three and at one with its outer momentum and its data.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from conftest import SEQ_LEN
from spawn_ranks import JobPorts, run_ranks

from rayflex.worker.slow_tier.diloco import DiLoCo, fragment_ranges, sync_offset
from rayflex.worker.slow_tier.quantize import LEVELS, ErrorFeedback, dequantize, quantize
from rayflex.worker.slow_tier.reduce import ReplicateReducer, ring_bytes

TIMEOUT_S = 600  # a guard against a pool that never ends, not a bound
GLOBAL_BATCH = 12  # divisible by every dp below: 1, 2, 3, 4
BLOCK = 64


# ----------------------------------------------------------------- quantization

def test_a_block_round_trips_within_half_a_step_of_its_own_scale():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * BLOCK, generator=g)
    x[BLOCK:2 * BLOCK] *= 1000  # an outlier block costs its own precision only
    x[3 * BLOCK:] = 0
    q, scales = quantize(x, BLOCK)
    assert q.dtype == torch.int8 and q.numel() == x.numel() and scales.numel() == 4
    back = dequantize(q, scales)
    err = (back - x).abs().view(4, BLOCK).amax(dim=1)
    step = x.view(4, BLOCK).abs().amax(dim=1) / LEVELS
    assert torch.all(err <= step / 2 + 1e-6), (err, step)
    assert torch.equal(back[3 * BLOCK:], torch.zeros(BLOCK))  # an all-zero block stays exactly zero
    assert err[0] < 0.02 and err[2] < 0.02  # the outlier did not spill into its neighbours


def test_error_feedback_delays_what_rounding_drops_and_never_loses_it():
    g = torch.Generator().manual_seed(1)
    feedback = ErrorFeedback()
    sent_total = torch.zeros(BLOCK)
    wanted_total = torch.zeros(BLOCK)
    for _ in range(50):
        x = torch.randn(BLOCK, generator=g) * 1e-3
        x[0] = 1.0  # every block's scale is set by it: the small values round to 0 or one step
        wanted = feedback.compensate("grad", x)
        q, scales = quantize(wanted, BLOCK)
        sent = dequantize(q, scales)
        feedback.keep("grad", wanted, sent)
        sent_total += sent
        wanted_total += x
    # What was sent over 50 steps is what was wanted, short by one residual (< half a step each).
    assert torch.allclose(sent_total + feedback._residual["grad"], wanted_total, atol=1e-5)
    assert feedback.norm() <= math.sqrt(BLOCK) * (1.0 / LEVELS) / 2 + 1e-6
    # Without feedback the small values (1e-3 < half a step of 1/127) would all have rounded to 0.
    assert (sent_total[1:] != 0).any()


# ----------------------------------------------------------------- the replicate reducer (3 ranks)

def _reduce_job(rank: int, world: int, port: int, wire: str, n: int, rounds: int) -> dict:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        x = torch.randn(n, generator=torch.Generator().manual_seed(100 + rank))
        reducer = ReplicateReducer(dist.group.WORLD, wire, block=BLOCK)
        outs, sent = [], []
        for _ in range(rounds):
            buf = x.clone()
            reducer.mean_(buf, "g")
            outs.append(buf)
            sent.append(reducer.take_bytes())
        # Plain lists: a tensor would travel as shared memory its process takes away on exit.
        return {"x": x.tolist(), "outs": [o.tolist() for o in outs], "sent": sent,
                "residual": reducer.residual_norm()}
    finally:
        dist.destroy_process_group()


@pytest.mark.multiproc
@pytest.mark.parametrize("wire", ["fp32", "int8"])
def test_the_replicate_mean_in_int8_costs_a_quarter_of_the_bytes_and_its_error_feedback_converges(wire):
    n, rounds = 10_000, 16  # no multiple of 3 x 64: the chunks are padded (by 1.8%)
    got = run_ranks(_reduce_job, 3, wire, n, rounds, timeout_s=120)
    xs = {r: torch.tensor(got[r]["x"]) for r in range(3)}
    true = torch.stack(list(xs.values())).mean(dim=0)
    outs = {r: [torch.tensor(o) for o in got[r]["outs"]] for r in range(3)}
    for k in range(rounds):  # every rank ends each round with the same mean
        assert all(torch.equal(outs[0][k], outs[r][k]) for r in (1, 2))
    fp32_bytes = ring_bytes(n, 4, 3)
    if wire == "fp32":
        assert torch.allclose(outs[0][0], true, atol=1e-6)
        assert got[0]["sent"] == [fp32_bytes] * rounds and got[0]["residual"] == 0.0
        return
    first = (outs[0][0] - true).abs().max()
    half_step = max(float(x.abs().max()) for x in xs.values()) / LEVELS / 2
    assert 0 < first <= 2 * half_step  # one rounding on the way in, one on the way out
    # Fed back, the rounding of one round is paid in the next: the mean of the rounds
    # approaches the true mean as 1/rounds.
    average = torch.stack(outs[0]).mean(dim=0)
    assert (average - true).abs().max() <= first / 4
    assert 0 < got[0]["residual"] < 2 * math.sqrt(n) * half_step
    assert all(s == got[0]["sent"][0] for s in got[0]["sent"])
    # A quarter, less the scales (4 bytes per 64 values here) and the padding.
    assert fp32_bytes / got[0]["sent"][0] >= 3.5, (fp32_bytes, got[0]["sent"][0])


# ----------------------------------------------------------------- DiLoCo's arithmetic

def test_fragments_split_the_parameters_evenly_and_sync_at_staggered_steps():
    assert fragment_ranges([10, 10, 10, 10], 2) == [range(0, 2), range(2, 4)]
    assert fragment_ranges([5, 5], 4) == [range(0, 1), range(1, 2)]  # no more fragments than parameters
    assert fragment_ranges([1, 100, 1], 1) == [range(0, 3)]
    assert [sync_offset(f, 4, 8) for f in range(4)] == [2, 4, 6, 0]
    assert [sync_offset(f, 1, 8) for f in range(1)] == [0]


def test_one_replica_takes_nesterov_outer_steps_on_how_far_it_moved():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    outer = DiLoCo([("w", p)], ReplicateReducer(None), inner_steps=2, lr=0.5, momentum=0.9)
    with torch.no_grad():
        p -= torch.tensor([0.2, 0.4])  # the inner steps moved it
    assert outer.sync(1) == 0 and outer.sync(2) == 1 and outer.sync(2) == 0  # due at 2, once
    delta = torch.tensor([0.2, 0.4])
    m = delta  # momentum from zero
    expected = torch.tensor([1.0, 2.0]) - 0.5 * (delta + 0.9 * m)
    state = outer.state()
    assert torch.allclose(p.detach(), expected) and torch.allclose(state["outer_momentum"]["w"], m)
    assert torch.equal(state["outer_anchor"]["w"], p.detach())  # every replica continues from the anchor
    with torch.no_grad():
        p -= torch.tensor([0.1, 0.1])
    delta2 = torch.tensor([0.1, 0.1])
    m2 = 0.9 * m + delta2
    assert outer.sync_all(3) == 1
    assert torch.allclose(p.detach(), expected - 0.5 * (delta2 + 0.9 * m2))


def test_with_overlap_the_outer_step_uses_what_was_sent_and_keeps_the_progress_made_since():
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0]))
    outer = DiLoCo([("w", p)], ReplicateReducer(None), inner_steps=2, lr=0.5, momentum=0.9, overlap_steps=1)
    with torch.no_grad():
        p -= torch.tensor([0.2, 0.4])  # step 1's inner step
    assert outer.sync(1) == 0 and int(outer.in_flight) == 0  # sent after step 1, for step 2
    assert torch.allclose(outer.own_state()["h2_f1_o1.sent"], torch.tensor([0.2, 0.4]))
    with torch.no_grad():
        p -= torch.tensor([0.1, 0.1])  # step 2's, while it crosses
    assert outer.sync(2) == 1 and int(outer.in_flight) == -1
    sent = torch.tensor([0.2, 0.4])
    anchor = torch.tensor([1.0, 2.0]) - 0.5 * (sent + 0.9 * sent)
    assert torch.allclose(outer.state()["outer_anchor"]["w"], anchor)
    assert torch.allclose(p.detach(), anchor - torch.tensor([0.1, 0.1]))  # step 2's progress kept


def test_overlap_is_refused_where_it_cannot_work():
    import rayflex as rf
    from rayflex.errors import ConfigError

    with pytest.raises(ConfigError, match="overlap_steps=4 would send a fragment before") as e:
        rf.CommConfig(replicate="diloco", inner_steps=16, fragments=4, overlap_steps=4)
    assert "use at most 3" in str(e.value)
    with pytest.raises(ConfigError, match="int8 pseudo-gradient"):
        rf.CommConfig(replicate="diloco", pseudo_grad="int8", overlap_steps=1)
    with pytest.raises(ConfigError, match="overlap_steps is a DiLoCo setting"):
        rf.CommConfig(replicate="int8", overlap_steps=1)


# ----------------------------------------------------------------- runs of four ranks

def _spec(data_uri: str, storage: str, name: str, *, world: int, dp_shard=None, comm=None, steps: int = 6,
          every: int = 0, resume: bool = False, sgd: bool = False):
    import rayflex as rf
    from rayflex.models import GPTConfig, gpt

    optimizer = (rf.OptimizerConfig(lr=0.05, algorithm="sgd", grad_clip=None) if sgd
                 else rf.OptimizerConfig(lr=1e-2, grad_clip=1.0))
    return rf.TrainSpec(model=gpt(GPTConfig(vocab_size=128, seq_len=SEQ_LEN, d_model=32, n_layers=2, n_heads=4)),
                        data=rf.DataConfig(uri=data_uri, seq_len=SEQ_LEN, global_batch=GLOBAL_BATCH,
                                           log_samples=True),
                        run=rf.RunConfig(name=name, storage=storage, steps=steps, optimizer=optimizer),
                        scaling=rf.ScalingConfig(num_workers=world), parallel=rf.ParallelConfig(dp_shard=dp_shard),
                        comm=comm or rf.CommConfig(),
                        checkpoint=rf.CheckpointConfig(every_steps=every, resume=resume, async_save=False))


def _diloco(**kw):
    import rayflex as rf

    return rf.CommConfig(replicate="diloco", **kw)


def _jobs() -> dict:
    """name -> (ranks, dp_shard, comm, end_step, run name, every, resume, sgd); every run is
    of 6 steps (``run.steps``, the learning-rate schedule's length), trained up to end_step."""
    import rayflex as rf

    return {
        "int8": (4, 2, rf.CommConfig(replicate="int8", block=BLOCK), 4, "int8", 0, False, False),
        # The same run saved at step 2, resumed on its mesh and on another one.
        "int8_save": (4, 2, rf.CommConfig(replicate="int8", block=BLOCK), 2, "int8_ckpt", 2, False, False),
        "int8_resume": (4, 2, rf.CommConfig(replicate="int8", block=BLOCK), 4, "int8_ckpt", 0, True, False),
        "int8_resume_r2": (2, 1, rf.CommConfig(replicate="int8", block=BLOCK), 4, "int8_ckpt", 0, True, False),
        "diloco_h1": (4, 2, _diloco(inner_steps=1, outer_lr=1.0, outer_momentum=0.0), 4, "h1", 0, False, True),
        # The same DiLoCo, carried by the mesh (the planner's pick under replicate="auto").
        "mesh_h1": (4, 2, rf.CommConfig(), 4, "mesh_h1", 0, False, True),
        "streaming": (4, 2, _diloco(inner_steps=2, fragments=2), 4, "streaming", 0, False, False),
        # Saved at step 3, between the syncs of steps 2 and 4 (H=2), of a 6-step run.
        "diloco_whole": (4, 2, _diloco(inner_steps=2), 6, "whole", 0, False, False),
        "diloco_save": (4, 2, _diloco(inner_steps=2), 3, "ckpt", 3, False, False),
        "resume_r2": (4, 2, _diloco(inner_steps=2), 6, "ckpt", 0, True, False),
        "resume_r3": (3, 1, _diloco(inner_steps=2), 6, "ckpt", 0, True, False),
        "resume_r1": (2, 2, _diloco(inner_steps=2), 6, "ckpt", 0, True, False),
        # The same checkpoint read by a run that keeps one model (the fp32 all-reduce).
        "resume_plain": (4, 2, rf.CommConfig(), 6, "ckpt", 0, True, False),
        # Streaming over H=4 in 2 fragments (synchronised at steps 2 and 4), each sent a step
        # ahead with overlap; saved at step 3 with fragment 1 in flight.
        "streaming_h4": (4, 2, _diloco(inner_steps=4, fragments=2), 6, "s_h4", 0, False, False),
        "overlap": (4, 2, _diloco(inner_steps=4, fragments=2, overlap_steps=1), 6, "ov", 0, False, False),
        "overlap_save": (4, 2, _diloco(inner_steps=4, fragments=2, overlap_steps=1), 3, "ov_ckpt", 3, False, False),
        "overlap_resume": (4, 2, _diloco(inner_steps=4, fragments=2, overlap_steps=1), 6, "ov_ckpt", 0, True, False),
        "overlap_resume_r3": (3, 1, _diloco(inner_steps=4, fragments=2, overlap_steps=1), 6, "ov_ckpt", 0, True,
                              False),
    }


MESH_H1 = (("replicate", "diloco"), ("inner_steps", 1), ("outer_lr", 1.0), ("outer_momentum", 0.0))


def _momentum_norm(worker) -> float:
    """The whole outer momentum's norm (a collective over each parameter's mesh)."""
    total = 0.0
    for m in worker.slow_tier.checkpoint_state()["outer_momentum"].values():
        total += float(m.full_tensor().float().square().sum())
    return math.sqrt(total)


def _run_jobs(rank: int, world: int, port: int, data_uri: str, storage: str, names: list, ports) -> dict:
    from rayflex.constants import set_node_ip
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.train_worker import TrainWorker

    set_node_ip("127.0.0.1")
    out = {}
    for name in names:
        size, dp_shard, comm, end_step, run_name, every, resume, sgd = _jobs()[name]
        if rank >= size:
            continue
        spec = _spec(data_uri, storage, run_name, world=size, dp_shard=dp_shard, comm=comm, every=every,
                     resume=resume, sgd=sgd)
        plan = plan_mesh(spec.model, spec.parallel, spec.data, size,
                         replicate_choice=MESH_H1 if name == "mesh_h1" else ())
        worker = TrainWorker(rank, spec, plan)
        info = worker.setup("127.0.0.1", ports.port(rank, size, name), restore=resume)
        diloco = plan.comm_config(comm).replicate == "diloco"
        restored_norm = _momentum_norm(worker) if diloco else None
        worker.start(end_step)
        finished = worker.join(TIMEOUT_S - 30)
        status = worker.poll()
        assert finished and status.error is None, (name, status.error)
        out[name] = {"losses": [r.loss for r in status.records], "steps": [r.step for r in status.records],
                     "rows": {r.step: list(r.sample_indices) for r in status.records},
                     "bytes": [r.replicate_bytes for r in status.records],
                     "synced": [r.outer_synced for r in status.records],
                     "residual": [r.residual_norm for r in status.records],
                     "sent": [r.sent_bytes for r in status.records],
                     "restored": (info["restored"] or {}).get("step"), "mesh": plan.describe(),
                     "restored_momentum": restored_norm,
                     "momentum": _momentum_norm(worker) if diloco else None}
        assert worker.release(10, 0) == "left"
    return out


@pytest.fixture(scope="module")
def storage(tmp_path_factory):
    return f"file://{tmp_path_factory.mktemp('slow_tier')}"


@pytest.fixture(scope="module")
def runs(dataset_uri, storage):
    from rayflex.testing.reference import single_process_train

    names = list(_jobs())
    got = run_ranks(_run_jobs, 4, dataset_uri, storage, names, JobPorts(4), timeout_s=TIMEOUT_S)
    reference = {sgd: single_process_train(_spec(dataset_uri, storage, "reference", world=1, sgd=sgd), 4)[0]
                 for sgd in (False, True)}
    return got, reference


def _rows(got: dict, name: str) -> dict:
    """step -> the rows every rank of the job read at it."""
    rows: dict = {}
    for runs in got.values():
        for step, indices in runs.get(name, {}).get("rows", {}).items():
            rows.setdefault(step, []).extend(indices)
    return {step: sorted(r) for step, r in rows.items()}


@pytest.mark.multiproc
def test_int8_gradients_train_as_one_process_does_within_what_rounding_carries(runs):
    got, reference = runs
    for rank, job in got.items():
        run = job["int8"]
        assert run["mesh"] == "pp=1 x dp=4 (2x2 hsdp)"
        # int8 steps of 1/127 of a block's largest gradient, fed back each step: four steps of
        # AdamW move the loss by a few 1e-4 at most (fp32 HSDP matches to 1e-5: test_3d_parallel).
        assert run["losses"] == pytest.approx(reference[False], abs=2e-3), (rank, run["losses"], reference[False])
        assert all(r is not None and r > 0 for r in run["residual"])
        assert all(b > 0 for b in run["bytes"])


@pytest.mark.multiproc
def test_an_int8_run_resumed_on_its_mesh_carries_its_residuals_and_is_the_never_stopped_run(runs):
    got, reference = runs
    whole = {rank: job["int8"] for rank, job in got.items()}
    for rank, job in got.items():
        saved, resumed = job["int8_save"], job["int8_resume"]
        assert saved["losses"] == whole[rank]["losses"][:2]
        assert resumed["restored"] == 2 and resumed["steps"] == [3, 4]
        # What the roundings of steps 1-2 still owed came back with the checkpoint: steps 3-4
        # are those of the run that never stopped (without it they differ by ~1e-4).
        assert resumed["losses"] == pytest.approx(whole[rank]["losses"][2:], abs=1e-6), (rank, resumed, whole[rank])
        assert resumed["residual"] == pytest.approx(whole[rank]["residual"][2:], rel=1e-5)
    # On another mesh (2 replicas of one shard) no rank holds those buffers: they start from zero,
    # and the run trains on within what rounding carries.
    for rank in (0, 1):
        other = got[rank]["int8_resume_r2"]
        assert other["mesh"] == "pp=1 x dp=2 (2x1 hsdp)" and other["restored"] == 2 and other["steps"] == [3, 4]
        assert other["losses"] == pytest.approx(reference[False][2:], abs=2e-3), other


@pytest.mark.multiproc
def test_each_step_counts_the_bytes_every_tier_carried(runs):
    got, _ = runs
    for rank, job in got.items():
        # int8 between the replicas: counted as issued, they are the bytes its reducer sent.
        int8 = job["int8"]
        assert [s["dp_replicate"] for s in int8["sent"]] == int8["bytes"], (rank, int8)
        # FSDP inside a replica (all-gathers, reduce-scatters) and the step's agreement over every
        # rank (the default group on CPUs, where it serves host tensors).
        assert all(s["dp_shard"] > 0 and s["world"] > 0 for s in int8["sent"]), int8["sent"]
        # HSDP's own fp32 all-reduce: the ring's arithmetic over the unpadded shards, counted
        # over FSDP's padded buffers.
        plain = job["resume_plain"]
        for s, modelled in zip(plain["sent"], plain["bytes"]):
            assert modelled <= s["dp_replicate"] <= 1.1 * modelled, (rank, plain)
        # DiLoCo (H=2): the replicas meet only at a sync.
        whole = job["diloco_whole"]
        assert [s.get("dp_replicate", 0) for s in whole["sent"]] == whole["bytes"], (rank, whole)
        assert whole["bytes"][0] == 0 and whole["bytes"][1] > 0


@pytest.mark.multiproc
def test_diloco_with_one_inner_step_and_outer_sgd_of_lr_1_is_data_parallelism(runs):
    got, reference = runs
    for rank, job in got.items():
        run = job["diloco_h1"]
        assert run["steps"] == [1, 2, 3, 4] and run["synced"] == [1, 1, 1, 1]
        assert run["losses"] == pytest.approx(reference[True], abs=1e-5), (rank, run["losses"], reference[True])
        # The workers apply the mesh's choice (CommConfig(replicate="auto") resolved), not the spec's.
        assert job["mesh_h1"]["losses"] == run["losses"] and job["mesh_h1"]["synced"] == run["synced"]


@pytest.mark.multiproc
def test_a_diloco_run_resumes_at_two_three_and_one_replica_groups_with_its_outer_state_and_data(runs):
    got, _ = runs
    whole = got[0]["diloco_whole"]
    assert whole["synced"] == [0, 1, 0, 1, 0, 1]  # H=2
    # Streaming: two fragments over H=2, one synchronised at odd steps, the other at even ones.
    streaming = got[0]["streaming"]
    assert streaming["synced"] == [1, 1, 1, 1]
    assert streaming["losses"][:1] == pytest.approx(whole["losses"][:1], abs=1e-6)  # apart only after a sync
    assert streaming["losses"] == pytest.approx(whole["losses"][:4], rel=0.05)
    # Bytes over the slow tier: a sync sends the pseudo-gradient, a step between sends none.
    assert whole["bytes"][0] == 0 and whole["bytes"][1] > 0
    assert streaming["bytes"][0] > 0 and sum(streaming["bytes"]) == pytest.approx(sum(whole["bytes"][:4]), rel=0.1)
    saved = got[0]["diloco_save"]
    assert saved["losses"] == pytest.approx(whole["losses"][:3], abs=1e-6)  # a save does not synchronise
    assert saved["momentum"] > 0
    expected_rows = _rows(got, "diloco_whole")
    for name, mesh in (("resume_r2", "pp=1 x dp=4 (2x2 hsdp)"), ("resume_r3", "pp=1 x dp=3 (3x1 hsdp)"),
                       ("resume_r1", "pp=1 x dp=2")):
        run = got[0][name]
        assert run["mesh"] == mesh and run["restored"] == 3 and run["steps"] == [4, 5, 6], (name, run)
        # The outer momentum came back whole, resharded over the new mesh.
        assert run["restored_momentum"] == pytest.approx(saved["momentum"], rel=1e-6), name
        # Each step read the rows the never-stopped run read at it, whatever the replica count.
        assert _rows(got, name) == {s: expected_rows[s] for s in (4, 5, 6)}, name
    # Saved mid-round and resumed at the same size, the run *is* the never-stopped one: each
    # replica's own model and inner AdamW state came back beside the anchor and the momentum.
    assert got[0]["resume_r2"]["losses"] == pytest.approx(whole["losses"][3:], abs=1e-6)
    # At another size every replica starts from the anchor (step 2's sync), not from its
    # replica's model of step 3, so the run goes on from another point than the never-stopped one.
    for name in ("resume_r3", "resume_r1"):
        assert got[0][name]["losses"] != pytest.approx(whole["losses"][3:], abs=1e-6), name
    # A run that keeps one model reads the replicas' common point too (not replica 0's model):
    # its first step, on the same rows, has the loss the DiLoCo runs restarted from the anchor had.
    plain = got[0]["resume_plain"]
    assert plain["restored"] == 3 and _rows(got, "resume_plain") == {s: expected_rows[s] for s in (4, 5, 6)}
    for name in ("resume_r3", "resume_r1"):
        assert plain["losses"][0] == pytest.approx(got[0][name]["losses"][0], abs=1e-6), name
    assert plain["losses"][0] != pytest.approx(got[0]["resume_r2"]["losses"][0], abs=1e-6)


@pytest.mark.multiproc
def test_streaming_diloco_with_overlap_sends_each_fragment_a_step_early_and_resumes_exactly(runs):
    got, _ = runs
    plain, overlap = got[0]["streaming_h4"], got[0]["overlap"]
    assert plain["synced"] == overlap["synced"] == [0, 1, 0, 1, 0, 1]  # outer steps at 2, 4, 6
    # The pseudo-gradient leaves a step before its outer step: behind step 1's, 3's and 5's compute.
    assert [b > 0 for b in plain["bytes"]] == [False, True, False, True, False, True]
    assert [b > 0 for b in overlap["bytes"]] == [True, False, True, False, True, False]
    assert sum(overlap["bytes"]) == sum(plain["bytes"])
    # The same run until the first outer step, then apart by what one step of progress changes.
    assert overlap["losses"][:2] == pytest.approx(plain["losses"][:2], abs=1e-6)
    assert overlap["losses"] != pytest.approx(plain["losses"], abs=1e-6)
    assert overlap["losses"] == pytest.approx(plain["losses"], rel=0.05)
    # Saved at step 3 with fragment 1's pseudo-gradient in flight: resumed on the same mesh it is
    # sent again, and the run is the one that never stopped.
    for rank, job in got.items():
        saved, resumed, whole = job["overlap_save"], job["overlap_resume"], job["overlap"]
        assert saved["losses"] == pytest.approx(whole["losses"][:3], abs=1e-6)
        assert resumed["restored"] == 3 and resumed["steps"] == [4, 5, 6]
        assert resumed["losses"] == pytest.approx(whole["losses"][3:], abs=1e-6), (rank, resumed, whole)
        assert resumed["synced"] == [1, 0, 1]
    # At three replicas every replica starts from the anchor and nothing is in flight: fragment 1
    # is synchronised at its step (4) as without overlap, then sent ahead again.
    other = got[0]["overlap_resume_r3"]
    assert other["mesh"] == "pp=1 x dp=3 (3x1 hsdp)" and other["steps"] == [4, 5, 6]
    assert other["synced"] == [1, 0, 1] and [b > 0 for b in other["bytes"]] == [True, True, False]


@pytest.mark.multiproc
def test_an_export_of_a_diloco_checkpoint_saved_mid_round_is_the_replicas_common_point(runs, storage):
    import torch
    import torch.distributed.checkpoint as dcp

    from rayflex.checkpoint import manifest as mf
    from rayflex.checkpoint.dcp_io import CheckpointReader
    from rayflex.checkpoint.reader import CheckpointWeights

    step_uri = mf.step_dir(f"{storage}/ckpt/checkpoints", 3)  # saved at step 3, synchronised at step 2
    weights = CheckpointWeights(step_uri=step_uri, step=3, model={}, description="mid-round")
    exported = weights.load(sorted(weights.tensors()))
    anchor = {k: torch.empty_like(t) for k, t in exported.items()}
    replica0 = {k: torch.empty_like(t) for k, t in exported.items()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({"outer_anchor": anchor, "model": replica0}, storage_reader=CheckpointReader(step_uri), no_dist=True)
    assert all(torch.equal(exported[k], anchor[k]) for k in exported)
    assert not all(torch.equal(exported[k], replica0[k]) for k in exported), "replica 0 moved since the sync"


# ----------------------------------------------------------------- the planner's advice

def test_the_advice_is_the_least_approximate_option_that_keeps_the_step_compute_bound():
    from rayflex.planning.capacity.replicate_tier import advise, describe

    assert advise(1.0, 0.1).comm == {} and "compute-bound as it is" in describe(advise(1.0, 0.1))
    assert advise(1.0, 0.3).precision == {"reduce_dtype": "bf16"}  # 0.15 s <= 20% of 1 s
    assert advise(1.0, 0.7).comm == {"replicate": "int8"}  # bf16 0.35 s is too much, int8 0.18 s is not
    diloco = advise(0.1, 1.0)  # fp32 ten times the compute: a round of at least 50 steps
    assert diloco.comm == {"replicate": "diloco", "inner_steps": 64} and diloco.compute_bound
    assert "CommConfig(replicate='diloco', inner_steps=64)" in describe(diloco)
    hopeless = advise(0.01, 100.0)
    assert not hopeless.compute_bound and hopeless.comm["inner_steps"] == 256
    assert "still communication-bound" in describe(hopeless)


def test_rayflex_plan_says_which_way_across_a_slow_replicate_tier_keeps_the_step_compute_bound():
    from rayflex.planning.capacity.memory import preset
    from rayflex.planning.capacity.search import ClusterDescription, DeviceSpec, search

    def advice(**tiers) -> tuple:
        cluster = ClusterDescription.uniform(nodes=8, devices_per_node=8, device=DeviceSpec.h100_80gb(),
                                             nodes_per_rack=4, **tiers)
        result = search(preset("7b"), cluster, global_batch=128, tp=[8])
        assert result.best.layout.dp_replicate > 1  # HSDP: a shard group per rack or zone
        text = result.to_dict()["explanation"]
        return result.best, next(s for s in text.splitlines() if s.startswith("Replicate tier:"))

    best, line = advice()  # two racks of one zone: the replicas' all-reduce is cheap
    assert "compute-bound as it is" in line and f"{best.compute_s:.3f} s compute" in line, line
    # Two zones 5 Gb/s apart: only DiLoCo brings the replicas' share under a fifth of the compute.
    _, line = advice(racks_per_zone=1, bandwidth_gbps={"cross_zone": 5})
    assert "CommConfig(replicate='diloco', inner_steps=" in line and "keeps the step compute-bound" in line, line


def test_comm_settings_come_from_the_command_line_in_any_order_and_bad_ones_are_refused(tmp_path):
    import rayflex as rf

    spec = _spec(f"file://{tmp_path}/tokens", f"file://{tmp_path}/runs", "cli", world=4, dp_shard=2)
    got = spec.with_overrides({"comm.inner_steps": "8", "comm.replicate": "diloco", "comm.fragments": "2"})
    assert (got.comm.replicate, got.comm.inner_steps, got.comm.fragments) == ("diloco", 8, 2)
    with pytest.raises(rf.ConfigError) as err:  # a DiLoCo setting without DiLoCo would be ignored
        spec.with_overrides({"comm.inner_steps": "8"})
    assert "CommConfig.inner_steps" in str(err.value) and "set replicate='diloco'" in str(err.value)
    with pytest.raises(rf.ConfigError) as err:  # no replicas to keep in step
        _spec(f"file://{tmp_path}/tokens", f"file://{tmp_path}/runs", "cli", world=4, comm=_diloco())
    assert "CommConfig.replicate" in str(err.value) and "ParallelConfig(dp_shard=" in str(err.value)


def test_the_capacity_model_charges_diloco_and_int8_their_shard_sized_state():
    import rayflex as rf
    from rayflex.planning.capacity.memory import estimate_memory, preset
    from rayflex.mesh.plan import MeshPlan

    base = preset("7b")
    mesh = MeshPlan(1, 8, 1, dp_replicate=2)
    plain = estimate_memory(base.for_run(comm_config=rf.CommConfig()), mesh).peak_rank
    for comm in (rf.CommConfig(replicate="int8"), rf.CommConfig(replicate="diloco")):
        more = estimate_memory(base.for_run(comm_config=comm), mesh).peak_rank
        # two more shard-sized tensors per parameter element, fp32 (the preset keeps fp32 masters)
        assert more.optimizer_states - plain.optimizer_states == pytest.approx(2 * plain.params_sharded), comm
