"""Which faults a chaos run injects, in which order: a pure function of the seed."""

from __future__ import annotations

import random

# Every kind the platform claims to survive. A run injects each at least once.
KINDS = (
    "kill_actor",        # SIGKILL a worker process
    "remove_node",       # a node vanishes (no notice)
    "sigstop",           # a worker freezes: its peers hang in a collective
    "preempt_long",      # spot notice with time for an emergency checkpoint
    "preempt_short",     # spot notice too short for one: fall back to the last commit
    "s3_down",           # the object store refuses connections for a while
    "raise_once",        # a worker's step raises once
    "corrupt_checkpoint",  # a byte flips in the newest committed checkpoint
)


def plan_faults(seed: int, count: int) -> list[str]:
    """``count`` fault kinds (>= one of each) in a seeded random order."""
    if count < len(KINDS):
        raise ValueError(f"a chaos run needs at least {len(KINDS)} faults to inject every kind once "
                         f"({', '.join(KINDS)}); got {count}")
    rng = random.Random(seed)
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(count - len(KINDS))]
    rng.shuffle(kinds)
    return kinds
