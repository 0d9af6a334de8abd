"""Collective faults a rank commits on purpose (tests, chaos runs): the deadlocks that the
hang diagnosis (``faults/diagnosis``) must name.

``RAYFLEX_COLLECTIVE_FAULT="RANK:STEP:ACTION:OP[:GROUP[:NTH]]"``: in every attempt that
reaches step STEP, rank RANK's NTH call (default 1) of ``torch.distributed.OP`` during that
step, on the process group whose role is GROUP ("dp", "world", "pp", ...; any group when
omitted), is replaced by ACTION:

* ``skip``: the call is not made (it returns as if done: the rank goes on);
* ``broadcast``: a broadcast of the same tensor from the group's first rank instead;
* ``grow``: the same op on a tensor one element longer;
* ``hold``: the call is made, then the rank stays inside it (as one frozen after its share
  went out) until its attempt is stopped, and the call raises: its peers finish the
  collective, it does not;
* ``drop_send`` (OP ``p2p``: the pipeline schedule's point-to-point call,
  ``schedules._batch_p2p``): the call's sends are not posted, its receives are (one
  microbatch too few sent).

The functions are patched in this process for the duration of that step only (the same
way ``CollectiveAudit`` patches them), so no other step, rank or run pays for it.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

ENV = "RAYFLEX_COLLECTIVE_FAULT"
ACTIONS = ("skip", "broadcast", "grow", "hold", "drop_send")


@dataclass(frozen=True)
class CollectiveFault:
    rank: int
    step: int
    action: str
    op: str
    group: Optional[str] = None
    nth: int = 1

    @classmethod
    def parse(cls, raw: str) -> "CollectiveFault":
        parts = raw.split(":")
        if len(parts) < 4 or parts[2] not in ACTIONS:
            raise ValueError(f"{ENV}={raw!r}: expected RANK:STEP:ACTION:OP[:GROUP[:NTH]] with ACTION one of "
                             f"{', '.join(ACTIONS)}")
        group = parts[4] or None if len(parts) > 4 else None
        return cls(rank=int(parts[0]), step=int(parts[1]), action=parts[2], op=parts[3], group=group,
                   nth=int(parts[5]) if len(parts) > 5 else 1)


def collective_fault_for(rank: int) -> Optional[CollectiveFault]:
    raw = os.environ.get(ENV)
    if not raw:
        return None
    fault = CollectiveFault.parse(raw)
    return fault if fault.rank == rank else None


class _DoneWork:
    """What an async collective returns when the fault made no call: already complete."""

    def wait(self, timeout: Any = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True


@contextmanager
def committed(fault: Optional[CollectiveFault], step: int, role_of: Callable[[Any], str],
              on_fire: Callable[[str], None] = lambda message: None,
              stopped: Callable[[], bool] = lambda: True) -> Iterator[None]:
    """While the body runs (one training step), commit ``fault`` if it is due at ``step``.
    ``role_of(group)``: the role of a process group (None: the world group).
    ``on_fire``: told when the fault is committed (the harness's ground truth); a ``hold``
    also once its call returned.
    ``stopped``: whether the rank's attempt was asked to stop (ends a ``hold``)."""
    if fault is None or fault.step != step:
        yield
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    calls = {"n": 0}
    saved = []

    def matches(group) -> bool:
        if fault.group is not None and role_of(group) != fault.group:
            return False
        calls["n"] += 1
        if calls["n"] != fault.nth:
            return False
        on_fire(f"injected collective fault: rank {fault.rank} step {step}: {fault.action} {fault.op}"
                f"{' on ' + fault.group if fault.group else ''} (call {fault.nth})")
        return True

    def wrap(original):
        if fault.op == "p2p":
            def faulty(p2p_ops, *args, **kwargs):
                if fault.action == "drop_send" and any("send" in getattr(p.op, "__name__", "") for p in p2p_ops) \
                        and matches(p2p_ops[0].group):
                    kept = [p for p in p2p_ops if "send" not in getattr(p.op, "__name__", "")]
                    return original(kept, *args, **kwargs) if kept else []
                return original(p2p_ops, *args, **kwargs)
            return faulty

        def faulty(*args, **kwargs):
            group = kwargs.get("group", args[_group_index(original)] if len(args) > _group_index(original) else None)
            if not matches(group):
                return original(*args, **kwargs)
            async_op = bool(kwargs.get("async_op", False))
            if fault.action == "skip":
                return _DoneWork() if async_op else None
            tensor = kwargs.get("tensor", args[0] if args else None)
            if fault.action == "broadcast":
                src = dist.get_process_group_ranks(group)[0] if group is not None else 0
                return dist.broadcast(tensor, src=src, group=group, async_op=async_op)
            if fault.action == "hold":
                work = original(*args, **kwargs)
                if async_op:
                    work.wait()
                on_fire(f"injected collective fault: rank {fault.rank} step {step}: its {fault.op} returned; "
                        "holding inside it")
                while not stopped():
                    time.sleep(0.05)
                raise RuntimeError(f"injected collective fault: rank {fault.rank} held inside its {fault.op} "
                                   "until its attempt stopped")
            if fault.action == "grow":
                import torch

                longer = torch.cat([tensor.reshape(-1), tensor.new_zeros(1)])
                rest = {k: v for k, v in kwargs.items() if k != "tensor"}
                work = original(longer, *args[1:], **rest)
                tensor.copy_(longer[:-1].reshape(tensor.shape))
                return work
            return original(*args, **kwargs)
        return faulty

    if fault.op == "p2p":
        from torch.distributed.pipelining import schedules

        targets = [(schedules, "_batch_p2p")]
    else:
        targets = [(module, fault.op) for module in (dist, distributed_c10d)]
    for module, name in targets:
        original = getattr(module, name, None)
        if original is not None:
            saved.append((module, name, original))
            setattr(module, name, wrap(original))
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


def _group_index(fn) -> int:
    import inspect

    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return 10**6
    return names.index("group") if "group" in names else 10**6
