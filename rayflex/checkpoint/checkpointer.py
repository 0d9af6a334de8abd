"""AsyncCheckpointer: sharded, asynchronous, atomically committed checkpoints.

Save: the training thread pays only for staging — one ``copy_`` per tensor into host
buffers kept from the previous save (pinned on GPU hosts), behind a state dict built once
per attempt. DCP then plans and writes each rank's own shards through fsspec in a
background thread, coordinating on a dedicated gloo group. When rank 0's save completes, DCP has written
``.metadata`` after gathering every rank's write result, so every shard is durable; rank 0
then writes the commit marker (manifest.commit) — last — and applies retention. At most one
save is in flight: a new save first waits for the previous one; whether a due save is taken
then or deferred until that upload ended is the workers' decision (``save_timing``).

Load: rank 0 picks the newest committed step that verifies (falling back past a corrupt
one), broadcasts its choice, and every rank loads it into its *current* mesh: DCP reshards
from whatever world size and pipeline split saved it, because keys are global block FQNs.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

from rayflex.constants import knob, slow_upload
from rayflex.errors import CheckpointError
from rayflex.checkpoint import manifest as mf
from rayflex.storage.fs import fsspec_kwargs
from rayflex.storage.fs import join as fs_join
from rayflex.storage.fs import Store, resolve, with_retries

log = logging.getLogger(__name__)

EXTRA_FILE = "rayflex_state.json"
# The optimizer's hyper-parameters (lr, betas, eps, ...): one entry per parameter under it.
HPARAMS_KEY = "optim_hparams"
# Where replicas that train apart (DiLoCo) keep their common point, keyed by parameter: the
# one model such a checkpoint stands for (a run that keeps one model, and an export, read it).
COMMON_MODEL = "outer_anchor"
# Tensors only one rank holds (``RankOwn``): their section.
OWN = "rank_own"


@dataclass(frozen=True)
class RankOwn:
    """Tensors of one rank that no mesh shards and no other rank holds (int8's error-feedback
    residuals): saved under keys naming the rank and its mesh (``prefix``, no dots), read
    back only by the same rank of the same mesh at the sizes the checkpoint holds (they
    need not exist yet when it is read). Another mesh reads none: they start afresh."""

    prefix: str
    tensors: Callable[[], dict[str, torch.Tensor]]
    load: Callable[[dict[str, torch.Tensor]], None]


@dataclass(kw_only=True)
class TrainState:
    """What a checkpoint holds for one rank: its stage modules and their optimizers, plus
    run-level scalars (step, data position, RNG, config, the total steps it trains toward).

    ``total_steps`` is recorded, not restored: a resume compares it with its own
    ``run.steps`` to tell that the learning-rate schedule changed. rayflex's worker derives
    the learning rate from (step, run.steps) and passes no ``schedulers``; torch schedulers
    given here have their counters saved and restored.
    """

    modules: list[nn.Module]
    optimizers: list[torch.optim.Optimizer]
    get_step: Callable[[], int]
    schedulers: list[Any] = field(default_factory=list)
    total_steps: Optional[int] = None
    sample_order: Optional[int] = None  # rayflex.data.sampler.SAMPLE_ORDER of the run
    config: dict = field(default_factory=dict)
    # The metrics of the steps up to the save (rank 0's), kept with it: a restart that finds
    # no live rank that reported them writes their lines from here.
    recent_steps: Optional[Callable[[], list[dict]]] = None
    # Sections of tensors beside the model's and optimizer's ({section: {parameter FQN:
    # tensor}}, each sharded like its parameter, so DCP reshards it as it does them):
    # DiLoCo's outer momentum and anchor. A section a checkpoint lacks is left as it is.
    outer: dict = field(default_factory=dict)
    # Replicas that train apart (DiLoCo) each keep their own model and optimizer state:
    # replica r > 0 saves them under ``model_replica<r>`` / ``optim_replica<r>``, replica 0
    # under the plain names any run reads. ``replicas``: how many there are.
    replica: int = 0
    replicas: int = 1
    own: Optional[RankOwn] = None

    def section(self, name: str) -> str:
        """Where this rank's ``"model"`` or ``"optim"`` goes (:attr:`replica`)."""
        return name if self.replica == 0 else f"{name}_replica{self.replica}"

    def fit_to(self, saved) -> bool:
        """Read a checkpoint whose entries are ``saved`` (its .metadata keys): True when it
        was written by another number of apart-training replicas, and every replica then
        reads the first's model and optimizer (the caller puts the replicas' common point,
        the anchor, in place of the model)."""
        written = 1 + max((int(key.split(".", 1)[0][len("model_replica"):]) for key in saved
                           if key.startswith("model_replica")), default=0)
        if written == self.replicas:
            return False
        self.replica = 0
        return True

    def tensor_state(self, *, packed: bool = True) -> dict[str, Any]:
        """What DCP saves and loads: the model and optimizer state dicts (flattened), and —
        ``packed`` — the optimizer's non-tensor hyper-parameters as one entry per parameter.

        A flattened optimizer state dict holds every hyper-parameter of every parameter as
        its own entry (``param_groups.<fqn>.lr``, ``.betas``, ... eleven for AdamW): three
        entries in four of a GPT's checkpoint, each planned, pickled, written and described
        in .metadata by every save. Packed, a parameter's are one tuple of (name, value)
        pairs, ``optim_hparams.<fqn>`` (keyed by parameter, so any pipeline split saves and
        loads the same entries); loading unpacks them. ``packed=False``: the layout of
        checkpoints written before."""
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                             get_optimizer_state_dict)

        opts = StateDictOptions(flatten_optimizer_state_dict=True)
        model, optim = {}, {}
        for module, opt in zip(self.modules, self.optimizers):
            model.update(get_model_state_dict(module))
            optim.update(get_optimizer_state_dict(module, opt, options=opts))
        outer = {name: dict(tensors) for name, tensors in self.outer.items()}
        own = self.own.tensors() if self.own is not None else {}
        if own:
            outer[OWN] = {f"{self.own.prefix}.{key}": t for key, t in own.items()}
        mine = {self.section("model"): model}
        if not packed:
            return {**mine, self.section("optim"): optim, **outer}
        for key in [key for key, value in optim.items() if _is_hparam(key, value)]:
            del optim[key]
        return {**mine, self.section("optim"): optim, HPARAMS_KEY: pack_hparams(self.hparam_groups(), optim), **outer}

    def identity(self) -> tuple:
        """Changes when a tensor the checkpoint reads is re-created (an optimizer that
        gained state, or loaded a state dict); in-place updates keep it."""
        ids = []
        for module, opt in zip(self.modules, self.optimizers):
            ids.append(id(module))
            ids.append(id(opt.state))
            for p, st in opt.state.items():
                ids.append(id(p))
                ids.extend(id(v) for v in st.values() if isinstance(v, torch.Tensor))
        if self.own is not None:
            ids.extend(id(t) for t in self.own.tensors().values())
        return tuple(ids)

    def hparam_groups(self) -> list[tuple[dict, tuple[str, ...], tuple[str, ...]]]:
        """(live param group, its hyper-parameter names, its parameters' fqns) per optimizer
        param group: a learning-rate schedule changes the values between saves, and every
        parameter of a group has the same ones."""
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        out = []
        for module, opt in zip(self.modules, self.optimizers):
            nested = get_optimizer_state_dict(module, opt)
            for group, saved in zip(opt.param_groups, nested["param_groups"]):
                out.append((group, tuple(k for k in saved if k != "params"), tuple(saved["params"])))
        return out

    def load_tensor_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                             set_optimizer_state_dict)

        # Each stage takes its own keys out of the merged dicts (keys are global FQNs).
        opts = StateDictOptions(flatten_optimizer_state_dict=True, strict=False)
        optim = dict(state[self.section("optim")])
        model = state[self.section("model")]
        for fqn, pairs in state.get(HPARAMS_KEY, {}).items():
            optim.update((f"{_PG}{fqn}.{name}", value) for name, value in pairs)
        for module, opt in zip(self.modules, self.optimizers):
            set_model_state_dict(module, model, options=StateDictOptions(strict=False))
            set_optimizer_state_dict(module, opt, optim, options=opts)
        if self.own is not None:  # none read for this rank of this mesh: its own tensors start afresh
            cut = len(self.own.prefix) + 1
            self.own.load({key[cut:]: t for key, t in state.get(OWN, {}).items()})

    def extra_state(self) -> dict[str, Any]:
        buf = io.BytesIO()
        torch.save(torch.get_rng_state(), buf)
        extra = {}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            # The generator of the device this rank trains on (dropout and other random
            # ops of a model on GPU draw from it, not from the CPU generator above).
            cuda_buf = io.BytesIO()
            torch.save(torch.cuda.get_rng_state(), cuda_buf)
            extra["cuda_rng"] = base64.b64encode(cuda_buf.getvalue()).decode()
        return {**extra, "step": self.get_step(), "data_position_steps": self.get_step(),
                "total_steps": self.total_steps, "sample_order": self.sample_order,
                # The LR lambdas are code, not state: keep only the counters.
                "schedulers": [{k: v for k, v in s.state_dict().items() if k != "lr_lambdas"}
                               for s in self.schedulers],
                "torch_rng": base64.b64encode(buf.getvalue()).decode(), "config": self.config,
                "recent_steps": self.recent_steps() if self.recent_steps is not None else []}

    def load_extra(self, extra: dict[str, Any]) -> None:
        # Every stage's scheduler follows the same schedule; the saved split may differ.
        # (Counters a checkpoint holds for schedulers this state has none of are ignored:
        # checkpoints written before the worker stopped using LambdaLR have them.)
        saved = extra.get("schedulers") or []
        if saved:
            for s in self.schedulers:
                s.load_state_dict({**saved[0], "lr_lambdas": [None] * len(s.lr_lambdas)})
        torch.set_rng_state(torch.load(io.BytesIO(base64.b64decode(extra["torch_rng"]))))
        if extra.get("cuda_rng") and torch.cuda.is_available():
            torch.cuda.set_rng_state(torch.load(io.BytesIO(base64.b64decode(extra["cuda_rng"]))))


