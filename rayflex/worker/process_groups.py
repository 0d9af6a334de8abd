"""The process groups of one attempt, and which of them a tensor may go to.

A collective's backend serves only some device types: NCCL serves CUDA tensors and
nothing else, so a host tensor handed to an NCCL group fails at once ("No backend type
associated with device type cpu"). The per-step control all-reduce (loss, stop and
checkpoint flags) and the global grad norm are host scalars, so on GPU they need a group
with a host backend. The layout, decided in one place (:func:`process_group_layout`):

* ``default`` (the world group): the training device's backend, NCCL on CUDA. The device
  mesh's dp/pp groups inherit it (FSDP2 all-gather/reduce-scatter, pipeline p2p: device
  tensors only).
* ``control``: on a device whose backend cannot take host tensors, a world gloo group for
  the host scalars each step reduces. On CPU the default group is gloo already and serves
  as the control group (None here), so the CPU path is what it always was.
* ``checkpoint``: a world gloo group of its own on every device; DCP plans and gathers
  there from a background thread, which must never interleave with the training thread's
  collectives.

Why a dedicated control group rather than ``init_process_group("cpu:gloo,cuda:nccl")``:
with a device-qualified default every mesh subgroup inherits a gloo backend too (one more
full mesh of TCP connections per dp and pp group, all of which the gloo abort would have
to cover), and nothing on CPU could tell a host tensor sent to a device group from a
correct one. A device-only default group refuses host tensors exactly as NCCL does, so a
test can build the GPU layout on CPU with gloo standing in for NCCL (``cuda:gloo``: gloo
registered for CUDA only) and the stand-in fails wherever NCCL would.

:class:`CollectiveAudit` checks the same rule with a clear message for every call of the
``torch.distributed`` collectives while it is active (tests; a debugging aid on GPU).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterator, Optional

import torch

from rayflex.worker.gloo_abort import GlooSockets

HOST_BACKEND = "gloo"
# The backend torch uses for a device type's tensors when rayflex trains on it.
DEVICE_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


@dataclass(frozen=True)
class ProcessGroupLayout:
    """The backends of one attempt's world groups (see the module docstring).

    ``default_backend``: the string given to ``init_process_group``. ``control_backend``:
    the backend of a separate world group for host scalars, or None when the default
    group serves host tensors itself.
    """

    device_type: str
    default_backend: str
    control_backend: Optional[str]
    checkpoint_backend: str = HOST_BACKEND

    @property
    def default_serves_host(self) -> bool:
        return self.control_backend is None

    @property
    def default_is_gloo(self) -> bool:
        """The default group owns gloo connections (the socket abort must cover them)."""
        return HOST_BACKEND in self.default_backend


def process_group_layout(device_type: str, *, device_backend: Optional[str] = None) -> ProcessGroupLayout:
    """The layout training on ``device_type`` uses.

    ``device_backend`` replaces the device's own backend (tests: ``"gloo"`` stands in for
    NCCL on a machine without GPUs). It is registered for ``device_type`` only
    (``"cuda:gloo"``), so the default group refuses host tensors as NCCL would, and the
    groups are the ones the real layout has.
    """
    if device_type == "cpu":
        if device_backend not in (None, HOST_BACKEND):
            raise ValueError(f"training on cpu uses the {HOST_BACKEND} backend, not {device_backend!r}")
        return ProcessGroupLayout(device_type="cpu", default_backend=HOST_BACKEND, control_backend=None)
    if device_backend is None:
        if device_type not in DEVICE_BACKENDS:
            raise ValueError(f"no collective backend known for device type {device_type!r}; "
                             f"rayflex trains on {', '.join(DEVICE_BACKENDS)}")
        # Plain "nccl": torch compares get_backend() with "nccl" in places, and NCCL
        # serves CUDA only either way.
        default = DEVICE_BACKENDS[device_type]
    else:
        default = f"{device_type}:{device_backend}"
    return ProcessGroupLayout(device_type=device_type, default_backend=default, control_backend=HOST_BACKEND)


@dataclass
class ProcessGroups:
    """One attempt's world groups and the sockets of its gloo ones (for the abort)."""

    layout: ProcessGroupLayout
    control: Any  # ProcessGroup, or None: the default group
    checkpoint: Any
    sockets: GlooSockets

    @property
    def host(self) -> Any:
        """The group for host (CPU) tensors reduced over the world: the control group, or
        None (the default group) where that serves host tensors."""
        return self.control

    def register_sockets(self, rank: int, world_size: int) -> None:
        """Publish this rank's gloo listeners (a barrier over the store). Call it after
        every gloo group of the attempt exists: on CPU the device mesh's subgroups too."""
        import torch.distributed as dist

        self.sockets.register(dist.distributed_c10d._get_default_store(), rank, world_size)


def open_process_groups(layout: ProcessGroupLayout, *, rank: int, world_size: int, timeout: timedelta,
                        init_method: Optional[str] = None, store: Optional[Callable[[], Any]] = None,
                        device: Optional[torch.device] = None) -> ProcessGroups:
    """Join the default group (through ``store()``, a rendezvous store factory, or
    ``init_method``), then create the control (if the layout has one) and checkpoint
    groups, in that order on every rank.

    ``device``: the CUDA device this rank trains on is made current first, so NCCL and
    the device mesh use it (the mesh would otherwise guess ``rank % device_count``, or
    take ``LOCAL_RANK`` from the environment). The gloo sockets are snapshotted just
    before the first gloo group: the rendezvous store's connections of an NCCL default
    group are not gloo's.
    """
    import torch.distributed as dist

    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)
    sockets = GlooSockets() if layout.default_is_gloo else None
    # ``store`` (rendezvous.rendezvous_store): made here, after the snapshot, so its
    # connections count as the default group's, as init_method's would.
    dist.init_process_group(layout.default_backend, init_method=init_method, store=store() if store else None,
                            rank=rank, world_size=world_size, timeout=timeout)
    if sockets is None:
        sockets = GlooSockets()
    control = dist.new_group(backend=layout.control_backend) if layout.control_backend else None
    checkpoint = dist.new_group(backend=layout.checkpoint_backend)
    return ProcessGroups(layout=layout, control=control, checkpoint=checkpoint, sockets=sockets)


