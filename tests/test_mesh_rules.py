"""The mesh rules (``rayflex.mesh.rules``): which world sizes a run can use, the error a
broken rule raises, and that config validation, elastic sizing, ``plan_mesh`` and the
capacity search agree on every example (no Ray)."""

import dataclasses

import pytest

import rayflex as rf
from rayflex.config import TrainSpec
from rayflex.faults.policy import best_world_size, valid_world_sizes
from rayflex.mesh import rules
from rayflex.mesh.plan import plan_mesh
from rayflex.planning.capacity.memory import describe_model
from rayflex.planning.capacity.search import enumerate_layouts

from conftest import SEQ_LEN, small_gpt

MODEL = small_gpt()  # 4 blocks: embedding, 2 layers, head
DATA = "file:///nonexistent/rayflex-rules"  # never read


def _spec(*, pp=1, schedule="1f1b", stages_per_rank=1, microbatches=None, global_batch=8, micro_batch=None,
          num_workers=8, min_workers=None, max_workers=None):
    return TrainSpec(model=MODEL, data=rf.DataConfig(uri=DATA, seq_len=SEQ_LEN, global_batch=global_batch,
                                                     micro_batch=micro_batch),
                     run=rf.RunConfig(name="rules", storage="file:///tmp/rayflex-test"),
                     scaling=rf.ScalingConfig(num_workers=num_workers, min_workers=min_workers,
                                              max_workers=max_workers),
                     parallel=rf.ParallelConfig(pp=pp, schedule=schedule, stages_per_rank=stages_per_rank,
                                                microbatches=microbatches))


# name -> (spec, the world sizes in 1..8 it can run at, largest first)
EXAMPLES = {
    "fsdp": (_spec(), [8, 4, 2, 1]),
    # micro_batch 4 must divide the per-rank batch 16/dp: not at dp=8 (2 samples per rank)
    "fsdp-micro-batch": (_spec(global_batch=16, micro_batch=4, num_workers=4), [4, 2, 1]),
    # 2 microbatches (one per stage) need a per-rank batch of 2, 4 or 8: dp 4, 2, 1
    "1f1b": (_spec(pp=2, num_workers=4), [8, 4, 2]),
    "1f1b-m4": (_spec(pp=2, microbatches=4, num_workers=4), [4, 2]),
    # 2 x 2 virtual stages: 4 microbatches, so dp=4 (2 samples per rank) cannot feed them
    "interleaved": (_spec(pp=2, schedule="interleaved", stages_per_rank=2, num_workers=4), [4, 2]),
    "gpipe-pp4": (_spec(pp=4, schedule="gpipe", global_batch=16, num_workers=4), [8, 4]),
}


def _elastic(spec, num_workers):
    """``spec`` as an elastic run of 1..8 workers (a minimum of whole pipelines)."""
    return dataclasses.replace(spec, scaling=rf.ScalingConfig(num_workers=num_workers, min_workers=spec.parallel.pp,
                                                              max_workers=8))


def _sizes_by_config(spec):
    """The sizes config validation accepts as a fixed-size run."""
    ok = []
    for n in range(8, 0, -1):
        try:
            dataclasses.replace(spec, scaling=rf.ScalingConfig(num_workers=n))
        except rf.ConfigError:
            continue
        ok.append(n)
    return ok


def _sizes_by_plan_mesh(spec):
    ok = []
    for n in range(8, 0, -1):
        try:
            plan_mesh(spec.model, spec.parallel, spec.data, n)
        except rf.ConfigError:
            continue
        ok.append(n)
    return ok


def _matches(layout, spec):
    """Whether the capacity search's ``layout`` is the mesh ``spec`` asks for."""
    p, d = spec.parallel, spec.data
    if layout.pp != p.pp:
        return False
    if p.pp == 1:
        per_rank = d.global_batch // layout.dp
        return layout.micro_batch == (d.micro_batch or per_rank)
    return ((layout.schedule, layout.stages_per_rank, layout.microbatches)
            == (p.schedule, p.stages_per_rank, p.microbatches or p.num_stages))


def _sizes_by_search(spec):
    model = describe_model(spec.model, spec.data.seq_len)
    return [n for n in range(8, 0, -1)
            if any(not isinstance(lay, tuple) and _matches(lay, spec)
                   for lay in enumerate_layouts(model, n, spec.data.global_batch))]


# ------------------------------------------------------------------------------ valid sizes
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_valid_world_sizes(name):
    spec, sizes = EXAMPLES[name]
    spec = _elastic(spec, sizes[0])
    assert valid_world_sizes(spec) == sizes
    assert best_world_size(spec, 7) == next(n for n in sizes if n <= 7)


