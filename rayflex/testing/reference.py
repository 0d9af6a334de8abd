"""Plain single-process training of a TrainSpec: the ground truth rayflex is tested against.

Same blocks (same per-block seeds), same samples in the same order, same optimizer,
schedule and clipping — no Ray, no process group, no sharding. A rayflex run of any
pp x dp must reproduce these losses (fp32, to rounding).
"""

from __future__ import annotations

import torch

from rayflex.data.dataset import GlobalSampler, TokenDataset
from rayflex.config import TrainSpec
from rayflex.models.spec import build_stage


def single_process_losses(spec: TrainSpec, steps: int, *, start_state: dict | None = None) -> list[float]:
    """Losses of steps 1..steps, training the whole model in this process."""
    torch.set_num_threads(spec.scaling.torch_threads)
    model = build_stage(spec.model, list(range(spec.model.num_blocks)))
    opt_cfg = spec.run.optimizer
    opt = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, betas=tuple(opt_cfg.betas),
                            weight_decay=opt_cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: opt_cfg.lr_factor(s, spec.run.steps))
    ds = TokenDataset(spec.data.uri)
    sampler = GlobalSampler(len(ds), spec.data.global_batch, spec.data.seed)
    seq = spec.data.seq_len
    losses = []
    for step in range(1, steps + 1):
        rows = ds.rows(sampler.indices(step - 1, 0, 1))
        x, y = rows[:, :seq], rows[:, 1:seq + 1]
        opt.zero_grad(set_to_none=True)
        loss = spec.model.loss_fn(model(x), y)
        loss.backward()
        if opt_cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.grad_clip)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
    return losses
