"""A tiny training state and a save that must commit: the single-process checkpoint tests'
common steps (storage backends, permissions, recorded fields)."""

from __future__ import annotations

import torch


def tiny_state(seed: int = 0, *, scheduler: bool = False, **fields):
    """A Linear layer after one AdamW step, at step 3; ``fields`` go to TrainState."""
    from rayflex.checkpoint.checkpointer import TrainState

    torch.manual_seed(seed)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    schedulers = [torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)] if scheduler else []
    return TrainState(modules=[model], optimizers=[opt], schedulers=schedulers, get_step=lambda: 3, **fields)


def save_committed(root: str, state, step: int = 3) -> None:
    """Save ``state`` as ``step`` under ``root`` (asynchronously, as a worker does) and
    require the commit."""
    from rayflex.checkpoint.checkpointer import AsyncCheckpointer

    ckpt = AsyncCheckpointer(root, rank=0, use_async=True, keep=2)
    ckpt.save(state, step=step)
    [report] = ckpt.wait(timeout_s=60)
    assert report.get("committed"), report.get("error")
