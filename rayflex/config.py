"""User-facing configuration: keyword-only dataclasses validated on construction.

Every check runs in ``__post_init__`` (or in :func:`validate_together` for checks that
span several configs), so a bad value fails on the driver before any actor exists. Each
error names the field and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from rayflex.constants import DEFAULT_SHUFFLE_WINDOW
from rayflex.errors import ConfigError
from rayflex.mesh import rules
from rayflex.schemes import SUPPORTED_SCHEMES, check_backend

SCHEDULES = ("gpipe", "1f1b", "interleaved")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _positive_int(cls: str, name: str, value: Any, fix: str = "use an integer >= 1") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{cls}.{name}", f"must be a positive integer, got {value!r}", fix)


def _non_negative_int(cls: str, name: str, value: Any, fix: str = "use an integer >= 0") -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigError(f"{cls}.{name}", f"must be an integer >= 0, got {value!r}", fix)


def check_uri(where: str, uri: str) -> None:
    """Reject URIs whose scheme rayflex cannot write to (a bare path means file://), and
    object-store URIs whose fsspec package (an extra) is not installed.

    The scheme table is ``rayflex.schemes`` (shared with ``storage``); a store's package is
    imported only when a URI of its scheme is checked."""
    if not isinstance(uri, str) or not uri:
        raise ConfigError(where, f"must be a non-empty URI string, got {uri!r}",
                          "use e.g. 'file:///tmp/rayflex' or 's3://bucket/prefix'")
    if "://" in uri:
        scheme = uri.split("://", 1)[0].lower()
        if scheme not in SUPPORTED_SCHEMES:
            raise ConfigError(where, f"unknown storage scheme {scheme!r} in {uri!r}",
                              f"use one of {', '.join(s + '://' for s in SUPPORTED_SCHEMES)}")
        check_backend(uri, field=where)


@dataclass(kw_only=True, frozen=True)
class ScalingConfig:
    """How many workers and what each one needs.

    ``num_workers`` is the size the run asks for; ``min_workers``/``max_workers`` bound
    elastic restarts (both default to ``num_workers``: a fixed-size run).
    """

    num_workers: int = 4
    min_workers: Optional[int] = None
    max_workers: Optional[int] = None
    cpus_per_worker: float = 1.0
    use_gpu: bool = False
    resources_per_worker: dict = field(default_factory=dict)
    # Torch intra-op threads per worker; 1 avoids oversubscribing small machines.
    torch_threads: int = 1
    # Node labels every worker's node must carry, e.g. {"ray.io/market-type": "spot"}.
    node_labels: dict = field(default_factory=dict)
    # Where ranks go: "planned" (the topology-aware planner), or, to measure what it buys,
    # "node_order" (Ray Train's: ranks fill nodes in node order, by address) or
    # "shuffled:SEED" (tp groups whole, otherwise a seeded random order).
    placement: str = "planned"

    def __post_init__(self) -> None:
        c = "ScalingConfig"
        how, colon, seed = str(self.placement).partition(":")
        if not (self.placement in ("planned", "node_order") or (how == "shuffled" and seed.isdigit())):
            raise ConfigError(f"{c}.placement", f"unknown placement {self.placement!r}",
                              "use 'planned' (the default), 'node_order' or 'shuffled:SEED' (e.g. 'shuffled:7')")
        _positive_int(c, "num_workers", self.num_workers)
        lo = self.num_workers if self.min_workers is None else self.min_workers
        hi = self.num_workers if self.max_workers is None else self.max_workers
        _positive_int(c, "min_workers", lo)
        _positive_int(c, "max_workers", hi)
        if lo > hi:
            raise ConfigError(f"{c}.min_workers", f"min_workers={lo} is greater than max_workers={hi}",
                              "set min_workers <= max_workers")
        if not lo <= self.num_workers <= hi:
            raise ConfigError(f"{c}.num_workers",
                              f"num_workers={self.num_workers} is outside [min_workers={lo}, max_workers={hi}]",
                              "pick num_workers between min_workers and max_workers")
        if not isinstance(self.cpus_per_worker, (int, float)) or self.cpus_per_worker <= 0:
            raise ConfigError(f"{c}.cpus_per_worker", f"must be > 0, got {self.cpus_per_worker!r}",
                              "use e.g. 1 (a worker needs CPU time even on a GPU node)")
        if not isinstance(self.node_labels, dict):
            raise ConfigError(f"{c}.node_labels", "must be a dict of label -> value",
                              "use e.g. {'ray.io/market-type': 'spot'}")
        _positive_int(c, "torch_threads", self.torch_threads)
        if not isinstance(self.resources_per_worker, dict):
            raise ConfigError(f"{c}.resources_per_worker", "must be a dict of resource -> amount",
                              "use e.g. {'accelerator_type:H100': 0.001}")

    # Resolved bounds. The fields keep None ("same as num_workers") so that overriding
    # num_workers alone (`--set scaling.num_workers=2`) moves a fixed-size run's bounds too.
    @property
    def min_size(self) -> int:
        return self.num_workers if self.min_workers is None else self.min_workers

    @property
    def max_size(self) -> int:
        return self.num_workers if self.max_workers is None else self.max_workers

    def worker_resources(self) -> dict[str, float]:
        res = {"CPU": float(self.cpus_per_worker)}
        if self.use_gpu:
            res["GPU"] = 1.0
        res.update({k: float(v) for k, v in self.resources_per_worker.items()})
        return {k: v for k, v in res.items() if v > 0}


@dataclass(kw_only=True, frozen=True)
class ParallelConfig:
    """How the model is split: pipeline stages, tensor parallelism, FSDP shard groups; the
    data-parallel size is whatever the world size leaves.

    ``pp`` stages (x ``stages_per_rank`` virtual stages for the interleaved schedule), each
    split over ``tp`` tensor-parallel ranks (always on one node: the tp group exchanges
    activations twice per block), ``dp = world_size // (pp * tp)`` data-parallel ranks per
    stage. ``dp_shard``: FSDP2 shards each stage over groups of ``dp_shard`` dp ranks and
    replicates over ``dp // dp_shard`` groups (HSDP: shard inside the fast tier, all-reduce
    across the slow one); None shards over every dp rank. ``tp`` and ``dp_shard`` stay fixed
    through elastic restarts (the node shape fixes them); a restart changes dp.
    ``microbatches`` defaults to the smallest count the schedule allows (``pp`` for
    gpipe/1f1b, ``pp*stages_per_rank``).

    ``layout="auto"`` (stored as ``pp="auto"``, which means the same): the capacity planner
    (``rayflex.planning.capacity.auto``) picks pp, tp, dp_shard, schedule, microbatches,
    stages_per_rank (and the pp=1 micro-batch) for the world size at launch and again at
    every elastic restart. ``cluster`` is a cluster-description YAML (as ``rayflex plan
    --cluster`` takes) giving the devices and topology; None plans on the live Ray topology
    with this host's CPUs as the devices. It is only read with ``layout="auto"``.
    """

    pp: Union[int, str] = 1
    schedule: str = "1f1b"
    microbatches: Optional[int] = None
    stages_per_rank: int = 1
    # How blocks are balanced over stages: "params" (parameter count) or "uniform".
    balance: str = "params"
    cluster: Optional[str] = None
    tp: int = 1
    dp_shard: Optional[int] = None
    layout: Optional[str] = None

    def __post_init__(self) -> None:
        c = "ParallelConfig"
        if self.layout is not None:
            if self.layout != "auto":
                raise ConfigError(f"{c}.layout", f"unknown value {self.layout!r}",
                                  "use 'auto' to let the capacity planner choose, or None and set pp/tp/dp_shard")
            if self.pp not in (1, "auto") or self.tp != 1 or self.dp_shard is not None:
                raise ConfigError(f"{c}.layout", "layout='auto' chooses pp, tp and dp_shard itself",
                                  "leave pp, tp and dp_shard at their defaults, or drop layout='auto'")
            # Stored as pp="auto" (the one spelling the rest of the code reads), so that an
            # override of pp later (``parallel.pp=2``) leaves nothing auto behind.
            object.__setattr__(self, "pp", "auto")
            object.__setattr__(self, "layout", None)
        if isinstance(self.pp, str):
            if self.pp != "auto":
                raise ConfigError(f"{c}.pp", f"unknown value {self.pp!r}",
                                  "use a positive integer, or layout='auto' to let the capacity planner choose")
            # The planner chooses these; a user value would be silently overridden.
            for name, default in (("schedule", "1f1b"), ("microbatches", None), ("stages_per_rank", 1),
                                  ("tp", 1), ("dp_shard", None)):
                value = getattr(self, name)
                if value != default:
                    raise ConfigError(f"{c}.{name}",
                                      f"{name}={value!r} is chosen by the capacity planner with layout='auto'",
                                      f"leave {name} at its default ({default!r}), or set the layout yourself")
        else:
            _positive_int(c, "pp", self.pp, "use an integer >= 1, or layout='auto'")
        _positive_int(c, "tp", self.tp, "use an integer >= 1 (1: no tensor parallelism)")
        if self.dp_shard is not None:
            _positive_int(c, "dp_shard", self.dp_shard, "use an integer >= 1, or None to shard over every dp rank")
        if self.cluster is not None:
            if not isinstance(self.cluster, (str, os.PathLike)) or not str(self.cluster):
                raise ConfigError(f"{c}.cluster", f"must be a path to a cluster-description YAML, got "
                                  f"{self.cluster!r}", "see docs/capacity.md, or use None for the live cluster")
            # Absolute now: the controller reads it later, possibly from another directory.
            object.__setattr__(self, "cluster", os.path.abspath(os.fspath(self.cluster)))
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"{c}.schedule", f"unknown schedule {self.schedule!r}",
                              f"use one of {', '.join(SCHEDULES)}")
        _positive_int(c, "stages_per_rank", self.stages_per_rank)
        if self.schedule == "interleaved" and self.stages_per_rank < 2:
            raise ConfigError(f"{c}.stages_per_rank",
                              "the interleaved schedule needs at least 2 stages per rank",
                              "set stages_per_rank=2 or use schedule='1f1b'")
        if self.schedule != "interleaved" and self.stages_per_rank != 1:
            raise ConfigError(f"{c}.stages_per_rank",
                              f"stages_per_rank={self.stages_per_rank} only works with schedule='interleaved'",
                              "set schedule='interleaved' or stages_per_rank=1")
        if self.microbatches is not None:
            _positive_int(c, "microbatches", self.microbatches)
            rules.check_microbatches(self.pp, self.microbatches, self.schedule)
        if self.balance not in ("params", "uniform"):
            raise ConfigError(f"{c}.balance", f"unknown balance {self.balance!r}",
                              "use 'params' or 'uniform'")

    @property
    def is_auto(self) -> bool:
        return self.pp == "auto"

    @property
    def num_stages(self) -> Optional[int]:
        """Pipeline stages; None with pp='auto' (unknown until the planner resolves it)."""
        if self.is_auto:
            return None
        return self.pp * self.stages_per_rank

    def mesh_request(self) -> Optional[dict]:
        """The layout asked for, as the keywords ``rayflex.mesh.rules.split_batch`` takes;
        None with layout='auto'."""
        if self.is_auto:
            return None
        return dict(pp=self.pp, schedule=self.schedule, stages_per_rank=self.stages_per_rank,
                    microbatches=self.microbatches, tp=self.tp, dp_shard=self.dp_shard)


def _mixture_sources(sources: Any, uri: str) -> tuple:
    """``DataConfig.sources`` as a tuple of (uri, float weight), checked."""
    field_ = "DataConfig.sources"
    if uri:
        raise ConfigError(field_, f"both uri={uri!r} and sources are set", "give one: uri, or sources=[(uri, weight), ...]")
    try:
        pairs = [(u, w) for u, w in sources]
    except (TypeError, ValueError):
        raise ConfigError(field_, f"must be a list of (uri, weight) pairs, got {sources!r}",
                          "use sources=[('s3://bucket/web', 0.7), ('s3://bucket/code', 0.3)]") from None
    if len(pairs) < 2:
        raise ConfigError(field_, f"a mixture needs at least two sources, got {len(pairs)}",
                          "use DataConfig(uri=...) for one dataset")
    out = []
    for i, (u, w) in enumerate(pairs):
        check_uri(f"{field_}[{i}]", u)
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (w > 0 and w < float("inf")):
            raise ConfigError(f"{field_}[{i}]", f"weight must be a positive number, got {w!r}",
                              "give every source a finite weight > 0 (they are normalised)")
        out.append((u, float(w)))
    if len({u for u, _ in out}) < len(out):
        raise ConfigError(field_, "a source is listed twice", "list each dataset once and add up its weights")
    return tuple(out)


@dataclass(kw_only=True, frozen=True)
class DataConfig:
    """Token dataset and the fixed global batch.

    ``uri`` points at a directory of Parquet shards with a ``tokens`` column of
    ``seq_len + 1`` token ids per row. ``global_batch`` (in samples) is fixed for the whole
    run, whatever the world size; ``micro_batch`` is the per-rank forward size of gradient
    accumulation without a pipeline (pp == 1; None: the whole per-rank batch in one pass).
    A pipeline cuts its per-rank batch into ``ParallelConfig.microbatches`` instead. The
    divisibility rules are ``rayflex.mesh.rules``.
    """

    uri: str = ""
    seq_len: int = 64
    global_batch: int = 16
    micro_batch: Optional[int] = None
    seed: int = 0
    # Write which dataset rows each step consumed to ``samples.jsonl`` (an audit log that
    # proves exact data continuation across restarts; costs one line per step).
    log_samples: bool = False
    # Row groups shuffled together (rayflex.data.sampler): a step's rows come from about
    # twice this many row groups, which each rank caches. Larger mixes more, costs memory.
    shuffle_window: int = DEFAULT_SHUFFLE_WINDOW
    # Steps whose row groups a background thread loads ahead of training (0: off).
    prefetch_steps: int = 2
    # The tokenizer the data must have been prepared with (a directory with tokenizer.json,
    # or a Hugging Face name): checked against the dataset's rayflex_dataset.json before
    # any actor starts (rayflex.data.prepare.check_manifest). None: only the vocabulary
    # size is checked, when the dataset has a manifest.
    tokenizer: Optional[str] = None
    # A weighted mixture instead of one ``uri``: ``[(uri, weight), ...]``. Each step's rows
    # come from the sources in proportion to the weights (exactly, every period of
    # MIXTURE_PERIOD samples), each source in its own seeded order; resume stays exact.
    sources: Optional[tuple] = None

    def __post_init__(self) -> None:
        c = "DataConfig"
        if self.sources is not None:
            object.__setattr__(self, "sources", _mixture_sources(self.sources, self.uri))
        else:
            check_uri(f"{c}.uri", self.uri)
        _positive_int(c, "seq_len", self.seq_len)
        _positive_int(c, "global_batch", self.global_batch)
        if self.micro_batch is not None:
            _positive_int(c, "micro_batch", self.micro_batch)
        _non_negative_int(c, "seed", self.seed)
        _positive_int(c, "shuffle_window", self.shuffle_window)
        _non_negative_int(c, "prefetch_steps", self.prefetch_steps)


UPLOAD_MODES = ("auto", "process", "thread")
WHEN_BUSY = ("defer", "wait")  # what each does: rayflex.checkpoint.save_timing


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Asynchronous sharded checkpoints. ``every_steps=0`` disables periodic saves;
    ``every_steps="auto"`` picks the interval from this run's measured save cost and
    failure rate (Young/Daly, ``rayflex.faults.checkpoint_interval``), re-evaluated as the
    run goes; ``mtbf_prior_s`` is the mean time between failures it assumes before the run
    has seen its own (one failure per hour: a few hundred spot nodes)."""

    every_steps: int | str = 0
    mtbf_prior_s: float = 3600.0
    keep: int = 3
    async_save: bool = True
    # Where checkpoints go; None means ``{RunConfig.storage}/{name}/checkpoints``.
    uri: Optional[str] = None
    # Load the latest committed checkpoint of this run on start (resume).
    resume: bool = True
    # Where an async save's bytes are serialised and written: "process" (an uploader
    # process per rank reading shared-memory staging: shares no GIL with training; needs
    # /dev/shm room for one copy of the rank's state), "thread" (a background thread of
    # the training process), "auto" (thread until the process path is measured on GPU).
    upload: str = "auto"
    # Files each rank writes in parallel per save (more parallel PUTs to an object store).
    upload_threads: int = 1
    # Keep every saved shard in host memory too: on its own node and on this many other
    # nodes (another rack when the run has one). A restart then reads what it can from
    # memory — a dead process from its node's copy, a lost node from a replica — and the
    # rest from storage. 0: off. Costs (1 + memory_replicas) x the checkpoint's size of
    # RAM across the cluster, twice while a save is in flight (docs/guides/checkpoints.md, "Memory replicas").
    memory_replicas: int = 0
    # The most host memory the copies may take on one node, in GB (oldest steps go first;
    # a file beyond it is not kept). None: a quarter of the node's RAM.
    memory_budget_gb: Optional[float] = None
    # A save that falls due while the previous one is still being written: "defer" takes it
    # at the first step boundary after that upload ended (training never waits for an
    # upload; a checkpoint_deferred event says so), "wait" takes it on time and training
    # waits for the previous upload first. Emergency, stop and final saves always wait.
    when_busy: str = "defer"

    @property
    def memory_budget_bytes(self) -> Optional[int]:
        return None if self.memory_budget_gb is None else int(self.memory_budget_gb * 2**30)

    @property
    def auto_interval(self) -> bool:
        return self.every_steps == "auto"

    @property
    def periodic_steps(self) -> int:
        """The fixed interval the workers keep by themselves (0: none, or chosen by the controller)."""
        return 0 if self.auto_interval else self.every_steps

    def __post_init__(self) -> None:
        c = "CheckpointConfig"
        if self.every_steps != "auto":
            _non_negative_int(c, "every_steps", self.every_steps, 'use 0 (off), a step interval, or "auto"')
        if isinstance(self.mtbf_prior_s, bool) or not isinstance(self.mtbf_prior_s, (int, float)) \
                or not self.mtbf_prior_s > 0:
            raise ConfigError(f"{c}.mtbf_prior_s", f"must be a number of seconds > 0, got {self.mtbf_prior_s!r}",
                              "use the mean time between failures you expect of the cluster, e.g. 3600")
        _positive_int(c, "keep", self.keep)
        if self.upload not in UPLOAD_MODES:
            raise ConfigError(f"{c}.upload", f"unknown upload mode {self.upload!r}",
                              f"use one of {', '.join(UPLOAD_MODES)}")
        _positive_int(c, "upload_threads", self.upload_threads)
        if self.when_busy not in WHEN_BUSY:
            raise ConfigError(f"{c}.when_busy", f"unknown policy {self.when_busy!r}",
                              f"use one of {', '.join(WHEN_BUSY)} (\"defer\": training never waits for an upload)")
        _non_negative_int(c, "memory_replicas", self.memory_replicas,
                          "use 0 (off) or the number of other nodes to copy each shard to, e.g. 1")
        if self.memory_budget_gb is not None and (isinstance(self.memory_budget_gb, bool) or not isinstance(
                self.memory_budget_gb, (int, float)) or not self.memory_budget_gb > 0):
            raise ConfigError(f"{c}.memory_budget_gb", f"must be a number of GB > 0, got {self.memory_budget_gb!r}",
                              "use e.g. 64 (per node), or None for a quarter of each node's RAM")
        if self.memory_replicas and self.upload == "process":
            raise ConfigError(f"{c}.upload", "upload='process' cannot keep memory replicas: the uploader "
                              "process serializes the shards, and the copies are made from those bytes "
                              "in the training process",
                              "use upload='auto' or 'thread' with memory_replicas, or memory_replicas=0")
        if self.uri is not None:
            check_uri(f"{c}.uri", self.uri)


