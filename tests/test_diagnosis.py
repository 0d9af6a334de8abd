"""The hang diagnosis on hand-made flight records: each kind of deadlock gets its verdict,
naming the rank(s), the group and the collective; the policy fails a run whose program
hangs the same way twice. No Ray, no torch (the cluster tests feed it real records)."""

from __future__ import annotations

import rayflex as rf
from rayflex.faults.diagnosis import diagnose
from rayflex.faults.policy import Fail, FailurePolicy, Restart
from rayflex.models.summary import ModelSummary
from rayflex.worker.status import CollectiveEntry, FlightRecord

DP = ("dp", (0, 1, 2, 3))
WORLD = ("world", (0, 1, 2, 3))
GRAD = ("all_reduce", ((1,),), ("float",))
CONTROL = ("all_reduce", ((3,),), ("double",))
RS = ("reduce_scatter", ((64,),), ("float",))


def entry(group, seq, sig, done=True, t=0.0, p2p=False):
    (label, members), (op, sizes, dtypes) = group, sig
    return CollectiveEntry(group=label, members=members, seq=seq, op=op, sizes=sizes, dtypes=dtypes,
                           completed=done, p2p=p2p, started=1000.0 + t + seq * 0.01, step=1)


def record(rank, entries, phase="collective", step=2):
    return FlightRecord(rank=rank, step=step, phase=phase, entries=tuple(entries))


def one_step(start=1):
    """A finished step: three dp reduce-scatters, then the grad-norm and control all-reduces."""
    return [entry(DP, start + i, RS) for i in range(3)] + [entry(WORLD, start, GRAD), entry(WORLD, start + 1, CONTROL)]


def test_a_frozen_rank_is_named_with_the_collective_its_peers_wait_in():
    records = {r: record(r, one_step() + [entry(DP, 4, RS, done=False, t=5)]) for r in (0, 1, 2)}
    d = diagnose(records, world_size=4, silent={3})
    assert d.kind == "not_responding" and d.ranks == (3,)
    assert d.sentence == "rank 3 is not responding; ranks 0-2 wait in reduce_scatter #4 of the dp group (ranks 0-3)"
    assert [row["rank"] for row in d.table] == [0, 1, 2, 3] and d.table[3]["phase"] == "not responding"
    assert not d.program_level


def test_a_rank_that_skipped_a_dp_collective_and_went_on_is_missing_from_it():
    waiting = {r: record(r, one_step() + [entry(DP, 4, RS, done=False, t=5)]) for r in (0, 2, 3)}
    # Rank 1 skipped dp #4 and waits in the world group's grad-norm all-reduce instead.
    waiting[1] = record(1, one_step() + [entry(WORLD, 3, GRAD, done=False, t=6)])
    d = diagnose(waiting, world_size=4)
    assert d.kind == "missing" and d.ranks == (1,) and (d.group, d.op, d.seq) == ("dp", "reduce_scatter", 4)
    assert "rank 1 never entered reduce_scatter #4 of the dp group (ranks 0-3) that ranks 0, 2, 3 wait in" in d.sentence
    assert "went on to all_reduce #3 of the world group" in d.sentence
    assert d.program_level


def test_a_skip_that_pairs_with_the_next_collective_is_still_called_a_skip():
    # Everything on one group: rank 1 skipped the grad-norm all-reduce, so its control
    # all-reduce meets the others' grad-norm one at the same number.
    history = one_step()
    records = {r: record(r, history + [entry(WORLD, 3, GRAD, done=False, t=5)]) for r in (0, 2, 3)}
    records[1] = record(1, history + [entry(WORLD, 3, CONTROL, done=False, t=5)])
    d = diagnose(records, world_size=4)
    assert d.kind == "missing" and d.ranks == (1,) and d.op == "all_reduce"
    assert d.sentence.startswith("rank 1 skipped all_reduce #3 of the world group (ranks 0-3)")


def test_a_broadcast_where_the_others_all_reduce_is_an_op_mismatch():
    records = {r: record(r, one_step() + [entry(WORLD, 3, GRAD, done=False, t=5)]) for r in (0, 2, 3)}
    records[1] = record(1, one_step() + [entry(WORLD, 3, ("broadcast", ((1,),), ("float",)), done=True, t=5)])
    d = diagnose(records, world_size=4)
    assert d.kind == "op_mismatch" and d.ranks == (1,)
    assert d.sentence == "rank 1 called broadcast #3 of the world group (ranks 0-3) where ranks 0, 2, 3 called all_reduce"


def test_a_tensor_of_another_size_is_a_size_mismatch():
    records = {r: record(r, one_step() + [entry(WORLD, 3, GRAD, done=False, t=5)]) for r in (0, 1, 3)}
    records[2] = record(2, one_step() + [entry(WORLD, 3, ("all_reduce", ((2,),), ("float",)), done=False, t=5)])
    d = diagnose(records, world_size=4)
    assert d.kind == "size_mismatch" and d.ranks == (2,)
    assert d.sentence == ("rank 2 passed float[2] to all_reduce #3 of the world group (ranks 0-3) where ranks 0, 1, 3 "
                          "passed float[1]")


