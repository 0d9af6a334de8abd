"""Tensor parallelism of HF decoder blocks from the plan transformers ships (rayflex.models.hf_tp):
two gloo ranks compute what one process computes, forward and backward."""

from __future__ import annotations

import pytest

from rayflex.errors import ConfigError
from rayflex.models.hf import causal_lm
from rayflex.mesh.rules import check_tp
from rayflex.models.hf_tp import tp_plan

from hf_helpers import SEQ_LEN, tiny_config
from spawn_ranks import run_ranks

FAMILIES = ("llama", "qwen3", "mistral")


def test_the_plan_is_transformers_own_for_one_decoder_layer():
    plan = tp_plan(causal_lm(tiny_config("llama")))
    assert plan == {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                    "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                    "mlp.down_proj": "rowwise"}
    assert tp_plan(causal_lm(tiny_config("qwen3")))["self_attn.q_norm"] == "replicated_with_grad_allreduce"


def test_the_embedding_and_head_split_by_vocabulary():
    plan = causal_lm(tiny_config("llama")).metadata["tp"]["plan"]
    assert plan["first"] == {"embed_tokens": "rowwise_replicated_input"}
    assert plan["last"] == {"lm_head": "colwise_gather_output"}


def test_a_model_without_a_plan_or_an_uneven_split_is_refused():
    gpt2 = causal_lm(tiny_config("gpt2"))
    with pytest.raises(ConfigError, match="cannot be split over tp=2 ranks: transformers ships no tensor-parallel "
                                          "plan for gpt2.*use tp=1"):
        check_tp(gpt2.metadata, 2, model=gpt2.name)
    check_tp(gpt2.metadata, 1)  # no split, nothing to check
    llama = causal_lm(tiny_config("llama"))
    with pytest.raises(ConfigError, match=r"tp=4 does not divide the key/value heads \(2\)"):
        check_tp(llama.metadata, 4)  # 4 attention heads, 2 key/value heads


def _tp_rank(rank: int, world: int, port: int, families: tuple) -> dict:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        return {family: _compare_block(family, world) for family in families}
    finally:
        dist.destroy_process_group()


def _compare_block(family: str, world: int) -> dict:
    """Decoder block 1 whole and split over ``world`` tp ranks: the largest differences of
    the output, the input's gradient and every parameter's (full) gradient."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from rayflex.models.tp_plan import apply_tp, sum_replicated_grads

    spec = causal_lm(tiny_config(family))
    torch.manual_seed(0)
    x = torch.randn(2, SEQ_LEN, spec.hidden_size)
    whole = spec.block(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    split = spec.block(1)
    summed = apply_tp(split, tp_plan(spec), mesh)
    out = {}
    for name, block in (("whole", whole), ("split", split)):
        xi = x.clone().requires_grad_(True)
        y = block(xi)
        y.square().mean().backward()
        if block is split:
            sum_replicated_grads(summed, mesh.get_group())
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).clone()
                 for n, p in block.named_parameters()}
        out[name] = (y.detach(), xi.grad.clone(), grads)
    (y0, gx0, g0), (y1, gx1, g1) = out["whole"], out["split"]
    local = dict(split.named_parameters())["self_attn.q_proj.weight"].to_local().shape
    return {"y": (y0 - y1).abs().max().item(), "gx": (gx0 - gx1).abs().max().item(),
            "grads": max((g0[n] - g1[n]).abs().max().item() for n in g0), "names": sorted(g0) == sorted(g1),
            "q_local_rows": local[0], "q_rows": g0["self_attn.q_proj.weight"].shape[0]}


@pytest.mark.multiproc
@pytest.mark.slow  # two processes importing transformers (~15 s of the suite); make test-slow
def test_two_tp_ranks_compute_what_one_process_computes():
    got = run_ranks(_tp_rank, 2, FAMILIES, timeout_s=120)  # one spawn for every family
    for rank, per_family in got.items():
        for family, r in per_family.items():
            assert r["names"] and r["q_local_rows"] * 2 == r["q_rows"], (family, rank, r)  # half the heads each
            assert r["y"] < 1e-6 and r["gx"] < 1e-6, (family, rank, r)
            assert r["grads"] < 1e-6, (family, rank, r)  # incl. Qwen3's q/k norms, summed over the tp group