@dataclass(kw_only=True, frozen=True)
class ElasticConfig:
    """Failure and preemption budgets for restarts."""

    max_failures: int = 3
    max_preemptions: int = 10
    # Seconds to wait for enough resources before giving up on a restart.
    resource_wait_s: float = 120.0
    # Spot notices: Ray's drain state (what the autoscaler sets for spot terminations),
    # the cloud metadata endpoint polled on each worker node (None: off; "{node_id}" and
    # "{node_ip}" are substituted), and a notice file an operator may write.
    watch_ray_drain: bool = True
    metadata_url: Optional[str] = None
    metadata_kind: str = "aws"
    notice_file: Optional[str] = None
    # Safety margin on top of (a step + an estimated checkpoint) before a notice's deadline.
    emergency_margin_s: float = 2.0
    # When a restart needs worker processes that are not up yet (a dead one's replacement,
    # a preempted node's ranks moving elsewhere): True restarts at once with the workers
    # that are up (if that is a valid size >= min_workers) while the missing ones start,
    # then grows at a step boundary once they are warm — training never waits for process
    # start, at the cost of one more (checkpointed) restart. False waits for them.
    restart_while_warming: bool = True
    # After a failure without notice, resume from the survivors' live state of their last
    # finished step when every shard of it survived (a mesh with dp_replicate >= 2: HSDP):
    # no step is lost and nothing is read from storage. Otherwise, or False: the newest
    # checkpoint (memory replicas, then storage). A recovery_chosen event says which and why.
    live_recovery: bool = True
    # Failures expected per hour (a spot cluster's preemptions without notice, node and
    # process deaths). Set, layout="auto" prices them: a mesh whose shards have replicas
    # (dp_replicate >= 2) recovers from live peers, one without trains the steps since its
    # last checkpoint again, and the faster after failures wins (`rayflex plan` explains).
    # None: meshes rank by step time alone.
    failures_per_hour: Optional[float] = None
    # Entries of torch's collective flight recorder per worker process (0 = off): on a
    # hang the controller reads every rank's and names the deadlock (a hang_diagnosed
    # event; docs/guides/hangs.md).
    flight_recorder: int = 2000

    def __post_init__(self) -> None:
        c = "ElasticConfig"
        _non_negative_int(c, "flight_recorder", self.flight_recorder)
        if self.failures_per_hour is not None and (isinstance(self.failures_per_hour, bool) or not isinstance(
                self.failures_per_hour, (int, float)) or not 0 <= self.failures_per_hour < float("inf")):
            raise ConfigError(f"{c}.failures_per_hour", f"must be a number >= 0, got {self.failures_per_hour!r}",
                              "use e.g. 2 for a spot cluster, or None to rank meshes by step time alone")
        if not isinstance(self.live_recovery, bool):
            raise ConfigError(f"{c}.live_recovery", f"must be True or False, got {self.live_recovery!r}",
                              "use True (resume from the survivors' memory when every shard survived) or False "
                              "(always the newest checkpoint)")
        if not isinstance(self.restart_while_warming, bool):
            raise ConfigError(f"{c}.restart_while_warming", f"must be True or False, got {self.restart_while_warming!r}",
                              "use True (restart now, grow when warm) or False (wait for the new workers)")
        _non_negative_int(c, "max_failures", self.max_failures)
        _non_negative_int(c, "max_preemptions", self.max_preemptions)
        if not isinstance(self.resource_wait_s, (int, float)) or self.resource_wait_s < 0:
            raise ConfigError(f"{c}.resource_wait_s", f"must be >= 0, got {self.resource_wait_s!r}",
                              "use a number of seconds")
        if self.metadata_kind not in ("aws", "gcp"):
            raise ConfigError(f"{c}.metadata_kind", f"unknown metadata kind {self.metadata_kind!r}",
                              "use 'aws' (spot/instance-action) or 'gcp' (instance/preempted)")
        if self.metadata_url is not None and not str(self.metadata_url).startswith(("http://", "https://")):
            raise ConfigError(f"{c}.metadata_url", f"not an http(s) URL: {self.metadata_url!r}",
                              "use e.g. http://169.254.169.254/latest/meta-data/spot/instance-action")
        if not isinstance(self.emergency_margin_s, (int, float)) or self.emergency_margin_s < 0:
            raise ConfigError(f"{c}.emergency_margin_s", f"must be >= 0, got {self.emergency_margin_s!r}",
                              "use a number of seconds")


