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
                 inner_steps: int, lr: float, momentum: float, fragments: int = 1, overlap_steps: int = 0) -> None:
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
        # Overlap: a fragment's pseudo-gradient leaves ``overlap_steps`` steps before its outer
        # step. At most one is in flight (overlap_steps < the steps between two fragments'
        # syncs), so one buffer holds it (what this rank sent), and which fragment it is; both
        # exist from the start, so a checkpoint's staged copy keeps pointing at them.
        self.overlap_steps = overlap_steps
        self.in_flight = torch.full((1,), -1, dtype=torch.int64)  # the fragment sent, -1: none
        self._sent: Optional[torch.Tensor] = None
        self._wait = None  # waits for the in-flight mean and returns it
        self._mean: Optional[torch.Tensor] = None  # the mean, once waited for before its outer step
        if overlap_steps:
            longest = max(sum(local_tensor(self.params[i]).numel() for i in r) for r in self.fragments)
            self._sent = torch.zeros(longest, dtype=torch.float32, device=self.anchor[0].device)

    @torch.no_grad()
    def reset_anchor(self) -> None:
        """The parameters as they are become the replicas' common point, with no momentum yet
        (a restore from a checkpoint saved without DiLoCo)."""
        for a, p, m in zip(self.anchor, self.params, self.momentum):
            a.copy_(local_tensor(p))
            local_tensor(m).zero_()

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
        step); returns how many were synchronised. With ``overlap_steps``, also send the
        fragment due that many steps later. Collective over the replicate group: every rank
        calls it at the same step with the same fragments."""
        todo = self.due(step) if fragments is None else fragments
        todo = [f for f in todo if self._synced_at.get(f) != step]
        for f in todo:
            if int(self.in_flight) == f:
                self._apply_sent(f)
            else:  # sent in no earlier step (the run's first round, or another mesh resumed)
                self._sync_fragment(f)
            self._synced_at[f] = step
        if fragments is None and self.overlap_steps:
            for f in self.due(step + self.overlap_steps):
                self._send(f)
        return len(todo)

    def sync_all(self, step: int) -> int:
        return self.sync(step, list(range(len(self.fragments))))

    @torch.no_grad()
    def _sync_fragment(self, f: int) -> None:
        idx = list(self.fragments[f])
        local = [local_tensor(self.params[i]) for i in idx]
        delta = torch.cat([(self.anchor[i] - t).reshape(-1).float() for i, t in zip(idx, local)])
        self.reducer.mean_(delta, f"outer.{f}")
        offset = 0
        for i, t in zip(idx, local):
            d = delta[offset:offset + t.numel()].view_as(t).to(t.dtype)
            offset += t.numel()
            m = local_tensor(self.momentum[i])
            m.mul_(self.mu).add_(d)
            update = d.add(m, alpha=self.mu) if self.mu else d  # Nesterov
            self.anchor[i].sub_(update, alpha=self.lr)
            t.copy_(self.anchor[i])

    def _local_delta(self, f: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """How far this rank's shard of fragment ``f`` moved since its last sync (fp32, flat)."""
        parts = [(self.anchor[i] - local_tensor(self.params[i])).reshape(-1).float() for i in self.fragments[f]]
        if out is None:
            return torch.cat(parts)
        n = sum(p.numel() for p in parts)
        torch.cat(parts, out=out[:n])
        return out[:n]

    @torch.no_grad()
    def _send(self, f: int) -> None:
        """Start averaging fragment ``f``'s pseudo-gradient over the replicas, in the
        background; its outer step waits for it (``_apply_sent``)."""
        sent = self._local_delta(f, out=self._sent)
        self.in_flight.fill_(f)
        self._mean = None
        self._wait = self.reducer.start_mean_(sent.clone(), f"outer.{f}")

    def resend(self) -> None:
        """After a restore on the same mesh from a checkpoint saved with a fragment in flight
        (:meth:`own_state`): send what it had sent again (collective, at setup)."""
        f = int(self.in_flight)
        if f >= 0:
            n = sum(local_tensor(self.params[i]).numel() for i in self.fragments[f])
            self._wait = self.reducer.start_mean_(self._sent[:n].clone(), f"outer.{f}")

    def settle(self) -> None:
        """Wait for a reduction still in flight (a loop that ends mid-overlap) and keep its
        mean for the outer step; what was sent stays, so a save now still holds it and a
        resumed run sends it again."""
        if self._wait is not None:
            self._mean, self._wait = self._wait(), None

    @torch.no_grad()
    def _apply_sent(self, f: int) -> None:
        """Fragment ``f``'s outer step on the mean sent ``overlap_steps`` steps ago; the
        progress each replica made since it sent is kept on top of the new anchor."""
        mean = self._wait() if self._wait is not None else self._mean
        self._wait = self._mean = None
        if mean is None:  # sent by an attempt that ended: the bytes it sent, averaged again
            self.resend()
            mean, self._wait = self._wait(), None
        idx = list(self.fragments[f])
        offset = 0
        for i in idx:
            t = local_tensor(self.params[i])
            n = t.numel()
            d = mean[offset:offset + n].view_as(t).to(t.dtype)
            progress = t - (self.anchor[i] - self._sent[offset:offset + n].view_as(t).to(t.dtype))
            offset += n
            m = local_tensor(self.momentum[i])
            m.mul_(self.mu).add_(d)
            update = d.add(m, alpha=self.mu) if self.mu else d  # Nesterov
            self.anchor[i].sub_(update, alpha=self.lr)
            t.copy_(self.anchor[i] + progress)
        self.in_flight.fill_(-1)

    def _cut(self) -> str:
        """How the fragments are cut and when they sync: what an index in flight refers to."""
        return f"h{self.inner_steps}_f{len(self.fragments)}_o{self.overlap_steps}"

    def own_state(self) -> dict[str, torch.Tensor]:
        """What only this rank holds and a resume on the same mesh needs: the fragment in
        flight, and what this rank sent for it (none without overlap); keyed by the cut, so
        a run that syncs its fragments otherwise reads none of it."""
        if self._sent is None:
            return {}
        return {f"{self._cut()}.in_flight": self.in_flight, f"{self._cut()}.sent": self._sent}

    def load_own_state(self, own: dict[str, torch.Tensor]) -> None:
        """Carry on with what ``own`` (:meth:`own_state` of a checkpoint) had in flight; none:
        nothing is."""
        self.forget_in_flight()
        sent, in_flight = own.get(f"{self._cut()}.sent"), own.get(f"{self._cut()}.in_flight")
        if self._sent is not None and sent is not None and in_flight is not None and sent.shape == self._sent.shape:
            self._sent.copy_(sent.to(self._sent.device))
            self.in_flight.copy_(in_flight)

    def forget_in_flight(self) -> None:
        """A restore at another number of replicas: nothing sent before applies."""
        self.in_flight.fill_(-1)
        self._wait = self._mean = None

    def state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The outer state for a checkpoint, by section: momentum and anchor, keyed by parameter."""
        return {MOMENTUM: dict(zip(self.names, self.momentum)), ANCHOR: dict(zip(self.names, self.anchor_tensors))}