def test_a_rank_still_computing_is_behind():
    records = {r: record(r, one_step() + [entry(DP, 4, RS, done=False, t=5)]) for r in (0, 1, 2)}
    records[3] = record(3, one_step()[:2], phase="forward_backward")
    d = diagnose(records, world_size=4)
    assert d.kind == "behind" and d.ranks == (3,) and not d.program_level
    assert d.sentence.startswith("rank 3 is behind by 1 collective in the dp group (ranks 0-3) "
                                 "(rank 3 in forward_backward at step 2)")


def test_every_rank_in_the_same_collective_is_a_transport_problem():
    records = {r: record(r, one_step() + [entry(DP, 4, RS, done=False, t=5)]) for r in range(4)}
    d = diagnose(records, world_size=4)
    assert d.kind == "all_waiting" and d.ranks == () and not d.program_level
    assert "the program agrees" in d.sentence


def test_the_first_stuck_group_is_the_cause():
    # Rank 1 went on to the world group after skipping dp #4: the world group looks stuck
    # too (ranks 0, 2, 3 never entered its #3), but dp #4 was issued first.
    waiting = {r: record(r, one_step() + [entry(DP, 4, RS, done=False, t=1)]) for r in (0, 2, 3)}
    waiting[1] = record(1, one_step() + [entry(WORLD, 3, GRAD, done=False, t=9)])
    assert diagnose(waiting, world_size=4).group == "dp"


def test_a_stage_that_sent_one_microbatch_too_few():
    pp = ("pp", (0, 1))
    act = (((2, 32, 32),), ("float",))
    send, recv = ("send", *act), ("recv", *act)

    def ops(rank, sigs, step, first_seq, pending_last=False):
        out = []
        for i, sig in enumerate(sigs):
            last = pending_last and i == len(sigs) - 1
            e = entry(pp, first_seq + i, sig, done=not last, p2p=True, t=step * 10 + i)
            out.append(CollectiveEntry(**{**e.__dict__, "step": step}))
        return out

    # Step 1 (whole): stage 0 sends two microbatches and receives their gradients. Step 2:
    # stage 0 dropped its first send and went on; stage 1 waits for the second microbatch.
    stage0 = ops(0, [send, send, recv, recv], 1, 1) + ops(0, [send, recv], 2, 5, pending_last=True)
    stage1 = ops(1, [recv, recv, send, send], 1, 1) + ops(1, [recv, recv], 2, 5, pending_last=True)
    d = diagnose({0: record(0, stage0), 1: record(1, stage1)}, world_size=2)
    assert d.kind == "p2p_mismatch" and d.ranks == (0,) and d.group == "pp" and d.program_level
    assert d.sentence == ("rank 0 sent 1 messages in step 2 of the pp group (ranks 0, 1) where it sent 2 in step 1 "
                          "(1 too few); rank 1 waits in recv #6 for one that never comes")


def test_without_records_the_verdict_says_why():
    off = FlightRecord(rank=0, step=3, phase="collective", available=False, error="the flight recorder is off")
    d = diagnose({0: off}, world_size=2, silent={1})
    assert d.kind == "not_responding" and "the flight recorder is off" in d.sentence


def _policy(tmp_path):
    model = ModelSummary(name="m", num_blocks=4, hidden_size=8, init_seed=1, block_params=(10, 10, 10, 10))
    return FailurePolicy(rf.TrainSpec(model=model, data=rf.DataConfig(uri="file:///x", seq_len=8, global_batch=8),
                                      run=rf.RunConfig(name="r", storage=f"file://{tmp_path}", steps=8),
                                      scaling=rf.ScalingConfig(num_workers=4)))


def test_the_same_mismatch_twice_at_the_same_step_fails_the_run_with_the_verdict(tmp_path):
    records = {r: record(r, one_step() + [entry(WORLD, 3, GRAD, done=False, t=5)]) for r in (0, 2, 3)}
    records[1] = record(1, one_step() + [entry(WORLD, 3, ("broadcast", ((1,),), ("float",)), t=5)])
    d = diagnose(records, world_size=4)
    policy = _policy(tmp_path)
    first = policy.decide(kind="failure", step=5, committed_step=4, usable_slots=4, error="no step finished for 15.1s",
                          diagnosis=d)
    assert isinstance(first, Restart)
    again = policy.decide(kind="failure", step=5, committed_step=4, usable_slots=4, error="no step finished for 16.3s",
                          diagnosis=d)
    assert isinstance(again, Fail) and "a bug in the training program" in again.reason and d.sentence in again.reason


