"""One rank of tests/test_meta_init.py, in a spawned process (importable by the child).

A rank takes part in a list of layouts in turn; in each it builds its stage(s) twice, the
plain way (full seeded build, then ``shard_stage``) and on meta (``build_sharded_stages``),
and sends back the local tensors of both (and, without a pipeline, the losses of two
training steps of each).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from rayflex.models import GPTConfig
from rayflex.models.gpt_blocks import build_gpt_block, lm_loss
from rayflex.models.spec import ModelSpec

CFG = GPTConfig(vocab_size=96, seq_len=16, d_model=24, n_layers=3, n_heads=2)


class BufferedBlock(nn.Module):
    """A GPT block plus the buffers ``to_empty`` forgets: a seeded random persistent one
    and a rotary-style non-persistent one (an odd length: uneven everywhere)."""

    def __init__(self, inner: nn.Module, width: int):
        super().__init__()
        self.inner = inner
        self.register_buffer("mix", torch.randn(width))
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, width, 2).float() / width)),
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) * (1 + 0.01 * self.mix)


def build_test_block(cfg: GPTConfig, index: int) -> nn.Module:
    block = build_gpt_block(cfg, index)
    return BufferedBlock(block, cfg.d_model) if 0 < index <= cfg.n_layers else block


def buffered_spec() -> ModelSpec:
    return ModelSpec(name="gpt-buffers", num_blocks=CFG.n_layers + 2,
                     build_block=functools.partial(build_test_block, CFG), loss_fn=lm_loss,
                     hidden_size=CFG.d_model)


def local_tensors(stages) -> dict:
    """Every parameter's local shard and every buffer, by state-dict name (non-persistent
    too), as numpy arrays: a tensor would travel through shared memory that its sender,
    exiting, takes away."""
    from torch.distributed.tensor import DTensor

    out = {}
    for _, stage in stages:
        for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
            t = t.to_local() if isinstance(t, DTensor) else t
            out[name] = t.detach().numpy().copy()
    return out


def losses_of_two_steps(stages, spec: ModelSpec, rank: int) -> list[float]:
    """Two AdamW steps of a pp=1 stage on this rank's fixed batches: the training a user sees."""
    (_, model), = stages
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(2):
        tokens = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=gen)
        loss = spec.loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def run_rank(rank: int, layouts: list[tuple[int, int, int, str]], results) -> None:
    """``layouts``: (world, pp, stages per rank, rendezvous file) in order; a rank outside a
    layout's world sits it out. Answers are keyed (world, pp, stages per rank, rank)."""
    from datetime import timedelta

    import torch.distributed as dist

    import rayflex as rf
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.meta_init import build_sharded_stages
    from rayflex.worker.parallelize import build_device_mesh, build_local_stages, data_parallel_mesh, shard_stage
    from rayflex.worker import sharding_caches

    torch.set_num_threads(1)
    spec, device = buffered_spec(), torch.device("cpu")
    try:
        for world, pp, per_rank, store in layouts:
            if rank >= world:
                continue
            sharding_caches.new_attempt()
            # A file rendezvous: no port chosen long before it is bound (another process took one).
            dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                                    timeout=timedelta(seconds=60))
            parallel = (rf.ParallelConfig(pp=pp, schedule="interleaved", stages_per_rank=per_rank) if per_rank > 1
                        else rf.ParallelConfig(pp=pp))
            plan = plan_mesh(spec, parallel, rf.DataConfig(uri="file:///unused", global_batch=8), world)
            dp_mesh = data_parallel_mesh(build_device_mesh(plan, "cpu"), plan)
            plain = build_local_stages(spec, plan, rank, device)
            for _, module in plain:
                shard_stage(module, dp_mesh, pipelined=plan.pp > 1)
            meta = build_sharded_stages(spec, plan, rank, device,
                                        shard=lambda s, m: shard_stage(m, dp_mesh, pipelined=plan.pp > 1))
            answer = {"dp_index": plan.coords(rank)[1], "dp": plan.dp,
                      "plain": local_tensors(plain), "meta": local_tensors(meta)}
            if pp == 1:  # after the weights are compared: training changes them
                answer["losses"] = {"plain": losses_of_two_steps(plain, spec, rank),
                                    "meta": losses_of_two_steps(meta, spec, rank)}
            results.put(((world, pp, per_rank, rank), answer))
            del plain, meta
            dist.destroy_process_group()
    except BaseException:
        import traceback

        results.put(((None, None, None, rank), {"exception": traceback.format_exc()}))
