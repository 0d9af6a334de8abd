"""An emergency save handed to memory replicas, committed once its keepers uploaded it.

With memory replicas, an emergency save's ranks hand each shard file's upload to a keeper
on a node that stays, and stop (``replicas.dcp_io.ReplicatingWriter``): the leaving node
needs the notice only to replicate. Nobody in the old attempt can commit the step then —
rank 0 may have been on the node that went — so the controller does, before the restart
picks the step to resume from (``control/handoff.py``): this waits for the keepers' uploads,
checks that every shard file DCP's ``.metadata`` names is in storage, whole, and commits.
An upload that failed, or a keeper that went with files still pending, leaves the step
uncommitted, and the restart resumes from the last committed one.
"""

from __future__ import annotations

import time
from typing import Any, Optional


def commit_handed_off(keepers: Optional[Any], checkpoint_uri: str, step: int, info: dict, timeout_s: float) -> float:
    """Wait up to ``timeout_s`` for ``keepers``' uploads of ``step`` and commit it (``info``:
    what rank 0 reported handing off: world size, mesh, keep); the seconds it waited. The
    keepers are not told (``keepers.committed``): the caller does, once it recorded the commit.
    Raises, naming the files or the check that failed, when the step cannot be committed."""
    # Loaded here: they load torch and numpy, and the controller (torch-free) imports this module.
    from rayflex.checkpoint.checkpointer import commit_if_whole
    from rayflex.checkpoint.replicas.keeper import UPLOADED

    t0 = time.monotonic()
    states = keepers.wait_uploads(step, timeout_s) if keepers else {}
    failed = {name: state for name, state in sorted(states.items()) if state != UPLOADED}
    if failed:
        raise RuntimeError("uploads by the memory replicas' keepers did not finish: "
                           + "; ".join(f"{name}: {state}" for name, state in failed.items()))
    commit_if_whole(checkpoint_uri, step, world_size=info["world_size"], mesh=info["mesh"], keep=info["keep"])
    return time.monotonic() - t0