def test_a_transport_hang_twice_is_not_called_a_bug(tmp_path):
    records = {r: record(r, one_step() + [entry(DP, 4, RS, done=False)]) for r in range(4)}
    d = diagnose(records, world_size=4)
    policy = _policy(tmp_path)
    for stalled in ("15.1", "16.3"):
        decision = policy.decide(kind="failure", step=5, committed_step=4, usable_slots=4,
                                 error=f"no step finished for {stalled}s", diagnosis=d)
        assert isinstance(decision, Restart)


# ----------------------------------------------------------------- a rank that changed its program
AG = ("all_gather", ((16,),), ("float",))
AR = ("all_reduce", ((16,),), ("float",))
NORM = ("all_reduce", ((),), ("float",))


def steps(*per_step, group=("dp", (0, 1)), pending_last=True, first_seq=1):
    """Entries for consecutive steps 1, 2, ... of one group; the last op is pending."""
    out, seq, t = [], first_seq, 0.0
    for k, sigs in enumerate(per_step, start=1):
        for sig in sigs:
            t += 1
            out.append(CollectiveEntry(group=group[0], members=group[1], seq=seq, op=sig[0], sizes=sig[1],
                                       dtypes=sig[2], completed=True, p2p=sig[0] in ("send", "recv"),
                                       started=1000.0 + t, step=k))
            seq += 1
    if pending_last and out:
        out[-1] = CollectiveEntry(**{**out[-1].__dict__, "completed": False})
    return out


STEP = [AG, AG, AR, AR, NORM, CONTROL]


def test_a_rank_that_skipped_the_last_collective_of_a_step_is_named_from_its_own_history():
    # Rank 1 skipped step 3's control all-reduce and went on to step 4's first all-gather,
    # which met rank 0's control all-reduce at the same number.
    r0 = record(0, steps(STEP, STEP, STEP), step=2)
    r1 = record(1, steps(STEP, STEP, STEP[:-1], STEP[:1]), step=3)
    d = diagnose({0: r0, 1: r1}, world_size=2)
    assert d.kind == "missing" and d.ranks == (1,) and d.op == "all_reduce" and d.seq == 18
    assert d.sentence.startswith("rank 1 skipped all_reduce #18 of the dp group (ranks 0, 1) in step 3: it went on "
                                 "to all_gather #18 of the dp group (ranks 0, 1)")


def test_a_rank_that_passed_a_bigger_tensor_is_named_even_when_its_peer_died_of_it():
    grown = ("all_reduce", ((17,),), ("float",))
    r1 = record(1, steps(STEP, STEP, [AG, AG, grown]), step=2)
    d = diagnose({1: r1}, world_size=2, silent={0})
    assert d.kind == "size_mismatch" and d.ranks == (1,) and d.program_level
    assert d.sentence.startswith("rank 1 passed float[17] to all_reduce #15 of the dp group (ranks 0, 1) in step 3, "
                                 "float[16] at the same point of step 2")
    assert "rank 0 is not responding" in d.sentence


def test_a_rank_that_broadcast_instead_is_named_with_what_its_peer_called():
    bcast = ("broadcast", ((16,),), ("float",))
    r0 = record(0, steps(STEP, STEP, STEP[:3]), step=2)
    r1 = record(1, steps(STEP, STEP, STEP[:2] + [bcast]), step=2)
    d = diagnose({0: r0, 1: r1}, world_size=2)
    assert d.kind == "op_mismatch" and d.ranks == (1,)
    assert d.sentence.startswith("rank 1 called broadcast #15 of the dp group (ranks 0, 1) in step 3 where it called "
                                 "all_reduce of the dp group (ranks 0, 1) in step 2, where rank 0 called "
                                 "all_reduce(float[16])")


def test_a_rank_stuck_partway_through_a_step_did_not_change_its_program():
    r0 = record(0, steps(STEP, STEP, STEP[:3]), step=2)
    r1 = record(1, steps(STEP, STEP, STEP[:3]), step=2)
    assert diagnose({0: r0, 1: r1}, world_size=2).kind == "all_waiting"


def test_a_bad_flight_recorder_size_is_a_config_error_naming_the_field():
    import pytest

    from rayflex.errors import ConfigError

    for bad in (-1, 2.5, "2000", True):
        with pytest.raises(ConfigError, match=r"ElasticConfig\.flight_recorder.*must be an integer >= 0"):
            rf.ElasticConfig(flight_recorder=bad)
    assert rf.ElasticConfig(flight_recorder=0).flight_recorder == 0  # off


def test_a_malformed_collective_fault_says_the_expected_form():
    import pytest

    from rayflex.worker.collective_faults import CollectiveFault

    with pytest.raises(ValueError, match=r"RANK:STEP:ACTION:OP\[:GROUP\[:NTH\]\] with ACTION one of skip"):
        CollectiveFault.parse("1:3:explode:all_reduce")
    assert CollectiveFault.parse("1:3:skip:all_reduce:dp:2") == CollectiveFault(1, 3, "skip", "all_reduce", "dp", 2)
