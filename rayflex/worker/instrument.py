"""Per-step instrumentation of a rank: live activation bytes, pipeline and collective waits.

* Activations: a ``saved_tensors_hooks`` pair counts the bytes autograd keeps for backward
  (what a pipeline schedule's memory profile is about), deduplicated by storage, with the
  peak per step. A tensor's bytes are released when autograd drops it after backward.
* Pipeline waits: every blocking wait of torch's pipeline schedules goes through
  ``schedules._wait_batch_p2p``; wrapping it once per process gives the seconds a rank
  spent waiting for its neighbours (the bubble, measured) next to its compute time.
* Collective waits: every ``Work.wait`` (FSDP's all-gathers and reduce-scatters), timed the
  same way: how long a rank waited for its peers in a step.
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import contextmanager
from typing import Optional

import torch

_tls = threading.local()
_patch_lock = threading.Lock()


class ActivationCounter:
    """Live and peak bytes of tensors saved for backward (this thread)."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self._refs: dict[tuple, int] = {}

    def _release(self, key: tuple, nbytes: int) -> None:
        n = self._refs.get(key, 0) - 1
        if n <= 0:
            self._refs.pop(key, None)
            self.live -= nbytes
        else:
            self._refs[key] = n

    def pack(self, t: torch.Tensor):
        if t.device.type == "meta" or not hasattr(t, "untyped_storage"):
            return t
        try:
            storage = t.untyped_storage()
            key = (storage.data_ptr(), t.device.type)
            nbytes = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (e.g. DTensor)
            return t
        if key not in self._refs:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        self._refs[key] = self._refs.get(key, 0) + 1
        # Hold a detached alias: a saved *output* still carrying its grad_fn would make a
        # cycle (output -> grad_fn -> saved holder -> output) that outlives the step when no
        # backward runs (the pipeline's shape-inference forward), leaking its activations.
        holder = _Saved(t.detach())
        weakref.finalize(holder, self._release, key, nbytes)
        return holder

    @staticmethod
    def unpack(obj):
        return obj.tensor if isinstance(obj, _Saved) else obj

    def reset_peak(self) -> None:
        self.peak = self.live

    @contextmanager
    def track(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _timing(original, attr: str):
    """``original`` wrapped to add the seconds each call blocks to this thread's ``attr``."""
    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            setattr(_tls, attr, getattr(_tls, attr, 0.0) + time.perf_counter() - t0)
    return timed


@contextmanager
def _accumulated(attr: str):
    """Yields a dict whose ``wait_s`` is what this thread added to ``attr`` inside the block."""
    setattr(_tls, attr, 0.0)
    out = {"wait_s": 0.0}
    try:
        yield out
    finally:
        out["wait_s"] = getattr(_tls, attr)


_patched: set = set()  # what _patch_once has wrapped in this process


def _patch_once(owner, attr: str, counter: str) -> None:
    """Wrap ``owner.attr`` (once per process) to add the seconds each call blocks to this
    thread's ``counter``."""
    with _patch_lock:
        if (owner, attr) not in _patched:
            setattr(owner, attr, _timing(getattr(owner, attr), counter))
            _patched.add((owner, attr))


def collective_wait_timer():
    """A context yielding a dict whose ``wait_s`` is the time this thread blocked waiting on
    collectives (``Work.wait``). A rank the others wait for arrives last at each collective
    and waits least: the straggler signal (faults.detector). On a GPU, a wait returns once
    the stream waits, so this measures the host's side only."""
    from torch._C._distributed_c10d import Work  # every wait on a collective (FSDP2, pipeline p2p)

    _patch_once(Work, "wait", "collective_s")
    return _accumulated("collective_s")


def pipeline_wait_timer(pipelined: bool = True):
    """A context yielding a dict whose ``wait_s`` is the time this thread blocked on
    pipeline p2p (0 without a pipeline: torch's pipelining package, ~1 s of CPU to import,
    is then never loaded)."""
    if pipelined:
        from torch.distributed.pipelining import schedules

        _patch_once(schedules, "_wait_batch_p2p", "wait_s")
    return _accumulated("wait_s")


# Of the collectives a step issues through ``torch.distributed``: the bytes a rank sends in
# each, as a ring (or a pairwise exchange) sends them — all of it for a point-to-point send.
# ``payload``: the argument whose size they follow; ``share(S)``: the fraction of it sent.
_SENT_BY = {
    "all_reduce": ("tensor", lambda s: 2 * (s - 1) / s),
    "all_gather_single": ("output_tensor", lambda s: (s - 1) / s),
    "all_gather_into_tensor": ("output_tensor", lambda s: (s - 1) / s),
    "reduce_scatter_single": ("input", lambda s: (s - 1) / s),
    "reduce_scatter_tensor": ("input", lambda s: (s - 1) / s),
    "all_to_all_single": ("input", lambda s: (s - 1) / s),
    "send": ("tensor", lambda s: 1.0),
}


# The step's count: one training loop per process, and on GPUs autograd runs backward (and
# FSDP2's reduce-scatters, HSDP's and the slow tier's reductions in its hooks) on threads of
# its own, so the count is the process's, not a thread's. None: not counting.
_sent_lock = threading.Lock()
_sent_by_group: Optional[dict] = None


def _add_sent(dist, group, tensor, share) -> None:
    if _sent_by_group is None or not isinstance(tensor, torch.Tensor):
        return
    group = group if group is not None else dist.group.WORLD
    size = dist.get_world_size(group)
    if size > 1:
        name = str(group.group_name)
        n = int(round(share(size) * tensor.numel() * tensor.element_size()))
        with _sent_lock:
            if _sent_by_group is not None:
                _sent_by_group[name] = _sent_by_group.get(name, 0) + n


def _counting(dist, name: str, original):
    import functools
    import inspect

    payload, share = _SENT_BY[name]
    signature = inspect.signature(original)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        if _sent_by_group is not None:
            bound = signature.bind_partial(*args, **kwargs).arguments
            _add_sent(dist, bound.get("group"), bound.get(payload), share)
        return original(*args, **kwargs)
    return counted


def _counting_batch(dist, original):
    import functools

    # ``dist.isend`` itself is left as it is: a P2POp accepts only torch's own function.
    @functools.wraps(original)
    def counted(p2p_op_list):
        if _sent_by_group is not None:
            for op in p2p_op_list:
                if op.op is dist.isend:
                    _add_sent(dist, op.group, op.tensor, lambda s: 1.0)
        return original(p2p_op_list)
    return counted


def count_sends() -> None:
    """Wrap ``torch.distributed``'s collectives to count what they send (once per process;
    call it at setup, before anything else wraps them for a while and puts its own back)."""
    import torch.distributed as dist

    with _patch_lock:
        if (dist, "sent_bytes") in _patched:
            return
        for name in _SENT_BY:
            if hasattr(dist, name):
                setattr(dist, name, _counting(dist, name, getattr(dist, name)))
        dist.batch_isend_irecv = _counting_batch(dist, dist.batch_isend_irecv)
        _patched.add((dist, "sent_bytes"))


@contextmanager
def sent_bytes_counter():
    """A context yielding a dict, process-group name -> the bytes this process sent in the
    collectives issued through ``torch.distributed`` inside the block, from any thread
    (FSDP2's all-gathers and reduce-scatters, HSDP's and the slow tier's reductions, pipeline
    sends; a checkpoint upload's, under its own group). Tensor parallelism's functional
    collectives (DTensor) do not pass there and are not counted."""
    global _sent_by_group
    count_sends()
    out: dict[str, int] = {}
    with _sent_lock:
        _sent_by_group = out
    try:
        yield out
    finally:
        with _sent_lock:
            _sent_by_group = None
