"""Plain single-process training of a TrainSpec: the ground truth rayflex is tested against.

Same blocks (same per-block seeds), same samples in the same order, same optimizer,
schedule and clipping — no Ray, no process group, no sharding. A rayflex run of any
pp x dp must reproduce these losses (fp32, to rounding).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from rayflex.config import TrainSpec
from rayflex.data.dataset import open_dataset
from rayflex.models.spec import build_stage


@dataclass
class ReferenceState:
    """The reference's model and optimizer after ``step`` steps: what a checkpoint of that
    step holds (the learning rate is not state; it follows the spec that continues)."""

    step: int
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    # The global gradient norm (before clipping) of each step this state was trained through.
    grad_norms: list = field(default_factory=list)


def single_process_train(spec: TrainSpec, steps: int, *,
                         start_state: ReferenceState | None = None) -> tuple[list[float], ReferenceState]:
    """Losses of steps ``start_state.step + 1 .. steps`` (1..steps without a start state),
    and the state after the last. Step ``s`` trains at ``lr_of_step(s, spec.run.steps)``
    as a rayflex worker does, so continuing a state under a spec with another
    ``run.steps`` is the reference of a resumed run that changed its total. The start
    state is copied, never trained further in place."""
    torch.set_num_threads(spec.scaling.torch_threads)
    opt_cfg = spec.run.optimizer
    if start_state is None:
        model = build_stage(spec.model, list(range(spec.model.num_blocks)))
        opt = opt_cfg.build(model.parameters())
        state = ReferenceState(step=0, model=model, optimizer=opt)
    else:
        state = copy.deepcopy(start_state)  # the optimizer's state keys follow the copied parameters
    model, opt = state.model, state.optimizer
    ds = open_dataset(spec.data)
    sampler = ds.sampler(spec.data)
    seq = spec.data.seq_len
    losses = []
    for step in range(state.step + 1, steps + 1):
        rows = ds.rows(sampler.indices(step - 1, 0, 1))
        x, y = rows[:, :seq], rows[:, 1:seq + 1]
        opt.zero_grad(set_to_none=True)
        loss = spec.model.loss_fn(model(x), y)
        loss.backward()
        clip = opt_cfg.grad_clip if opt_cfg.grad_clip is not None else float("inf")  # inf: measure only
        state.grad_norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        for group in opt.param_groups:
            group["lr"] = opt_cfg.lr_of_step(step, spec.run.steps)
        opt.step()
        losses.append(float(loss.detach()))
        state.step = step
    return losses, state


def single_process_losses(spec: TrainSpec, steps: int, *, start_state: ReferenceState | None = None) -> list[float]:
    """Losses of steps 1..steps (or from ``start_state.step + 1``), training the whole model
    in this process."""
    return single_process_train(spec, steps, start_state=start_state)[0]