def without_unsaved(tensors: dict, sections, saved) -> dict:
    """``tensors`` less the entries of ``sections`` (``TrainState.outer``'s) a checkpoint
    does not hold: a run that turns DiLoCo on resumes a checkpoint saved without it."""
    out = dict(tensors)
    for name in sections:
        kept = {k: v for k, v in out[name].items() if f"{name}.{k}" in saved}
        if len(kept) < len(out[name]):
            log.info("the checkpoint holds no %s for %d parameters: left as it is", name, len(out[name]) - len(kept))
        if kept:
            out[name] = kept
        else:
            del out[name]
    return out


def with_own_as_saved(tensors: dict, state: TrainState, saved) -> dict:
    """``tensors`` whose own section (``TrainState.own``) is what the checkpoint (its
    .metadata entries ``saved``) holds for this rank of this mesh, allocated at the saved
    sizes; without any, the section is left out and the rank's own tensors start afresh."""
    tensors.pop(OWN, None)
    if state.own is None:
        return tensors
    head = f"{OWN}.{state.own.prefix}."
    found = {key[len(OWN) + 1:]: md for key, md in saved.items() if key.startswith(head)}
    if found:
        tensors[OWN] = {key: torch.zeros(tuple(md.size), dtype=md.properties.dtype) for key, md in found.items()}
    return tensors


