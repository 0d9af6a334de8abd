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


# Kinds a run injects only when asked (ChaosConfig.slow_node): a slow machine needs >= 3
# ranks to be told from the others, and leaves every other kind's seeds as they were.
SLOW_NODE = "slow_node"  # a machine held to a tenth of a core for a while: a straggler


def plan_faults(seed: int, count: int, extra: tuple = ()) -> list[str]:
    """``count`` fault kinds (>= one of each, ``extra`` kinds too) in a seeded random order."""
    kinds_all = KINDS + tuple(extra)
    if count < len(kinds_all):
        raise ValueError(f"a chaos run needs at least {len(kinds_all)} faults to inject every kind once "
                         f"({', '.join(kinds_all)}); got {count}")
    rng = random.Random(seed)
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(count - len(kinds_all))]
    rng.shuffle(kinds)
    for kind in extra:  # placed after the core kinds' order is drawn: the same for the same seed
        kinds.insert(rng.randrange(1, len(kinds) + 1), kind)
    return kinds