def test_valid_world_sizes_for_auto():
    spec = TrainSpec(model=MODEL, data=rf.DataConfig(uri=DATA, seq_len=SEQ_LEN, global_batch=8),
                     run=rf.RunConfig(name="rules"), scaling=rf.ScalingConfig(num_workers=8, min_workers=1),
                     parallel=rf.ParallelConfig(pp="auto"))
    # 7 and 5: dp=7/5 do not divide 8 and pp=7/5 exceed the 4 blocks; 6 runs as pp=3 x dp=2
    assert valid_world_sizes(spec) == [8, 6, 4, 3, 2, 1]
    assert rules.pp_options(6, 8, 4) == [3] and rules.pp_options(8, 8, 4) == [1, 2, 4]
    assert rules.pp_options(8, 8, 2) == [1, 2]  # a 2-block model cannot have 4 stages
    # batch 4: dp=8 does not divide it; pp=2/4 leave 1/2 samples per rank for 2/4 stages
    assert rules.pp_options(8, 4, 4) == []


def test_valid_world_sizes_stay_within_the_bounds():
    spec, _ = EXAMPLES["1f1b"]
    spec = dataclasses.replace(spec, scaling=rf.ScalingConfig(num_workers=4, min_workers=4, max_workers=8))
    assert valid_world_sizes(spec) == [8, 4]
    assert best_world_size(spec, 3) is None


# ------------------------------------------------------------------------------ agreement
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_config_elastic_plan_mesh_and_search_agree(name):
    spec, sizes = EXAMPLES[name]
    assert _sizes_by_config(spec) == sizes
    assert _sizes_by_plan_mesh(spec) == sizes
    assert _sizes_by_search(spec) == sizes
    assert valid_world_sizes(_elastic(spec, sizes[0])) == sizes


def test_every_layout_the_search_offers_is_one_plan_mesh_builds():
    model = describe_model(MODEL, SEQ_LEN)
    seen = set()
    for world in range(1, 9):
        for gb in (4, 6, 8, 12, 16):
            for lay in enumerate_layouts(model, world, gb):
                if isinstance(lay, tuple):
                    continue
                seen.add((lay.pp, lay.schedule))
                if lay.pp == 1:
                    parallel = rf.ParallelConfig()
                else:
                    parallel = rf.ParallelConfig(pp=lay.pp, schedule=lay.schedule, microbatches=lay.microbatches,
                                                 stages_per_rank=lay.stages_per_rank)
                data = rf.DataConfig(uri=DATA, seq_len=SEQ_LEN, global_batch=gb,
                                     micro_batch=lay.micro_batch if lay.pp == 1 else None)
                mesh = plan_mesh(MODEL, parallel, data, world)
                assert (mesh.dp, mesh.microbatches, mesh.micro_batch, mesh.accum_steps) == (
                    lay.dp, lay.microbatches, lay.micro_batch, lay.accum_steps), lay
                assert mesh.stage_blocks == lay.stage_blocks
    assert {"none", "gpipe", "1f1b", "interleaved"} == {s for _, s in seen}


def test_the_search_never_offers_an_interleaved_count_the_rules_reject():
    model = describe_model(MODEL, SEQ_LEN)
    layouts = [lay for lay in enumerate_layouts(model, 4, 24, max_stages_per_rank=2)
               if not isinstance(lay, tuple) and lay.schedule == "interleaved"]
    # pp=2 x dp=2: 12 samples per rank; 3 is a divisor but not whole rounds of 2
    assert sorted({lay.microbatches for lay in layouts}) == [2, 4, 6, 12]


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("make, field, problem, fix", [
    (lambda: _spec(pp=2, num_workers=3), "ScalingConfig.num_workers",
     "num_workers=3 is not divisible by ParallelConfig.pp=2", "multiple of 2 workers"),
    (lambda: _spec(pp=2, num_workers=4, min_workers=3), "ScalingConfig.min_workers",
     "min_workers=3 is not divisible by ParallelConfig.pp=2", "multiple of 2 workers"),
    (lambda: _spec(pp=2, schedule="interleaved", stages_per_rank=4, num_workers=4), "ParallelConfig.pp",
     "8 pipeline stages for a model of only 4 blocks", "pp * stages_per_rank <= 4"),
    (lambda: _spec(global_batch=10, num_workers=4), "DataConfig.global_batch",
     "global_batch=10 is not divisible by the data-parallel size 4", "use a multiple of 4"),
    (lambda: _spec(micro_batch=3, num_workers=4), "DataConfig.micro_batch",
     "micro_batch=3 does not divide the per-rank batch 2", "divisor of 2"),
    (lambda: rf.ParallelConfig(pp=4, microbatches=2), "ParallelConfig.microbatches",
     "microbatches=2 is fewer than pp=4", "microbatches >= 4"),
    (lambda: rf.ParallelConfig(pp=2, schedule="interleaved", stages_per_rank=2, microbatches=3),
     "ParallelConfig.microbatches", "interleaved schedule needs microbatches (3) divisible by pp (2)",
     "multiple of 2"),
    (lambda: _spec(pp=2, microbatches=4, num_workers=8), "ParallelConfig.microbatches",
     "4 microbatches do not divide the per-rank batch 2", "divisor of 2 that is >= 2"),
])
def test_each_broken_rule_names_the_field_and_the_fix(make, field, problem, fix):
    with pytest.raises(rf.ConfigError) as info:
        make()
    assert info.value.field == field
    assert problem in info.value.problem and fix in info.value.fix
    assert "Fix:" in str(info.value)