def read_model_from_common_point(tensors: dict, state: TrainState, saved) -> bool:
    """A run that keeps one model, resuming a checkpoint of replicas that trained apart
    (DiLoCo, saved mid-round), reads their common point rather than the first replica's
    model: the model entries the checkpoint holds there move to that section of
    ``tensors`` (put back after the load). True if any did."""
    if COMMON_MODEL in state.outer:
        return False  # DiLoCo itself: its own restore decides (SlowTier.after_restore)
    model = tensors[state.section("model")]
    moved = {key: model.pop(key) for key in list(model) if f"{COMMON_MODEL}.{key}" in saved}
    if moved:
        tensors[COMMON_MODEL] = moved
    return bool(moved)


class HostStaging:
    """Host copies of one rank's checkpointed tensors, kept from save to save.

    Built once per attempt from the state dict (its DTensors are the live parameters and
    the optimizer's state tensors, both updated in place by training): the per-save cost
    is then one ``copy_`` per tensor into buffers that already exist — the memory-copy
    floor — plus refreshing the few scalars (learning rates) that change between saves.
    The staged dict wraps the buffers in DTensors with the live mesh and placements, so
    DCP writes the same shards, with the same keys, as from the live tensors.
    """

    def __init__(self, state: TrainState, *, pin: Optional[bool] = None, shared: bool = False):
        """``pin``: page-locked buffers (fast, asynchronous device-to-host copies); None
        pins exactly when a live tensor is on CUDA (a CPU run on a GPU host pins nothing
        and never initializes CUDA). ``shared``: the buffers are views of one
        shared-memory block (``upload_process.SharedBlock``) an uploader process reads;
        without room in /dev/shm they stay private (a warning and ``shared_fallback`` say why)."""
        from torch.distributed.tensor import DTensor

        self._key = state.identity()
        live = state.tensor_state()
        if pin is None:
            pin = any(t.is_cuda for t in _tensors(live))
        self._pin = pin
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (host buffer, live local tensor)
        self.nbytes = 0
        self.block = None
        self.shared_fallback = ""  # why buffers meant to be shared are private
        if shared:
            from rayflex.checkpoint.upload_process import SharedBlock, shm_room_for

            specs: list = []  # (shape, dtype) of each buffer, in the order host_copy takes them
            _walk(live, lambda t: specs.append((tuple(_local(t).shape), t.dtype)))
            fits, self.shared_fallback = shm_room_for(SharedBlock.size_of(specs))
            if fits:
                self.block = SharedBlock(specs, pin=pin)
            else:
                log.warning("checkpoint uploads stay in the training process: %s", self.shared_fallback)

        def host_copy(obj):
            local = _local(obj)
            buf = (self.block.take() if self.block is not None
                   else torch.empty(local.shape, dtype=local.dtype, device="cpu", pin_memory=pin))
            self._pairs.append((buf, local))
            self.nbytes += buf.numel() * buf.element_size()
            if isinstance(obj, DTensor):
                return DTensor.from_local(buf, obj.device_mesh, obj.placements, run_check=False,
                                          shape=obj.shape, stride=obj.stride())
            return buf

        self._staged = _walk(live, host_copy)
        self._hparam_groups = state.hparam_groups()
        self._optim_key = state.section("optim")

    def matches(self, state: TrainState) -> bool:
        """Still the same parameter and optimizer-state tensors (nothing was re-created)?"""
        return state.identity() == self._key

    def stage(self) -> dict[str, Any]:
        for buf, live in self._pairs:
            buf.copy_(live, non_blocking=self._pin and live.is_cuda)
        if self._pin:
            # The copies were queued on the training thread's current stream, behind the
            # optimizer step that wrote the tensors; they must land before training resumes.
            torch.cuda.current_stream().synchronize()
        self._staged[HPARAMS_KEY] = pack_hparams(self._hparam_groups, self._staged[self._optim_key])
        return self._staged

    def close(self) -> None:
        """Unpin a shared block (its memory goes once the uploader maps the next one)."""
        if self.block is not None:
            self.block.close()