OPTIMIZER_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """AdamW with linear warm-up and cosine decay to ``min_lr_ratio * lr``.

    ``implementation`` picks torch's AdamW kernel, as torchtitan's optimizer config does:
    ``"fused"`` (the default: one kernel over all parameters, on CPU as on GPU), ``"foreach"``
    (a few list ops) or ``"for-loop"`` (torch's per-parameter loop, its default on CPU). The
    update is the same arithmetic; on FSDP-sharded (DTensor) parameters the loop pays the
    sharding dispatch per parameter and per op: on ``benchmarks/compare.py``'s model it took
    16 ms of a rank's ~100 ms CPU step, fused 3.5 ms."""

    lr: float = 3e-3
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.95)
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1
    grad_clip: Optional[float] = 1.0
    implementation: str = "fused"

    def __post_init__(self) -> None:
        c = "OptimizerConfig"
        if not isinstance(self.lr, (int, float)) or not self.lr > 0:
            raise ConfigError(f"{c}.lr", f"must be > 0, got {self.lr!r}", "use e.g. 3e-4")
        if not isinstance(self.weight_decay, (int, float)) or self.weight_decay < 0:
            raise ConfigError(f"{c}.weight_decay", f"must be >= 0, got {self.weight_decay!r}", "use e.g. 0.1")
        _non_negative_int(c, "warmup_steps", self.warmup_steps)
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"{c}.min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio!r}", "use e.g. 0.1")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError(f"{c}.grad_clip", f"must be > 0 or None, got {self.grad_clip!r}",
                              "use e.g. 1.0, or None to disable clipping")
        if self.implementation not in OPTIMIZER_IMPLEMENTATIONS:
            raise ConfigError(f"{c}.implementation", f"unknown AdamW implementation {self.implementation!r}",
                              f"use one of {', '.join(OPTIMIZER_IMPLEMENTATIONS)}")

    def build(self, params):
        """torch's AdamW over ``params`` with these hyper-parameters and kernel; the learning
        rate is set per step (:meth:`lr_of_step`)."""
        import torch

        kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
        return torch.optim.AdamW(params, lr=self.lr, betas=tuple(self.betas), weight_decay=self.weight_decay,
                                 **kernel[self.implementation])

    def lr_factor(self, step: int, total_steps: int) -> float:
        """Multiplier of ``lr`` after ``step`` optimizer steps: linear warm-up, then cosine
        decay to ``min_lr_ratio`` at ``total_steps``."""
        import math

        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, total_steps - self.warmup_steps)
        return self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def lr_of_step(self, step: int, total_steps: int) -> float:
        """The learning rate optimizer step ``step`` (1-based) trains at: the factor after
        ``step - 1`` steps. A pure function of the step and the run's *current* total, so a
        run resumed with a different ``run.steps`` follows the new schedule from its first
        step on (nothing about the learning rate is restored from a checkpoint)."""
        return self.lr * self.lr_factor(step - 1, total_steps)


