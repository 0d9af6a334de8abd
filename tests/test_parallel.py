"""Stage splits, batch arithmetic and split-independent state-dict keys (no Ray)."""

import pytest
import torch

import rayflex as rf
from rayflex.mesh.plan import plan_mesh
from rayflex.mesh.stage_split import balanced_split
from rayflex.models.spec import build_stage

from conftest import small_gpt


def test_balanced_split_minimises_the_heaviest_stage():
    import itertools

    costs = [9, 1, 1, 1, 4, 4, 1, 7]
    best = min(max(sum(costs[a:b]) for a, b in zip((0,) + cuts, cuts + (8,)))
               for cuts in itertools.combinations(range(1, 8), 2))
    split = balanced_split(costs, 3)
    assert [i for s in split for i in s] == list(range(8)) and all(split)
    assert max(sum(costs[i] for i in s) for s in split) == best


def test_gpt_split_by_params_puts_fewer_layers_with_the_big_embedding():
    spec = small_gpt(n_layers=6)
    plan = plan_mesh(spec, rf.ParallelConfig(pp=2), rf.DataConfig(uri="file:///x", seq_len=32, global_batch=8), 4)
    counts = spec.param_counts()
    costs = [sum(counts[i] for i in blocks) for blocks in plan.stage_blocks]
    assert abs(costs[0] - costs[1]) <= max(counts)
    assert plan.stage_costs == tuple(float(c) for c in costs)


def test_batch_arithmetic_keeps_the_global_batch():
    spec = small_gpt()
    data = rf.DataConfig(uri="file:///x", seq_len=32, global_batch=24, micro_batch=3)
    p = plan_mesh(spec, rf.ParallelConfig(), data, 4)
    assert (p.dp, p.per_rank_batch, p.micro_batch, p.accum_steps) == (4, 6, 3, 2)
    p = plan_mesh(spec, rf.ParallelConfig(pp=2, microbatches=4), rf.DataConfig(uri="file:///x", global_batch=24), 4)
    assert (p.pp, p.dp, p.per_rank_batch, p.microbatches, p.micro_batch) == (2, 2, 12, 4, 3)
    with pytest.raises(rf.ConfigError, match="microbatches do not divide"):
        plan_mesh(spec, rf.ParallelConfig(pp=2, microbatches=5), rf.DataConfig(uri="file:///x", global_batch=24), 4)


def test_state_dict_keys_do_not_depend_on_the_split():
    spec = small_gpt(n_layers=3)
    whole = build_stage(spec, list(range(spec.num_blocks))).state_dict()
    parts = {}
    for blocks in ([0, 1], [2], [3, 4]):
        parts.update(build_stage(spec, blocks).state_dict())
    assert whole.keys() == parts.keys()
    for k in whole:  # same per-block seeds: identical initial weights
        torch.testing.assert_close(whole[k], parts[k], rtol=0, atol=0)