class AsyncCheckpointer:
    def __init__(self, root: str, *, rank: int, group=None, use_async: bool = True, keep: int = 3,
                 mesh: Any = None, upload: str = "auto", upload_threads: int = 1, replicas: Any = None):
        """``upload``: where an asynchronous save's bytes are serialised and written —
        ``"process"`` (an uploader process reading shared staging buffers: no GIL shared
        with training), ``"thread"`` (a background thread of the training process), or
        ``"auto"`` (a thread, until the process path is measured on GPU). ``upload_threads``:
        files written in parallel per rank. ``replicas``: a ``replicas.client.ReplicaClient``
        (``CheckpointConfig.memory_replicas``): every shard file is also kept in the memory
        of this node and a peer's, and a restore reads the copies it can from there."""
        self.root = root.rstrip("/")
        self._store: Optional[Store] = None  # the root resolved once, at its first use
        self.replicas = replicas
        self.upload = upload
        self.upload_threads = upload_threads
        if use_async and upload == "process":
            from rayflex.checkpoint.upload_process import prewarm_uploader

            prewarm_uploader()
        self.rank = rank
        self.group = group
        self.use_async = use_async
        self.keep = keep
        self.mesh = mesh
        self._inflight: Optional[Future] = None
        self._abandoned: Optional[threading.Event] = None
        self._staging: Optional[HostStaging] = None
        from rayflex.checkpoint.save_plan import SavePlanCache

        self._plans = SavePlanCache(in_place_buffers=use_async)  # async: saves read the staging buffers
        # One background thread finishes (waits for, then commits) one save at a time.
        self._finisher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayflex-ckpt-commit")
        self._uploader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rayflex-ckpt-upload")
        self.last_blocked_s = 0.0

    @property
    def store(self) -> Store:
        if self._store is None or self._store.uri != self.root:  # a root set since is resolved anew
            self._store = Store(self.root)
        return self._store

    # ----------------------------------------------------------------- save

    def save(self, state: TrainState, *, step: int, reason: str = "periodic",
             due_step: Optional[int] = None) -> list[dict]:
        """Start a checkpoint of ``step``; returns reports of saves that finished meanwhile.
        ``due_step``: the step this save fell due at, when it was deferred until now.

        Blocks only for staging (and, first, for a previous save still in flight). Rank 0
        commits in the background the moment the upload completes, so a crash two steps
        later does not lose a checkpoint that was already written.
        """
        import torch.distributed.checkpoint as dcp

        from rayflex.checkpoint.dcp_io import CheckpointWriter

        t_wait = time.perf_counter()
        reports = self.wait()  # at most one save in flight: its buffers are free again
        waited = time.perf_counter() - t_wait
        path = mf.step_dir(self.root, step)
        # No storage round-trip here: leftovers of crashed attempts were cleared when this
        # attempt loaded its checkpoint (clear_after), so the step directory is fresh.
        t0 = time.perf_counter()
        if self.use_async:
            if self._staging is not None and self._staging.block is not None:
                from rayflex.checkpoint.upload_process import can_write

                if not can_write(self._staging.block):  # its uploader died: a new block for a new one
                    log.warning("checkpoint uploader gone: staging the state into a new shared block")
                    self._staging.close()
                    self._staging = None
            if self._staging is None or not self._staging.matches(state):
                if self._staging is not None:
                    self._staging.close()
                self._plans.forget_local()  # nothing of the old buffers is written again
                self._staging = HostStaging(state, shared=self.upload == "process")
            tensors = self._staging.stage()
        else:
            tensors = state.tensor_state()
        t_sd = time.perf_counter()
        extra = state.extra_state()
        # The same filesystem options as the rest of rayflex (endpoint, region, timeouts):
        # a dead endpoint fails the upload after bounded retries instead of hanging it.
        # Object-store directories are prefixes: the writer never makes (or creates) a bucket.
        options = dict(single_file_per_rank=True, sync_files=False, thread_count=self.upload_threads,
                       **fsspec_kwargs(path))
        block = self._staging.block if self.use_async else None
        self._abandoned = threading.Event()  # this save's: set by abandon()
        if block is not None:
            from rayflex.checkpoint import upload_process

            if upload_process.ready():
                writer = upload_process.process_upload_writer(path, block, plans=self._plans, **options)
            else:  # still starting (or died): this save uploads from a thread, the next from it
                upload_process.prewarm_uploader()
                block = None
        if block is None and self.replicas is not None:
            # An emergency save's ranks hand their uploads to keepers that stay (the commit
            # is then the controller's, once those uploads are done: control.handoff).
            writer = self.replicas.writer(path, step=step, emergency=reason == "emergency",
                                          abandoned=self._abandoned, plans=self._plans, **options)
        elif block is None:
            writer = CheckpointWriter(path, abandoned=self._abandoned, plans=self._plans, **options)
        _maybe_slow_upload(writer, step)
        group = self.group
        if self.use_async:
            # Planning (a gather on the checkpoint group) and the upload both run in the
            # background thread; training only waited for the copy above.
            # Beside a training step the upload yields the CPU to it; once the loop has ended
            # (a final, stop or emergency save: a spot notice's deadline) there is nothing to
            # yield to, and a lowered priority would only hand the cores to other processes.
            save = dcp.save if reason in LOOP_ENDED else _low_priority(dcp.save)
            upload = self._uploader.submit(save, tensors, storage_writer=writer,
                                           planner=self._plans.planner(), process_group=group)
        else:
            dcp.save(tensors, storage_writer=writer, planner=self._plans.planner(), process_group=group)
            upload = Future()
            upload.set_result(None)
        # Blocked: everything training waited for here, including a previous save that was
        # still uploading (checkpoints more often than uploads can keep up show up here).
        blocked = waited + time.perf_counter() - t0
        self.last_blocked_s = blocked
        nbytes = self._staging.nbytes if self.use_async else sum(t.numel() * t.element_size()
                                                                 for t in _tensors(tensors))
        report = {"step": step, "reason": reason, "blocked_s": blocked, "bytes": nbytes, "uri": path,
                  "state_dict_s": t_sd - t0, "waited_for_previous_s": waited, "due_step": due_step,
                  "upload": "process" if block is not None else ("thread" if self.use_async else "sync")}
        self._inflight = self._finisher.submit(self._finish, upload, report, extra, time.time(), writer)
        if not self.use_async:
            reports += self.wait()
        return reports

    def _finish(self, upload: Future, report: dict, extra: dict, started: float, writer: Any = None) -> dict:
        try:
            upload.result()
            if getattr(writer, "off_node", False):  # how long a notice must be to save this way
                report["replicated_s"] = writer.kept_until - started
            if getattr(writer, "emergency", False):
                # Uploads were handed to keepers: the controller commits once they are done.
                if self.rank == 0:
                    self._write_extra(report["step"], extra)
                    report["handed_off"] = {"world_size": getattr(self.mesh, "world_size", 1),
                                            "mesh": self._mesh_dims(), "keep": self.keep}
                    report["started_at"] = started  # the commit's total_s runs from here (wall clock)
                report["committed"] = False
            else:
                if self.rank == 0:
                    self._commit(report["step"], extra)
                report["committed"] = True
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException;
            # a failed save must not kill training: the event says so and the next save retries
            log.error("checkpoint of step %d failed: %s", report["step"], e)
            report["error"] = f"{type(e).__name__}: {e}"
        report["total_s"] = time.time() - started
        return report

    def abandon(self) -> None:
        """The attempt is over and its collectives aborted: the save in flight can never
        commit. It writes no further file (``checkpoint.dcp_io.SaveAbandoned``), so it ends
        soon and this process can be reused; a file already being written finishes."""
        if self._abandoned is not None:
            self._abandoned.set()

    def close(self) -> None:
        """Let go of the staging buffers (unpinning a shared block) and the cached save
        plans: the attempt is over."""
        self._plans.clear()
        if self._staging is not None:
            self._staging.close()
            self._staging = None

    def busy(self) -> bool:
        """A save is still being written or committed."""
        return self._inflight is not None and not self._inflight.done()

    def completed(self) -> list[dict]:
        """Reports of a save that has finished, without waiting for one that has not."""
        if self._inflight is not None and self._inflight.done():
            return self.wait()
        return []

    def wait(self, timeout_s: Optional[float] = None) -> list[dict]:
        """Block until the in-flight save (if any) is written and committed."""
        if self._inflight is None:
            return []
        report = self._inflight.result(timeout=timeout_s)
        self._inflight = None
        return [report]

    def settle(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the in-flight save to end, without collecting its
        report: safe from another thread while the training thread may call ``wait``."""
        from concurrent.futures import wait as wait_futures

        inflight = self._inflight
        if inflight is not None:
            wait_futures([inflight], timeout=timeout_s)

    def _commit(self, step: int, extra: dict) -> None:
        self._write_extra(step, extra)  # before the marker, so the manifest's checksums cover it too
        commit_step(self.store, step, world_size=getattr(self.mesh, "world_size", 1), mesh=self._mesh_dims(),
                    keep=self.keep)
        if self.replicas is not None:
            self.replicas.committed(step)  # the older steps' memory copies are superseded

    def _write_extra(self, step: int, extra: dict) -> None:
        _write_bytes(fs_join(mf.step_dir(self.root, step), EXTRA_FILE), json.dumps(extra).encode())

    def _mesh_dims(self) -> dict[str, int]:
        return {name: getattr(self.mesh, name, 1) for name in ("pp", "dp", "tp", "dp_replicate")}

    # ----------------------------------------------------------------- load
    def load_latest(self, state: TrainState) -> Optional[dict]:
        """Load the newest committed, verified checkpoint into ``state``; None if none."""
        import torch.distributed as dist

        # Rank 0 picks the newest committed step whose files are all there at their sizes;
        # every rank then loads it while rereading its share of the files for their checksums
        # (one pass over the disk: the load reads what the check just read, or the other way
        # round). A step that fails the check is withdrawn, and the next older one is loaded
        # over it.
        from torch.distributed.checkpoint.api import CheckpointException

        world = dist.get_world_size(self.group) if dist.is_initialized() else 1
        skipped: list[str] = []
        replica = state.replica
        while True:
            choice: list[Any] = [None]
            if self.rank == 0:
                found = mf.resolve_loadable(self.store, deep=False)
                for s in found.skipped:  # corrupt: withdraw it so it is never tried again
                    mf.quarantine(self.store, s.step, s.reason)
                skipped += [f"step {s.step}: {s.reason}" for s in found.skipped]
                if found.manifest is not None:
                    m = found.manifest
                    choice[0] = {"step": m.step, "world_size": m.world_size, "mesh": m.mesh, "skipped": skipped,
                                 "files": sorted(m.files)}
                    if self.replicas is not None:
                        shards = sorted(f for f in m.files if f.endswith(".distcp"))
                        choice[0]["holders"], choice[0]["missing"] = self.replicas.locate(
                            m.step, mf.step_dir(self.root, m.step), shards)
                elif skipped:
                    raise CheckpointError(f"no loadable checkpoint under {self.root}: every committed step "
                                          f"failed verification: {'; '.join(skipped)}")
                # Step directories past the one we resume from are leftovers of attempts that
                # crashed mid-upload (or quarantined); this attempt will write those steps anew.
                mf.clear_after(self.store, choice[0]["step"] if choice[0] else -1)
            if dist.is_initialized():
                dist.broadcast_object_list(choice, src=0, group=self.group)
            info = choice[0]
            if info is None:
                return None
            rank = dist.get_rank(self.group) if dist.is_initialized() else 0
            share = _checked_by(info.pop("files"), rank, world, same_world=info["world_size"] == world)
            state.replica = replica  # a step loaded before may have set it (fit_to)
            with ThreadPoolExecutor(1, thread_name_prefix="rayflex-verify") as pool:
                checking = pool.submit(_problem_with, self.store, info["step"], share)
                try:
                    loaded, failure = self._load(state, info), None
                except CheckpointException as e:  # a corrupt file may fail the load itself (on every rank)
                    loaded, failure = None, e
                problems: list[Any] = [checking.result()]
            if world > 1:
                problems = [None] * world
                dist.all_gather_object(problems, checking.result(), group=self.group)
            bad = [p for p in problems if p]
            if not bad:
                if failure is not None:
                    raise failure
                return loaded
            if self.rank == 0:
                reason = "; ".join(bad)
                log.warning("skipping checkpoint step %d: %s", info["step"], reason)
                mf.quarantine(self.store, info["step"], reason)
                skipped.append(f"step {info['step']}: {reason}")

    def _load(self, state: TrainState, info: dict) -> dict:
        """Load the checkpoint ``info`` names into ``state``; ``info``, completed."""
        import torch.distributed.checkpoint as dcp

        from rayflex.checkpoint.dcp_io import CheckpointReader

        path = mf.step_dir(self.root, info["step"])
        self._staging = None  # loading replaces the optimizer's state tensors
        holders, missing = info.pop("holders", None), info.pop("missing", None)
        if holders is not None:
            reader = self.replicas.reader(path, step=info["step"], holders=holders, missing=missing,
                                          **fsspec_kwargs(path))
        else:
            reader = CheckpointReader(path, **fsspec_kwargs(path))
        # Checkpoints written before the hyper-parameters were packed hold one entry each.
        saved = reader.read_metadata().state_dict_metadata
        info["replicas_changed"] = state.fit_to(saved)
        tensors = without_unsaved(state.tensor_state(packed=packed_hparams(saved)), state.outer, saved)
        tensors = with_own_as_saved(tensors, state, saved)
        from_common = read_model_from_common_point(tensors, state, saved)
        info["loaded_sections"] = sorted(tensors)
        t_load = time.perf_counter()
        dcp.load(tensors, storage_reader=reader, process_group=self.group)
        info["load_s"] = time.perf_counter() - t_load
        if from_common:
            tensors[state.section("model")].update(tensors.pop(COMMON_MODEL))
        if holders is not None:
            info["sources"] = reader.report  # which shard files this rank read from where
        state.load_tensor_state(tensors)
        extra = json.loads(_read_bytes(fs_join(path, EXTRA_FILE)))
        state.load_extra(extra)
        info["uri"] = path
        # The run.steps it was trained toward (None: saved before rayflex recorded it).
        info["total_steps"] = extra.get("total_steps")
        info["sample_order"] = extra.get("sample_order")  # None: saved before it was recorded
        info["recent_steps"] = [r for r in extra.get("recent_steps") or [] if r["step"] <= info["step"]]
        return info


def _checked_by(files: list[str], rank: int, world: int, *, same_world: bool) -> list[str]:
    """The files ``rank`` checksums: at the world size that saved them, the shard files it
    loads itself (``__<rank>_*``, read once for both), and a share of the others."""
    if not same_world:
        return files[rank::world]
    own = [f for f in files if f.startswith(f"__{rank}_")]
    rest = [f for f in files if not _SHARD_FILE.match(f)]
    return own + rest[rank::world]


_SHARD_FILE = re.compile(r"__\d+_")  # DCP's per-rank data files: __<rank>_<n>.distcp


def _problem_with(store, step: int, share: list[str]) -> Optional[str]:
    """What is wrong with committed ``step`` (its files' sizes, and the checksums of those in
    ``share``), or None."""
    try:
        mf.verify(store, step, deep=True, only=share)
    except CheckpointError as err:
        return str(err)
    return None


def commit_step(root: "str | Store", step: int, *, world_size: int, mesh: dict, keep: int) -> None:
    """Commit ``step`` (every file of it written), then drop what retention no longer keeps."""
    store = Store.of(root)
    mf.commit(store, step, world_size=world_size, mesh=mesh, extra={"reason": "rayflex"})
    try:
        mf.apply_retention(store, keep)
        mf.gc_uncommitted(store)
    except Exception as e:  # noqa: BLE001 - housekeeping must not fail a committed save
        log.warning("checkpoint housekeeping failed: %s", e)


def commit_if_whole(root: str, step: int, *, world_size: int, mesh: dict, keep: int) -> None:
    """Commit an emergency save whose uploads keepers finished (the ranks are gone): only
    if every shard file DCP's ``.metadata`` names is in storage, whole; else CheckpointError
    naming what is missing (the step then stays uncommitted and is never loaded)."""
    from rayflex.checkpoint.dcp_io import missing_shard_files

    store = Store(root)
    missing = missing_shard_files(mf.step_dir(store, step))
    if missing:
        raise CheckpointError(f"step {step} cannot be committed: {'; '.join(missing)}")
    try:
        store.read_bytes(mf.step_name(step), EXTRA_FILE)
    except FileNotFoundError:
        raise CheckpointError(f"step {step} cannot be committed: {EXTRA_FILE} is missing (rank 0 did not finish)")
    commit_step(store, step, world_size=world_size, mesh=mesh, keep=keep)


# Save reasons of a training loop that has ended (TrainWorker._loop): no step runs beside them.
LOOP_ENDED = frozenset({"final", "stop", "emergency"})


def _low_priority(fn: Callable) -> Callable:
    """Run ``fn`` with this thread's CPU priority lowered (``RAYFLEX_UPLOAD_NICE``, Linux):
    serializing and sending shards then uses the cycles training leaves idle instead of
    taking them from the step, which waits on nothing the upload produces."""
    import os
    import threading

    def renice(tid: Optional[int], value: int) -> Optional[int]:
        if tid is None or not hasattr(os, "setpriority"):
            return None
        try:  # per-thread on Linux: a thread id is a process id for setpriority
            before = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, value)
            return before
        except OSError as e:
            log.debug("could not change thread %s's priority: %s", tid, e)
            return None

    def run(*args, **kwargs):
        nice = int(knob("UPLOAD_NICE"))
        if not nice:
            return fn(*args, **kwargs)
        # This thread (the checkpointer's uploader, reused by its next save) and fsspec's
        # shared event-loop thread, which s3fs sends from: lowered for this upload only (an
        # unprivileged process may not raise them back; then they stay low, which only slows
        # this worker's later background I/O).
        from fsspec.asyn import get_loop, iothread

        get_loop()
        tids = [threading.get_native_id(), getattr(iothread[0], "native_id", None)]
        before = [renice(tid, nice) for tid in tids]
        try:
            return fn(*args, **kwargs)
        finally:
            for tid, value in zip(tids, before):
                if value is not None:
                    renice(tid, value)

    return run


def _maybe_slow_upload(writer, step: int) -> None:
    """Fault injection for crash tests (``constants.slow_upload``): delays the background
    upload of the saves it names (staging is not delayed). Worker processes keep the
    variable across restarts, so a bound keeps the saves after a recovery fast."""
    fault = slow_upload()
    if fault is None or not fault.applies_to(step):
        return
    if hasattr(writer, "upload_delay_s"):  # a replicating writer: its upload, not its memory copy, is slow
        writer.upload_delay_s = fault.seconds
        return
    original = writer.write_data

    def slow_write_data(*args, **kwargs):
        time.sleep(fault.seconds)
        return original(*args, **kwargs)

    writer.write_data = slow_write_data


def _write_bytes(uri: str, data: bytes) -> None:
    fs, path = resolve(uri)
    with_retries(lambda: fs.pipe_file(path, data), what=f"write {uri}")


def _read_bytes(uri: str) -> bytes:
    fs, path = resolve(uri)
    return with_retries(lambda: fs.cat_file(path), what=f"read {uri}")


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


_PG = "param_groups."  # the prefix of hyper-parameter keys in a flattened optimizer state dict


def _is_hparam(key: str, value: Any) -> bool:
    """A non-tensor hyper-parameter entry of a flattened optimizer state dict."""
    return key.startswith(_PG) and not isinstance(value, torch.Tensor)


def pack_hparams(hparam_groups, optim: dict) -> dict[str, tuple]:
    """{parameter fqn: ((name, value), ...)}: the current hyper-parameters of each param
    group (``TrainState.hparam_groups``), one tuple shared by the group's parameters. A
    tensor-valued one (lr as a tensor) goes into ``optim`` under its flattened key instead,
    as a flattened optimizer state dict holds it."""
    packed: dict[str, tuple] = {}
    for group, names, fqns in hparam_groups:
        pairs = []
        for name in names:
            value = group[name]
            if isinstance(value, torch.Tensor):
                optim.update((f"{_PG}{fqn}.{name}", value) for fqn in fqns)
            else:
                pairs.append((name, value))
        if pairs:
            packed.update(dict.fromkeys(fqns, tuple(pairs)))
    return packed


def packed_hparams(entries) -> bool:
    """Whether a checkpoint's entries (.metadata keys) hold packed hyper-parameters."""
    return any(key.startswith(HPARAMS_KEY + ".") for key in entries)


def _walk(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with every tensor (DTensor included) replaced by ``fn(tensor)``, in a fixed order."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, fn) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_walk(v, fn) for v in obj]
    return obj


def _tensors(obj: Any):
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        yield obj._local_tensor
    elif isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