PARAM_DTYPES = ("fp32", "bf16")
ACTIVATION_CHECKPOINTING = ("none", "full", "every_k", "auto")


@dataclass(kw_only=True, frozen=True)
class PrecisionConfig:
    """Mixed precision of the forward/backward (FSDP2's ``MixedPrecisionPolicy``).

    The model is built in fp32 and its sharded parameters stay fp32, so the optimizer
    steps fp32 master weights and keeps fp32 states whatever is chosen here.
    ``param_dtype`` is the dtype parameters are all-gathered and computed in;
    ``reduce_dtype`` is the dtype gradients are reduce-scattered (and accumulated, between
    microbatches) in. The model's last output is cast to fp32, so the loss is fp32.

    ``float8``: the blocks' linear layers compute their matmuls in float8 (torchao's
    float8 training, dynamic scaling), converted per block before sharding as torchtitan
    does; the output head and layers with a dimension not divisible by 16 stay as they
    are. Needs torchao and GPUs of compute capability 8.9 or newer (H100, L4, ...): the
    driver refuses it on CPU workers, a worker on an older GPU refuses it at setup.
    """

    param_dtype: str = "fp32"
    reduce_dtype: str = "fp32"
    float8: bool = False

    def __post_init__(self) -> None:
        c = "PrecisionConfig"
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value not in PARAM_DTYPES:
                raise ConfigError(f"{c}.{name}", f"unknown dtype {value!r}",
                                  f"use one of {', '.join(PARAM_DTYPES)} (bf16 compute usually pairs with "
                                  "reduce_dtype='fp32')")
        if not isinstance(self.float8, bool):
            raise ConfigError(f"{c}.float8", f"must be True or False, got {self.float8!r}",
                              "use True to train the linear layers in float8, False for param_dtype alone")

    @property
    def mixed(self) -> bool:
        """Whether anything runs below fp32 (False: the fp32 reference behaviour)."""
        return (self.param_dtype, self.reduce_dtype) != ("fp32", "fp32")


