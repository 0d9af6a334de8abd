"""Where a restart takes its state from: the survivors' live state, or a checkpoint.

A mesh that replicates its shards (HSDP: ``dp_replicate >= 2``) holds every shard of the
model and optimizer on several ranks. When a failure leaves at least one rank holding each
shard, the state of the last finished step still exists in live memory: the restart
resumes from it (``LiveRecovery``) and loses no step, instead of rolling back to the last
commit. Survivors a step apart — some finished step s's closing agreement, the rest were
left inside it — first bring the rest to step s (``RollForward``: they hold its gradients).
When a shard lost every copy (both replicas of it gone), or the survivors still stopped
at different steps, or a snapshot failed, the restart loads a checkpoint as before
(``FromCheckpoint``: memory replicas, then storage), and the reason says which shard or
rank stood in the way.

Pure functions of the mesh and what the survivors reported: the controller acts on the
frozen decision (``control.restarting``) and records it as a ``recovery_chosen`` event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Union

from rayflex.mesh.plan import MeshPlan

LIVE_PEERS, CHECKPOINT = "live_peers", "checkpoint"


@dataclass(frozen=True)
class LiveRecovery:
    """Resume from ``step`` in the survivors' memory, reading each shard from ``holders``."""

    step: int
    holders: tuple[int, ...]  # old ranks whose snapshots hold every shard once
    reason: str
    source: str = LIVE_PEERS


@dataclass(frozen=True)
class FromCheckpoint:
    reason: str
    source: str = CHECKPOINT


RecoveryChoice = Union[LiveRecovery, FromCheckpoint]


def shard_of(plan: MeshPlan, rank: int) -> tuple[int, int, int]:
    """The part of the state ``rank`` holds: (pipeline stage, FSDP shard, tp rank); the
    ranks of one shard differ only in their replica."""
    c = plan.mesh_coords(rank)
    return c.pp, c.dp_shard, c.tp


def _describe(plan: MeshPlan, shard: tuple[int, int, int]) -> str:
    pp, s, tp = shard
    parts = ([f"stage {pp}"] if plan.pp > 1 else []) + [f"FSDP shard {s}"] + ([f"tp rank {tp}"] if plan.tp > 1 else [])
    return ", ".join(parts)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]} was" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))} were"


def lost_shard(plan: MeshPlan, alive: set[int]) -> Optional[str]:
    """Why the ranks ``alive`` cannot hold the whole state (a shard none of them holds,
    naming its lost ranks), or None when they can."""
    holders: dict[tuple, list[int]] = {}
    for r in range(plan.world_size):
        holders.setdefault(shard_of(plan, r), []).append(r)
    for shard, ranks in sorted(holders.items()):
        if not set(ranks) & alive:
            if len(ranks) == 1:
                return (f"rank {ranks[0]} held the only copy of its shard ({_describe(plan, shard)}): the mesh "
                        "does not replicate it (dp_replicate=1)")
            return (f"every copy of {_describe(plan, shard)} was lost with ranks "
                    f"{', '.join(map(str, ranks))}")
    return None


@dataclass(frozen=True)
class RollForward:
    """Ranks left inside step ``step``'s closing agreement, which another survivor finished,
    apply that step's update before their snapshots, with ``agreed`` (its record, from that
    survivor): the survivors then all hold step ``step``."""

    step: int
    ranks: tuple[int, ...]
    agreed: Mapping


def roll_forward(held: Mapping[int, Mapping]) -> Optional[RollForward]:
    """``held``: old rank -> its last finished ``step``, the step it was left inside the
    closing agreement of (``pending``), and its last finished step's agreed record
    (``recent``). The agreement is one all-reduce over every rank: a survivor that finished
    step s's proves that every rank entered it, its gradient collectives done, so a survivor
    still inside it holds step s's gradients and can apply them. Without that, survivors a
    step apart hold no common step (a ring all-reduce completes on some ranks before others)."""
    if not held:
        return None
    newest = max(int(h["step"]) for h in held.values())
    finished = [r for r in sorted(held) if int(held[r]["step"]) == newest
                and (held[r].get("recent") or {}).get("step") == newest]
    behind = tuple(r for r in sorted(held) if int(held[r]["step"]) == newest - 1 and held[r].get("pending") == newest)
    if not finished or not behind:
        return None
    return RollForward(step=newest, ranks=behind, agreed=dict(held[finished[0]]["recent"]))


def _cover(plan: MeshPlan, steps: Mapping[int, int]) -> Optional[tuple[int, tuple[int, ...]]]:
    """(step, holders): the newest step whose ranks (old rank -> the step it holds) hold
    every shard, and one rank per shard of it (the lowest); None when no step does."""
    for step in sorted(set(steps.values()), reverse=True):
        at_step = {r for r, s in steps.items() if s == step}
        if lost_shard(plan, at_step) is None:
            chosen: dict[tuple, int] = {}
            for r in sorted(at_step):
                chosen.setdefault(shard_of(plan, r), r)
            return step, tuple(sorted(chosen.values()))
    return None


def holders_to_ask(plan: MeshPlan, held: Mapping[int, Mapping],
                   forward: Optional[RollForward]) -> Optional[tuple[int, ...]]:
    """The survivors whose snapshots a live recovery reads (``held``: old rank -> its
    ``held_step``; ``forward``: the ranks that first apply a step): one per shard, at the
    newest step that has them all. Only they take one — the others' are the same bytes
    again. None when no step has every shard: every survivor is then asked, and ``decide``
    says why."""
    steps = {r: (forward.step if forward is not None and r in forward.ranks else int(h["step"]))
             for r, h in held.items()}
    cover = _cover(plan, steps)
    return None if cover is None else cover[1]


def decide(plan: MeshPlan, snapshots: Mapping[int, Mapping]) -> RecoveryChoice:
    """``snapshots``: old rank -> what its snapshot said (``step``, or ``error``) for every
    survivor asked (``holders_to_ask``'s, or all). The newest step whose snapshots hold
    every shard wins; the holders are one rank per shard (the lowest)."""
    usable = {r: int(s["step"]) for r, s in snapshots.items() if not s.get("error")}
    failed = {r: s["error"] for r, s in snapshots.items() if s.get("error")}
    cover = _cover(plan, usable)
    if cover is not None:
        step, holders = cover
        rolled = sorted(r for r in holders if snapshots[r].get("rolled_forward") == step)
        return LiveRecovery(step=step, holders=holders, reason=(
            f"every shard of step {step} is held by a survivor: reading ranks "
            f"{', '.join(map(str, holders))} of the failed attempt ({plan.describe()})"
            + (f"; {_ranks(rolled)} left inside step {step}'s closing agreement, which a peer finished, "
               "and applied its update" if rolled else "")))
    why = lost_shard(plan, set(usable))
    if why is None and usable:
        steps = sorted(set(usable.values()))
        why = f"the survivors stopped at different steps ({', '.join(map(str, steps))}): no step has every shard"
    if failed:
        why = (f"{why}; " if why else "") + "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
    return FromCheckpoint(reason=why or "no survivor took a snapshot")