# ----------------------------------------------------------------- the audit
class CollectiveDeviceError(RuntimeError):
    """A collective was handed a tensor on a device its group's backend does not serve."""


def served_device_types(group: Any = None) -> frozenset[str]:
    """The device types ``group`` (None: the default group) has a backend for."""
    import torch.distributed as dist

    config = dist.get_backend_config(group)  # "cpu:gloo,cuda:gloo", "cuda:nccl", "gloo"
    types = set()
    for part in config.split(","):
        device, sep, backend = part.partition(":")
        if sep:
            types.add(device.strip())
        else:  # a bare backend name: every device type it supports
            types.update(dist.Backend.backend_capability.get(device.strip(), []))
    return frozenset(types)


@dataclass(frozen=True)
class CollectiveCall:
    """One audited collective: its name, the group's backend config and tensor devices."""

    op: str
    backend: str
    devices: tuple[str, ...]
    group: Any = field(default=None, compare=False, repr=False)


# The torch.distributed collectives that take tensors (those a torch version lacks are
# skipped); each one's ``group`` argument is found by name in its signature.
_AUDITED = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_coalesced", "all_gather_into_tensor",
    "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "broadcast",
    "reduce", "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "gather", "scatter",
)


def _group_position(fn) -> Optional[int]:
    import inspect

    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("group") if "group" in names else None


def _tensors_in(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors_in(item)


class CollectiveAudit:
    """While active (``with CollectiveAudit() as audit:``), every ``torch.distributed``
    collective listed in ``_AUDITED`` (and ``batch_isend_irecv``, the pipeline's p2p)
    checks that each tensor it is given lives on a device type its group serves, and
    raises :class:`CollectiveDeviceError` otherwise, before torch would and with the call
    named. ``audit.calls`` lists what ran.

    Only calls made through ``torch.distributed``'s names are seen; DTensor's functional
    collectives (``torch.ops._c10d_functional``) go around them. Process-wide: patching
    module attributes reaches every thread, so one audit at a time.
    """

    _active = False

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []
        self._saved: dict[tuple[Any, str], Any] = {}

    def check(self, op: str, group: Any, tensors: list[torch.Tensor]) -> None:
        """Raise unless every tensor's device type is one ``group`` serves; record the call."""
        import torch.distributed as dist

        served = served_device_types(group)
        devices = tuple(t.device.type for t in tensors)
        for device in devices:
            if device not in served:
                raise CollectiveDeviceError(
                    f"{op} was handed a {device} tensor on a group whose backend ({dist.get_backend_config(group)}) "
                    f"serves only {sorted(served)}: on GPU this is a host tensor sent to an NCCL group; reduce "
                    "host tensors on the control group (ProcessGroups.host), device tensors on the device groups")
        self.calls.append(CollectiveCall(op=op, backend=dist.get_backend_config(group), devices=devices,
                                         group=group))

    def _wrap(self, op: str, fn, group_pos: Optional[int]):
        def audited(*args, **kwargs):
            positional = group_pos is not None and len(args) > group_pos
            group = kwargs.get("group", args[group_pos] if positional else None)
            self.check(op, group, [t for a in (*args, *kwargs.values()) for t in _tensors_in(a)])
            return fn(*args, **kwargs)

        audited.__wrapped__ = fn
        return audited

    def _wrap_batch(self, fn):
        def audited(p2p_op_list, *args, **kwargs):
            for p2p in p2p_op_list:
                name = getattr(getattr(p2p.op, "__wrapped__", p2p.op), "__name__", "p2p")
                self.check(f"batch_isend_irecv/{name}", p2p.group, [p2p.tensor])
            return fn(p2p_op_list, *args, **kwargs)

        audited.__wrapped__ = fn
        return audited

    def __enter__(self) -> "CollectiveAudit":
        import torch.distributed as dist
        from torch.distributed import distributed_c10d

        if CollectiveAudit._active:
            raise RuntimeError("a CollectiveAudit is already active in this process")
        CollectiveAudit._active = True
        # torch.distributed re-exports distributed_c10d's functions; internal calls (the
        # object collectives, P2POp) look them up in distributed_c10d: patch both names.
        for module in (dist, distributed_c10d):
            for op in _AUDITED:
                fn = getattr(module, op, None)
                if fn is not None:
                    self._saved[(module, op)] = fn
                    setattr(module, op, self._wrap(op, fn, _group_position(fn)))
            batch = getattr(module, "batch_isend_irecv", None)
            if batch is not None:
                self._saved[(module, "batch_isend_irecv")] = batch
                setattr(module, "batch_isend_irecv", self._wrap_batch(batch))
        return self

    def __exit__(self, *exc) -> None:
        for (module, op), fn in self._saved.items():
            setattr(module, op, fn)
        self._saved.clear()
        CollectiveAudit._active = False