@dataclass(kw_only=True, frozen=True)
class MemoryConfig:
    """Trading compute for memory, per block (the unit of ``fully_shard``).

    ``activation_checkpointing``: "none" keeps every activation for backward; "full"
    keeps only each block's input and recomputes the block in backward; "every_k"
    does that for every ``ac_every``-th block (global block indices ``k-1, 2k-1, ...``,
    so the choice does not depend on the pipeline split); "auto" (with
    ``ParallelConfig(layout="auto")``): the capacity planner picks one of those per world
    size with the rest of the layout, the fastest that fits (the run's ``plan_chosen`` event
    says which). Parameter names, and so checkpoints, are the same whichever is chosen.

    ``compile``: ``torch.compile`` each block's forward (after checkpointing, before
    sharding) with ``compile_backend`` ("inductor" needs a C++ compiler on CPU;
    "aot_eager" needs none and is what the tests use).
    """

    activation_checkpointing: str = "none"
    ac_every: int = 2
    compile: bool = False
    compile_backend: str = "inductor"

    def __post_init__(self) -> None:
        c = "MemoryConfig"
        if self.activation_checkpointing not in ACTIVATION_CHECKPOINTING:
            raise ConfigError(f"{c}.activation_checkpointing", f"unknown mode {self.activation_checkpointing!r}",
                              f"use one of {', '.join(ACTIVATION_CHECKPOINTING)}")
        _positive_int(c, "ac_every", self.ac_every, "use an integer >= 1 (1 checkpoints every block, like 'full')")
        if not isinstance(self.compile, bool):
            raise ConfigError(f"{c}.compile", f"must be True or False, got {self.compile!r}",
                              "use True to torch.compile each block, False to run eagerly")
        if not isinstance(self.compile_backend, str) or not self.compile_backend:
            raise ConfigError(f"{c}.compile_backend", f"must be a torch.compile backend name, got "
                              f"{self.compile_backend!r}", "use 'inductor' (GPU) or 'aot_eager' (no compiler)")

    def checkpointed(self, index: int) -> bool:
        """Whether block ``index`` (global) recomputes its activations in backward; the one
        rule the workers and the memory model both follow."""
        if self.activation_checkpointing == "auto":
            raise ValueError("MemoryConfig(activation_checkpointing='auto') is resolved by the capacity planner "
                             "per world size (MeshPlan.memory_config); ask the resolved config")
        if self.activation_checkpointing == "full":
            return True
        if self.activation_checkpointing == "every_k":
            return (index + 1) % self.ac_every == 0
        return False


