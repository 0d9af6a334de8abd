"""DiLoCo: replica groups that train apart and meet every ``inner_steps``.

Each replica group (a ``dp_shard`` FSDP mesh of its own) steps its inner optimizer on its
own batches; no gradient crosses the slow tier. At a sync each rank takes the
pseudo-gradient of its shard, ``anchor - params`` (how far its replica moved since the
last sync), averages it over the replicate group (:class:`ReplicateReducer`: fp32, bf16 or
int8 with error feedback) and takes an outer Nesterov-SGD step on the anchor; every
replica continues from the new anchor. With ``fragments`` > 1 (streaming DiLoCo) the
parameters are cut into that many pieces of about equal size, synchronised at staggered
steps, so the slow tier carries a fragment at a time.

The outer state — the momentum and the anchor (each fragment's parameters at its last
sync) — is sharded like the parameters (a DTensor each), so a checkpoint saves and
reshards it as it does them. A save does not synchronise: each replica saves its own
model and inner optimizer state beside the shared outer state, so a run resumed at the
same number of replicas continues exactly where it stopped, mid-round or not; resumed at
another number, every replica starts from the anchor (the progress since each
fragment's last sync is what is given up, never the data position).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rayflex.checkpoint.checkpointer import COMMON_MODEL
from rayflex.worker.slow_tier.reduce import ReplicateReducer


MOMENTUM, ANCHOR = "outer_momentum", COMMON_MODEL  # their checkpoint sections


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def fragment_ranges(sizes: list[int], fragments: int) -> list[range]:
    """Contiguous runs of the parameters (in order) of about equal total size, one per
    fragment; fewer when there are fewer parameters than fragments."""
    fragments = max(1, min(fragments, len(sizes)))
    total = sum(sizes)
    out, start, acc = [], 0, 0
    for i, size in enumerate(sizes):
        acc += size
        if len(out) < fragments - 1 and acc >= total * (len(out) + 1) / fragments and i + 1 < len(sizes):
            out.append(range(start, i + 1))
            start = i + 1
    out.append(range(start, len(sizes)))
    return out


def sync_offset(fragment: int, fragments: int, inner_steps: int) -> int:
    """The step (mod ``inner_steps``) at which ``fragment`` synchronises: staggered evenly,
    the last one at multiples of ``inner_steps``."""
    return ((fragment + 1) * inner_steps // fragments) % inner_steps


class DiLoCo:
    """The outer loop over this rank's shards of ``named_params`` (the stage modules'
    parameters, FQN-keyed)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], reducer: ReplicateReducer, *,
                 inner_steps: int, lr: float, momentum: float, fragments: int = 1) -> None:
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self.reducer = reducer
        self.inner_steps = inner_steps
        self.lr = lr
        self.mu = momentum
        # Cut on the parameters' whole sizes: every rank of a stage cuts the same fragments,
        # whatever its shard's size.
        self.fragments = fragment_ranges([p.numel() for p in self.params], fragments)
        with torch.no_grad():
            self.momentum = [torch.zeros_like(p.detach()) for p in self.params]
            self.anchor_tensors = [p.detach().clone() for p in self.params]
        self.anchor = [local_tensor(a) for a in self.anchor_tensors]
        self._synced_at: dict[int, int] = {}  # fragment -> the step it last synchronised at

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """The parameters as they are become the replicas' common point (a restore from a
        checkpoint saved without DiLoCo)."""
        for a, p in zip(self.anchor, self.params):
            a.copy_(local_tensor(p))

    @torch.no_grad()
    def start_from_anchor(self) -> None:
        """Every replica continues from the anchor (a restore at another replica count)."""
        for a, p in zip(self.anchor, self.params):
            local_tensor(p).copy_(a)

    def due(self, step: int) -> list[int]:
        n = len(self.fragments)
        return [f for f in range(n) if step % self.inner_steps == sync_offset(f, n, self.inner_steps)]

    def sync(self, step: int, fragments: Optional[list[int]] = None) -> int:
        """Synchronise ``fragments`` (default: those due at ``step``; each at most once per
        step); returns how many were synchronised. Collective over the replicate group: every
        rank calls it at the same step with the same fragments."""
        todo = self.due(step) if fragments is None else fragments
        todo = [f for f in todo if self._synced_at.get(f) != step]
        for f in todo:
            self._sync_fragment(f)
            self._synced_at[f] = step
        return len(todo)

    def sync_all(self, step: int) -> int:
        return self.sync(step, list(range(len(self.fragments))))

    @torch.no_grad()
    def _sync_fragment(self, f: int) -> None:
        idx = list(self.fragments[f])
        local = [local_tensor(self.params[i]) for i in idx]
        delta = torch.cat([(self.anchor[i] - t).reshape(-1).float() for i, t in zip(idx, local)])
        self.reducer.mean_(delta, ("outer", f))
        offset = 0
        for i, t in zip(idx, local):
            d = delta[offset:offset + t.numel()].view_as(t).to(t.dtype)
            offset += t.numel()
            m = local_tensor(self.momentum[i])
            m.mul_(self.mu).add_(d)
            update = d.add(m, alpha=self.mu) if self.mu else d  # Nesterov
            self.anchor[i].sub_(update, alpha=self.lr)
            t.copy_(self.anchor[i])

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The outer state for a checkpoint, by section: momentum and anchor, keyed by parameter."""
        return {MOMENTUM: dict(zip(self.names, self.momentum)), ANCHOR: dict(zip(self.names, self.anchor_tensors))}
