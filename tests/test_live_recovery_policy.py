"""The live-recovery policy: which failures the survivors' memory can recover from, and why not."""

import dataclasses

from rayflex.faults.live_recovery import (FromCheckpoint, LiveRecovery, RollForward, decide, holders_to_ask, lost_shard,
                                         roll_forward)
from rayflex.mesh.plan import MeshPlan

HSDP = MeshPlan(pp=1, dp=4, dp_replicate=2)  # ranks 0, 2 hold shard 0; 1, 3 shard 1


def _at(step, *ranks):
    return {r: {"step": step} for r in ranks}


def test_one_copy_of_every_shard_is_enough_and_the_lowest_holder_is_read():
    choice = decide(HSDP, _at(7, 0, 2, 3))
    assert choice == LiveRecovery(step=7, holders=(0, 3), reason=choice.reason)
    assert "ranks 0, 3" in choice.reason and "pp=1 x dp=4 (2x2 hsdp)" in choice.reason


def test_survivors_at_different_steps_recover_the_newest_step_the_holders_cover():
    # A rank that finished step 8's agreement before the fault and one that did not: step 8
    # has no copy of shard 1, step 7 has every shard.
    snapshots = {**_at(8, 0), **_at(7, 1, 2, 3)}
    assert decide(HSDP, snapshots) == LiveRecovery(step=7, holders=(1, 2), reason=decide(HSDP, snapshots).reason)
    mixed = {**_at(8, 0), **_at(7, 3)}
    choice = decide(HSDP, mixed)
    assert isinstance(choice, FromCheckpoint) and "different steps (7, 8)" in choice.reason


def _held(step, pending=None, recent_step=None):
    recent = None if recent_step is None else {"step": recent_step, "loss": 2.5, "lr": 0.01}
    return {"step": step, "pending": pending, "recent": recent}


def test_ranks_left_inside_an_agreement_a_peer_finished_roll_forward_to_it():
    # Rank 0 finished step 6's agreement; ranks 1 and 3 were left inside it (a frozen rank 2
    # had sent its share): they hold step 6's gradients, and apply them with rank 0's record.
    held = {0: _held(6, recent_step=6), 1: _held(5, pending=6, recent_step=5), 3: _held(5, pending=6, recent_step=5)}
    assert roll_forward(held) == RollForward(step=6, ranks=(1, 3), agreed={"step": 6, "loss": 2.5, "lr": 0.01})
    # Then every shard is held at step 6, and one survivor per shard is asked for it (rank 3
    # holds rank 1's shard again): only rank 1 rolls forward, and the reason says so.
    forward = roll_forward(held)
    assert holders_to_ask(HSDP, held, forward) == (0, 1)
    after = {0: {"step": 6}, 1: {"step": 6, "rolled_forward": 6}}
    choice = decide(HSDP, after)
    assert choice.step == 6 and choice.holders == (0, 1)
    assert "rank 1 was left inside step 6's closing agreement" in choice.reason


def test_no_survivor_is_asked_for_shards_another_already_holds():
    held = {r: _held(7, recent_step=7) for r in (0, 2, 3)}  # rank 1 died
    assert holders_to_ask(HSDP, held, None) == (0, 3)  # shard 0: ranks 0, 2; shard 1: rank 3 alone
    # No step with every shard (rank 3 a step behind, not inside the agreement): everyone is
    # asked, and decide says why.
    behind = {0: _held(7, recent_step=7), 2: _held(7, recent_step=7), 3: _held(6, recent_step=6)}
    assert holders_to_ask(HSDP, behind, roll_forward(behind)) is None


def test_no_roll_forward_without_a_peer_past_the_agreement_or_a_rank_inside_it():
    # Nobody finished step 6: the survivors all hold step 5 (the step re-runs, none is lost).
    assert roll_forward({0: _held(5, pending=6, recent_step=5), 1: _held(5, recent_step=5)}) is None
    # All finished: nothing to apply.
    assert roll_forward({0: _held(6, recent_step=6), 1: _held(6, recent_step=6)}) is None
    # A rank behind that was not inside step 6's agreement holds no gradients of it.
    assert roll_forward({0: _held(6, recent_step=6), 1: _held(5, recent_step=5)}) is None
    # A finisher without its record (a fresh process: nothing trained) gives nothing to apply with.
    assert roll_forward({0: _held(6), 1: _held(5, pending=6)}) is None
    assert roll_forward({}) is None


def test_what_stands_in_the_way_is_named():
    assert "every copy of FSDP shard 1 was lost with ranks 1, 3" in decide(HSDP, _at(5, 0, 2)).reason
    failed = decide(HSDP, {**_at(5, 0, 1), 3: {"step": 5, "error": "its update of step 6 was being applied"}})
    assert failed.holders == (0, 1)  # rank 3's failure does not matter: rank 1 holds shard 1
    broken = decide(HSDP, {**_at(5, 0), 3: {"step": 5, "error": "snapshot failed: OSError"}})
    assert isinstance(broken, FromCheckpoint) and "rank 3: snapshot failed: OSError" in broken.reason
    assert decide(HSDP, {}).reason.startswith("every copy of FSDP shard 0")


def test_pipeline_and_tp_shards_are_told_apart():
    plan = MeshPlan(pp=2, dp=2, tp=2, dp_replicate=2)  # 8 ranks; replicas differ only in dp
    assert lost_shard(plan, set(range(8)) - {0}) is None
    assert lost_shard(plan, set(range(8)) - {0, 2}) == "every copy of stage 0, FSDP shard 0, tp rank 0 was lost with ranks 0, 2"
    plain = MeshPlan(pp=1, dp=2)
    assert "rank 1 held the only copy" in lost_shard(plain, {0}) and "dp_replicate=1" in lost_shard(plain, {0})


def test_the_switch_is_a_bool_and_says_so():
    import pytest

    import rayflex as rf
    from rayflex.errors import ConfigError

    assert rf.ElasticConfig().live_recovery is True
    with pytest.raises(ConfigError, match="ElasticConfig.live_recovery.*must be True or False"):
        rf.ElasticConfig(live_recovery="yes")


def test_a_mesh_whose_replicas_train_apart_is_not_asked_for_live_state():
    """DiLoCo, the spec's or the planner's pick carried by the mesh (CommConfig(replicate=
    "auto")): the replicas' weights differ between syncs, so recovery reads the checkpoint."""
    from types import SimpleNamespace

    import rayflex as rf
    from rayflex.control.live_state import worth_asking

    spec = SimpleNamespace(elastic=rf.ElasticConfig(), comm=rf.CommConfig())
    ctx = SimpleNamespace(spec=spec, ledger=SimpleNamespace(step=7))
    assert worth_asking(ctx, HSDP, {1}) == (True, None)
    apart = dataclasses.replace(HSDP, replicate_choice=(("replicate", "diloco"), ("inner_steps", 16)))
    asked, chosen = worth_asking(ctx, apart, {1})
    assert not asked and chosen.source == "checkpoint" and "DiLoCo" in chosen.reason and chosen.step == 7