@dataclass(frozen=True)
class TrackerInfo:
    """An experiment tracker ``RunConfig.loggers`` may name (backends:
    ``rayflex/telemetry/trackers/``)."""

    name: str
    module: str    # the package the backend imports
    requires: str  # what to pip install for it


# TensorBoard is written with the ``tensorboard`` package's own event writer: tensorboardX
# imports torch at import time, and the Controller must never import torch.
TRACKERS: dict[str, TrackerInfo] = {t.name: t for t in (
    TrackerInfo("tensorboard", "tensorboard", "tensorboard"),
    TrackerInfo("mlflow", "mlflow", "mlflow-skinny"),
    TrackerInfo("wandb", "wandb", "wandb"),
)}

EXTRA_HINT = "pip install 'rayflex[tracking]'"


def missing_package(name: str) -> Optional[str]:
    """The pip package tracker ``name`` needs when it is not importable here, else None."""
    import importlib.util

    info = TRACKERS[name]
    try:
        found = importlib.util.find_spec(info.module) is not None
    except (ImportError, ValueError):
        found = False
    return None if found else info.requires


@dataclass(kw_only=True, frozen=True)
class RunConfig:
    """Run identity and length. The run directory is ``{storage}/{name}/``.

    ``steps=0`` trains nothing: the workers build (or load, ``init_from``) the weights,
    save them as the committed step-0 checkpoint, sharded as the run is, and the run
    finishes. That converts weights into a rayflex checkpoint ahead of a run (and lets
    ``rayflex ckpt export`` hand back exactly what was loaded)."""

    name: str
    storage: str = "file:///tmp/rayflex"
    steps: int = 100
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    log_every: int = 1
    # Experiment trackers fed by the controller: any of "tensorboard", "mlflow", "wandb"
    # (docs/guides/trackers.md; rayflex/telemetry/trackers/).
    loggers: tuple = ()
    mlflow_tracking_uri: Optional[str] = None  # None: MLflow's default (MLFLOW_TRACKING_URI)
    mlflow_experiment: str = "rayflex"
    wandb_project: str = "rayflex"
    wandb_mode: Optional[str] = None  # "online" | "offline" | "disabled"; None: WANDB_MODE
    wandb_dir: Optional[str] = None   # None: a local run directory, else W&B's default

    def __post_init__(self) -> None:
        c = "RunConfig"
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise ConfigError(f"{c}.name", f"invalid run name {self.name!r}",
                              "use letters, digits, '_', '-', '.', starting with a letter or digit")
        check_uri(f"{c}.storage", self.storage)
        _non_negative_int(c, "steps", self.steps, "use an integer >= 1, or 0 to only save the initial weights")
        _positive_int(c, "log_every", self.log_every)
        self._check_loggers()

    def _check_loggers(self) -> None:
        c, known = "RunConfig", ", ".join(repr(n) for n in TRACKERS)
        loggers = self.loggers
        if isinstance(loggers, str):  # "tensorboard,mlflow" (a command-line override)
            loggers = tuple(n.strip() for n in loggers.split(",") if n.strip())
        if not isinstance(loggers, (tuple, list)):
            raise ConfigError(f"{c}.loggers", f"must be a tuple of tracker names, got {self.loggers!r}",
                              f"use e.g. loggers=('tensorboard',); known: {known}")
        object.__setattr__(self, "loggers", tuple(loggers))
        for name in self.loggers:
            if name not in TRACKERS:
                raise ConfigError(f"{c}.loggers", f"unknown tracker {name!r}", f"use any of {known}")
        if len(set(self.loggers)) != len(self.loggers):
            raise ConfigError(f"{c}.loggers", f"a tracker is named twice in {self.loggers!r}",
                              "name each tracker once")
        for name, value in (("mlflow_tracking_uri", self.mlflow_tracking_uri), ("wandb_dir", self.wandb_dir)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ConfigError(f"{c}.{name}", f"must be a non-empty string or None, got {value!r}",
                                  "use e.g. 'file:///tmp/mlruns' / 'http://127.0.0.1:5000' (mlflow), "
                                  "a local folder (wandb_dir), or None for the tracker's default")
        for name, value in (("mlflow_experiment", self.mlflow_experiment), ("wandb_project", self.wandb_project)):
            if not isinstance(value, str) or not value:
                raise ConfigError(f"{c}.{name}", f"must be a non-empty string, got {value!r}",
                                  "use e.g. the team's project name; the default is 'rayflex'")
        if self.wandb_mode not in (None, "online", "offline", "disabled"):
            raise ConfigError(f"{c}.wandb_mode", f"unknown W&B mode {self.wandb_mode!r}",
                              "use 'online', 'offline', 'disabled', or None for W&B's default (WANDB_MODE)")
        missing = [(name, package) for name in self.loggers if (package := missing_package(name))]
        if missing:
            what = ", ".join(f"{name!r} needs the {package!r} package" for name, package in missing)
            raise ConfigError(f"{c}.loggers", f"{what}, which is not installed",
                              f"{EXTRA_HINT} (or pip install {' '.join(p for _, p in missing)}), "
                              f"or drop {', '.join(repr(n) for n, _ in missing)} from loggers")

    @property
    def run_dir(self) -> str:
        return self.storage.rstrip("/") + "/" + self.name


def validate_together(*, scaling: ScalingConfig, parallel: ParallelConfig, data: DataConfig,
                      num_blocks: int) -> None:
    """Checks that need several configs at once; same error style, still before any actor."""
    if parallel.is_auto:
        _validate_auto(scaling, parallel, data, num_blocks)
        return
    # The launch size must run as a whole; the minimum must at least be whole pipelines.
    for size, what in ((scaling.num_workers, "num_workers"), (scaling.min_size, "min_workers")):
        rules.check_world_size(size, parallel.pp, what=what, tp=parallel.tp, dp_shard=parallel.dp_shard)
    rules.split_batch(scaling.num_workers, data.global_batch, micro_batch=data.micro_batch, num_blocks=num_blocks,
                      what="num_workers", **parallel.mesh_request())


def check_float8(precision: PrecisionConfig, scaling: ScalingConfig, parallel: ParallelConfig) -> None:
    """What the driver can know about ``PrecisionConfig(float8=True)`` before any actor:
    CPU workers have no float8 matmul, tensor parallelism would need float8's own TP
    styles, and torchao must be importable (checked without importing it: this module
    stays torch-free). The GPU's compute capability is checked by each worker at setup."""
    import importlib.util

    c = "PrecisionConfig.float8"
    if not scaling.use_gpu:
        raise ConfigError(c, "float8 training needs GPUs of compute capability 8.9 or newer, and this run "
                          "trains on CPUs (ScalingConfig(use_gpu=False))",
                          "set ScalingConfig(use_gpu=True) on such GPUs (H100, H200, L4, ...), or drop float8")
    if parallel.tp != 1:
        raise ConfigError(c, f"float8 with tensor parallelism (tp={parallel.tp}) is not supported",
                          "use tp=1 (FSDP and pipeline stages work with float8), or drop float8")
    if importlib.util.find_spec("torchao") is None:
        raise ConfigError(c, "float8 training uses torchao, which is not installed",
                          "pip install torchao (a release built for your torch), or drop float8")


def _validate_auto(scaling: ScalingConfig, parallel: ParallelConfig, data: DataConfig, num_blocks: int) -> None:
    """pp='auto': the mesh is chosen per world size later; check that one can exist now."""
    if data.micro_batch is not None:
        raise ConfigError("DataConfig.micro_batch",
                          f"micro_batch={data.micro_batch} is chosen by the capacity planner with "
                          "ParallelConfig(pp='auto')", "leave micro_batch=None, or set an integer pp")
    if scaling.use_gpu and parallel.cluster is None:
        # Without a description the planner only knows this host's CPUs: a GPU plan would
        # be sized against host RAM.
        raise ConfigError("ParallelConfig.cluster", "pp='auto' on GPUs needs the devices' memory and FLOP/s",
                          "set cluster='cluster.yaml' (a cluster description, see docs/capacity.md)")
    n, gb = scaling.num_workers, data.global_batch
    if not rules.pp_options(n, gb, num_blocks):
        raise ConfigError("ParallelConfig.pp",
                          f"pp='auto' finds no mesh for num_workers={n}: no pp dividing {n} (and <= "
                          f"{num_blocks} blocks) leaves a data-parallel size dividing global_batch={gb} "
                          f"with at least pp samples per rank",
                          f"use a global_batch that is a multiple of {n} (pp=1 then always works)")


def apply_override(obj: Any, dotted: str, raw: str) -> Any:
    """Return a copy of a (nested) frozen dataclass with ``dotted`` set to ``raw`` parsed.

    ``raw`` is parsed as a Python literal when possible (``4``, ``1e-3``, ``None``,
    ``'gpipe'``), else kept as a string. Unknown fields raise ConfigError listing the known.
    """
    import ast

    head, _, rest = dotted.partition(".")
    if not dataclasses.is_dataclass(obj):
        raise ConfigError(dotted, "cannot set a field on a non-config value", "check the key")
    names = [f.name for f in dataclasses.fields(obj)]
    if head not in names:
        raise ConfigError(f"{type(obj).__name__}.{head}", "no such field",
                          f"use one of {', '.join(names)}")
    current = getattr(obj, head)
    if rest:
        return dataclasses.replace(obj, **{head: apply_override(current, rest, raw)})
    try:
        value = ast.literal_eval(raw)
    except (ValueError, SyntaxError):
        value = raw
    if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    return dataclasses.replace(obj, **{head: value})


@dataclass(kw_only=True, frozen=True)
class TrainSpec:
    """Everything that defines a run; validated as a whole before any actor starts."""

    model: Any  # rayflex.models.ModelSpec (typed loosely to keep this module torch-free)
    data: DataConfig
    run: RunConfig
    scaling: ScalingConfig = field(default_factory=ScalingConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    elastic: ElasticConfig = field(default_factory=ElasticConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def __post_init__(self) -> None:
        for name, cls in (("data", DataConfig), ("run", RunConfig), ("scaling", ScalingConfig),
                          ("parallel", ParallelConfig), ("checkpoint", CheckpointConfig),
                          ("elastic", ElasticConfig), ("precision", PrecisionConfig), ("memory", MemoryConfig)):
            if not isinstance(getattr(self, name), cls):
                raise ConfigError(f"Trainer.{name}", f"expected a {cls.__name__}, got "
                                  f"{type(getattr(self, name)).__name__}", f"pass {cls.__name__}(...)")
        if not hasattr(self.model, "num_blocks") or not hasattr(self.model, "build_block"):
            raise ConfigError("Trainer.model", f"expected a ModelSpec, got {type(self.model).__name__}",
                              "pass rayflex.models.gpt(...) or your own ModelSpec")
        validate_together(scaling=self.scaling, parallel=self.parallel, data=self.data,
                          num_blocks=self.model.num_blocks)
        if not self.parallel.is_auto:
            rules.check_tp(getattr(self.model, "metadata", None), self.parallel.tp,
                           model=getattr(self.model, "name", "the model"))
            if self.memory.activation_checkpointing == "auto":
                raise ConfigError("MemoryConfig.activation_checkpointing",
                                  "'auto' is chosen by the capacity planner, which only runs with "
                                  "ParallelConfig(layout='auto')",
                                  "set layout='auto', or pick 'none', 'full' or 'every_k' yourself")
        if self.precision.float8:
            check_float8(self.precision, self.scaling, self.parallel)
        if self.run.steps == 0 and not (self.checkpoint.resume or self.checkpoint.every_steps):
            raise ConfigError("RunConfig.steps", "steps=0 only saves the initial weights as the step-0 "
                              "checkpoint, and checkpoints are off (resume=False, every_steps=0)",
                              "leave CheckpointConfig.resume=True (the default) or set every_steps")

    @property
    def checkpoint_uri(self) -> str:
        return self.checkpoint.uri or f"{self.run.run_dir}/checkpoints"

    def with_overrides(self, overrides: dict[str, str]) -> "TrainSpec":
        """Apply ``section.field=value`` overrides (``parallel.pp=2``, ``parallel.pp=auto``);
        re-validates."""
        spec = self
        for key, raw in overrides.items():
            section, _, rest = key.partition(".")
            if section == "model" or not rest:
                raise ConfigError(key, "cannot override this key from the command line",
                                  "use section.field, e.g. run.steps=20 or parallel.pp=2")
            spec = apply_override(spec, key, raw)
        return dataclasses.replace(spec)  # re-runs __post_init__ checks