def test_auto_without_any_mesh_names_pp_and_the_fix():
    with pytest.raises(rf.ConfigError) as info:
        TrainSpec(model=MODEL, data=rf.DataConfig(uri=DATA, seq_len=SEQ_LEN, global_batch=4),
                  run=rf.RunConfig(name="rules"), scaling=rf.ScalingConfig(num_workers=8),
                  parallel=rf.ParallelConfig(pp="auto"))
    assert info.value.field == "ParallelConfig.pp" and "multiple of 8" in info.value.fix


def test_plan_mesh_raises_the_same_errors_at_a_restart_size():
    spec, _ = EXAMPLES["1f1b"]
    with pytest.raises(rf.ConfigError) as info:
        plan_mesh(spec.model, spec.parallel, spec.data, 3)
    assert info.value.field == "ScalingConfig.num_workers" and "world_size=3" in info.value.problem
    with pytest.raises(rf.ConfigError) as info:
        plan_mesh(spec.model, spec.parallel, spec.data, 6)  # dp=3
    assert info.value.field == "DataConfig.global_batch" and "multiple of 3" in info.value.fix
    spec, _ = EXAMPLES["interleaved"]
    with pytest.raises(rf.ConfigError) as info:
        plan_mesh(spec.model, spec.parallel, spec.data, 8)  # 2 samples per rank, 4 microbatches
    assert info.value.field == "ParallelConfig.microbatches" and "divisor of 2" in info.value.fix


def test_a_pipeline_ignores_the_accumulation_micro_batch():
    # micro_batch is the pp == 1 accumulation size; a pipeline cuts its microbatches itself,
    # so a micro_batch that does not divide its per-rank batch is no error anywhere.
    spec = _spec(pp=2, micro_batch=3, num_workers=4)
    mesh = plan_mesh(spec.model, spec.parallel, spec.data, 4)
    assert (mesh.per_rank_batch, mesh.microbatches, mesh.micro_batch, mesh.accum_steps) == (4, 2, 2, 1)
    assert valid_world_sizes(_elastic(spec, 4)) == [8, 4, 2]


# ------------------------------------------------------------------------------ arithmetic
def test_split_batch_keeps_the_global_batch():
    split = rules.split_batch(4, 24, micro_batch=3)
    assert (split.per_rank_batch, split.microbatches, split.micro_batch, split.accum_steps) == (6, 1, 3, 2)
    split = rules.split_batch(4, 24, pp=2, microbatches=4)
    assert (split.per_rank_batch, split.microbatches, split.micro_batch, split.accum_steps) == (12, 4, 3, 1)
    split = rules.split_batch(4, 24, pp=2, schedule="interleaved", stages_per_rank=2)
    assert (split.microbatches, split.micro_batch) == (4, 3)  # one microbatch per virtual stage


def test_microbatch_options():
    assert rules.microbatch_options(2, 12, "1f1b") == [2, 3, 4, 6, 12]
    assert rules.microbatch_options(2, 12, "interleaved") == [2, 4, 6, 12]
    assert rules.microbatch_options(2, 12, "1f1b", max_microbatches=4) == [2, 3, 4]
    assert rules.microbatch_options(4, 2, "1f1b") == []
    assert rules.divisors(12) == [1, 2, 3, 4, 6, 12] and rules.divisors(1) == [1]
