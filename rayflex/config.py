"""User-facing configuration: keyword-only dataclasses validated on construction.

What one field accepts is declared with the field (``setting(default, rule)``,
``rayflex.field_rules``) and checked by ``check_fields`` in ``__post_init__``; what
needs several fields is checked after it there (or in :func:`validate_together`, for
checks that span several configs). A bad value fails on the driver before any actor
exists, and each error names the field and says how to fix it.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Union

from rayflex.constants import DEFAULT_SHUFFLE_WINDOW
from rayflex.errors import ConfigError
from rayflex.field_rules import (check_fields, check_value, custom, flag, mapping, number, one_of, setting, text,
                                 whole)
from rayflex.mesh import rules
from rayflex.schemes import SUPPORTED_SCHEMES, check_backend

SCHEDULES = ("gpipe", "1f1b", "interleaved")
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


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


PRICE_KEYS = ("spot", "on-demand", "*")
PRICE_LABEL = "rayflex.io/price-per-hour"  # a node's own price (cluster.yaml), over the table
MARKET_LABEL = "ray.io/market-type"


def node_price(labels: Mapping[str, str], price_per_hour: Mapping[str, float]) -> Optional[float]:
    """Dollars per hour of a node with ``labels``: its ``PRICE_LABEL``, else the table's price
    for its market, else the table's ``"*"``; None where nothing prices it. A label that is
    not a number is ignored (the table, if any, prices the node)."""
    label = labels.get(PRICE_LABEL)
    if label is not None:
        try:
            price = float(label)
            if price >= 0:
                return price
        except ValueError:
            pass
    market = labels.get(MARKET_LABEL)
    if market in price_per_hour:
        return float(price_per_hour[market])
    return float(price_per_hour["*"]) if "*" in price_per_hour else None


def price_table_problem(table) -> Optional[str]:
    """What is wrong with a ``price_per_hour`` table (None: nothing)."""
    if not isinstance(table, dict):
        return f"must be a dict of market -> dollars per node-hour, got {table!r}"
    for key, price in table.items():
        if key not in PRICE_KEYS:
            return f"unknown market {key!r} (known: {', '.join(PRICE_KEYS)})"
        if isinstance(price, bool) or not isinstance(price, (int, float)) or not 0 <= price < float("inf"):
            return f"the price of {key!r} must be a number of dollars >= 0, got {price!r}"
    return None


@dataclass(kw_only=True, frozen=True)
class ScalingConfig:
    """How many workers and what each one needs.

    ``num_workers`` is the size the run asks for; ``min_workers``/``max_workers`` bound
    elastic restarts (both default to ``num_workers``: a fixed-size run).
    """

    num_workers: int = setting(4, whole(1))
    min_workers: Optional[int] = setting(None, whole(1, optional=True))
    max_workers: Optional[int] = setting(None, whole(1, optional=True))
    cpus_per_worker: float = setting(1.0, number(gt=0, fix="use e.g. 1 (a worker needs CPU time even on a GPU node)"))
    use_gpu: bool = setting(False, flag("use True to give each worker a GPU, False to train on CPUs"))
    resources_per_worker: dict = setting(rule=mapping("resource -> amount", "use e.g. {'accelerator_type:H100': 0.001}"),
                                         default_factory=dict)
    # Torch intra-op threads per worker; 1 avoids oversubscribing small machines.
    torch_threads: int = setting(1, whole(1))
    # Node labels every worker's node must carry, e.g. {"ray.io/market-type": "spot"}.
    node_labels: dict = setting(rule=mapping("label -> value", "use e.g. {'ray.io/market-type': 'spot'}"),
                                default_factory=dict)
    # What a node costs per hour, by its market (``ray.io/market-type``: "spot", "on-demand";
    # "*": any node), e.g. {"spot": 2.1, "on-demand": 6.5}. A node's own label
    # ``rayflex.io/price-per-hour`` (cluster.yaml) wins. Runs report what they cost
    # (rayflex.telemetry.cost); no prices, no cost.
    price_per_hour: dict = setting(rule=custom(
        price_table_problem, "use e.g. {'spot': 2.1, 'on-demand': 6.5} (dollars per node-hour; "
        "'*' prices any node)"), default_factory=dict)
    # Where ranks go: "planned" (the topology-aware planner), or, to measure what it buys,
    # "node_order" (Ray Train's: ranks fill nodes in node order, by address) or
    # "shuffled:SEED" (tp groups whole, otherwise a seeded random order).
    placement: str = setting("planned", custom(
        lambda v: None if v in ("planned", "node_order") or (str(v).partition(":")[0] == "shuffled"
                                                              and str(v).partition(":")[2].isdigit())
        else f"unknown placement {v!r}",
        "use 'planned' (the default), 'node_order' or 'shuffled:SEED' (e.g. 'shuffled:7')"))

    def __post_init__(self) -> None:
        c = "ScalingConfig"
        check_fields(self)
        lo, hi = self.min_size, self.max_size
        if lo > hi:
            raise ConfigError(f"{c}.min_workers", f"min_workers={lo} is greater than max_workers={hi}",
                              "set min_workers <= max_workers")
        if not lo <= self.num_workers <= hi:
            raise ConfigError(f"{c}.num_workers",
                              f"num_workers={self.num_workers} is outside [min_workers={lo}, max_workers={hi}]",
                              "pick num_workers between min_workers and max_workers")

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


_LAYOUT = one_of(("auto",), "value", "use 'auto' to let the capacity planner choose, or None and set pp/tp/dp_shard",
                 optional=True)


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
    schedule: str = setting("1f1b", one_of(SCHEDULES, "schedule"))
    microbatches: Optional[int] = setting(None, whole(1, optional=True))
    stages_per_rank: int = setting(1, whole(1))
    # How blocks are balanced over stages: "params" (parameter count) or "uniform".
    balance: str = setting("params", one_of(("params", "uniform"), "balance", "use 'params' or 'uniform'"))
    cluster: Optional[str] = None
    tp: int = setting(1, whole(1, "use an integer >= 1 (1: no tensor parallelism)"))
    dp_shard: Optional[int] = setting(None, whole(1, "use an integer >= 1, or None to shard over every dp rank",
                                                  optional=True))
    # Checked before the rest (it rewrites pp), so declared with its rule apart.
    layout: Optional[str] = None

    def __post_init__(self) -> None:
        c = "ParallelConfig"
        check_value(f"{c}.layout", self.layout, _LAYOUT)
        if self.layout is not None:
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
            check_value(f"{c}.pp", self.pp, whole(1, "use an integer >= 1, or layout='auto'"))
        check_fields(self)
        if self.cluster is not None:
            if not isinstance(self.cluster, (str, os.PathLike)) or not str(self.cluster):
                raise ConfigError(f"{c}.cluster", f"must be a path to a cluster-description YAML, got "
                                  f"{self.cluster!r}", "see docs/capacity.md, or use None for the live cluster")
            # Absolute now: the controller reads it later, possibly from another directory.
            object.__setattr__(self, "cluster", os.path.abspath(os.fspath(self.cluster)))
        if self.schedule == "interleaved" and self.stages_per_rank < 2:
            raise ConfigError(f"{c}.stages_per_rank",
                              "the interleaved schedule needs at least 2 stages per rank",
                              "set stages_per_rank=2 or use schedule='1f1b'")
        if self.schedule != "interleaved" and self.stages_per_rank != 1:
            raise ConfigError(f"{c}.stages_per_rank",
                              f"stages_per_rank={self.stages_per_rank} only works with schedule='interleaved'",
                              "set schedule='interleaved' or stages_per_rank=1")
        if self.microbatches is not None:
            rules.check_microbatches(self.pp, self.microbatches, self.schedule)

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
    seq_len: int = setting(64, whole(1))
    global_batch: int = setting(16, whole(1))
    micro_batch: Optional[int] = setting(None, whole(1, optional=True))
    seed: int = setting(0, whole(0))
    # Write which dataset rows each step consumed to ``samples.jsonl`` (an audit log that
    # proves exact data continuation across restarts; costs one line per step).
    log_samples: bool = False
    # Row groups shuffled together (rayflex.data.sampler): a step's rows come from about
    # twice this many row groups, which each rank caches. Larger mixes more, costs memory.
    shuffle_window: int = setting(DEFAULT_SHUFFLE_WINDOW, whole(1))
    # Steps whose row groups a background thread loads ahead of training (0: off).
    prefetch_steps: int = setting(2, whole(0))
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
        check_fields(self)


UPLOAD_MODES = ("auto", "process", "thread")
WHEN_BUSY = ("defer", "wait")  # what each does: rayflex.checkpoint.save_timing


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """Asynchronous sharded checkpoints. ``every_steps=0`` disables periodic saves;
    ``every_steps="auto"`` picks the interval from this run's measured save cost and
    failure rate (Young/Daly, ``rayflex.faults.checkpoint_interval``), re-evaluated as the
    run goes; ``mtbf_prior_s`` is the mean time between failures it assumes before the run
    has seen its own (one failure per hour: a few hundred spot nodes)."""

    every_steps: int | str = setting(0, custom(
        lambda v: None if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 0)
        else f"must be an integer >= 0, got {v!r}", 'use 0 (off), a step interval, or "auto"'))
    mtbf_prior_s: float = setting(3600.0, number(
        gt=0, unit="seconds", fix="use the mean time between failures you expect of the cluster, e.g. 3600"))
    keep: int = setting(3, whole(1))
    async_save: bool = setting(True, flag("use True to write checkpoints in the background, False to wait for them"))
    # Where checkpoints go; None means ``{RunConfig.storage}/{name}/checkpoints``.
    uri: Optional[str] = None
    # Load the latest committed checkpoint of this run on start (resume).
    resume: bool = setting(True, flag("use True to resume from the newest committed checkpoint, False to start over"))
    # Where an async save's bytes are serialised and written: "process" (an uploader
    # process per rank reading shared-memory staging: shares no GIL with training; needs
    # /dev/shm room for one copy of the rank's state), "thread" (a background thread of
    # the training process), "auto" (thread until the process path is measured on GPU).
    upload: str = setting("auto", one_of(UPLOAD_MODES, "upload mode"))
    # Files each rank writes in parallel per save (more parallel PUTs to an object store).
    upload_threads: int = setting(1, whole(1))
    # Keep every saved shard in host memory too: on its own node and on this many other
    # nodes (another rack when the run has one). A restart then reads what it can from
    # memory — a dead process from its node's copy, a lost node from a replica — and the
    # rest from storage. 0: off. Costs (1 + memory_replicas) x the checkpoint's size of
    # RAM across the cluster, twice while a save is in flight (docs/guides/checkpoints.md, "Memory replicas").
    memory_replicas: int = setting(0, whole(0, "use 0 (off) or the number of other nodes to copy each shard to, e.g. 1"))
    # The most host memory the copies may take on one node, in GB (oldest steps go first;
    # a file beyond it is not kept). None: a quarter of the node's RAM.
    memory_budget_gb: Optional[float] = setting(None, number(
        gt=0, unit="GB", fix="use e.g. 64 (per node), or None for a quarter of each node's RAM", optional=True))
    # A save that falls due while the previous one is still being written: "defer" takes it
    # at the first step boundary after that upload ended (training never waits for an
    # upload; a checkpoint_deferred event says so), "wait" takes it on time and training
    # waits for the previous upload first. Emergency, stop and final saves always wait.
    when_busy: str = setting("defer", one_of(WHEN_BUSY, "policy", f"use one of {', '.join(WHEN_BUSY)} "
                                                                     "(\"defer\": training never waits for an upload)"))

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
        check_fields(self)
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

    max_failures: int = setting(3, whole(0))
    max_preemptions: int = setting(10, whole(0))
    # Seconds to wait for enough resources before giving up on a restart.
    resource_wait_s: float = setting(120.0, number(ge=0, unit="seconds", fix="use a number of seconds, e.g. 120"))
    # Spot notices: Ray's drain state (what the autoscaler sets for spot terminations),
    # the cloud metadata endpoint polled on each worker node (None: off; "{node_id}" and
    # "{node_ip}" are substituted), and a notice file an operator may write.
    watch_ray_drain: bool = setting(True, flag("use True to act on Ray's drain notices, False to ignore them"))
    metadata_url: Optional[str] = setting(None, custom(
        lambda v: None if str(v).startswith(("http://", "https://")) else f"not an http(s) URL: {v!r}",
        "use e.g. http://169.254.169.254/latest/meta-data/spot/instance-action", optional=True))
    metadata_kind: str = setting("aws", one_of(("aws", "gcp"), "metadata kind",
                                               "use 'aws' (spot/instance-action) or 'gcp' (instance/preempted)"))
    notice_file: Optional[str] = setting(None, text("use a path an operator writes a notice to, or None",
                                                    optional=True))
    # A node a straggler was named on, and still slow STRAGGLER_CONFIRM_S later, is left out
    # (a restart without it) when the time it would cost the rest of the run exceeds the
    # restart's (docs/guides/failures.md); False: stragglers are only named.
    evict_stragglers: bool = setting(True, flag("use True to restart without a slow node when that pays, "
                                                "False to only name stragglers"))
    # A node the run is about to grow onto is health-checked first (its GPUs there and
    # computing correctly, at >= health_min_speed of the run's own nodes' speed); one that
    # fails, or a node evicted as a straggler, is held out and checked again until it passes
    # (docs/guides/failures.md). False: nodes are used unchecked and an evicted one never again.
    health_checks: bool = setting(True, flag("use True to check nodes before growing onto them, False to skip"))
    health_min_speed: float = setting(0.5, number(gt=0, le=1, fix="use a fraction of the run's nodes' speed, "
                                                              "e.g. 0.5"))
    # Safety margin on top of (a step + an estimated checkpoint) before a notice's deadline.
    emergency_margin_s: float = setting(2.0, number(ge=0, unit="seconds", fix="use a number of seconds, e.g. 2"))
    # When a restart needs worker processes that are not up yet (a dead one's replacement,
    # a preempted node's ranks moving elsewhere): True restarts at once with the workers
    # that are up (if that is a valid size >= min_workers) while the missing ones start,
    # then grows at a step boundary once they are warm — training never waits for process
    # start, at the cost of one more (checkpointed) restart. False waits for them.
    restart_while_warming: bool = setting(True, flag(
        "use True (restart now, grow when warm) or False (wait for the new workers)"))
    # After a failure without notice, resume from the survivors' live state of their last
    # finished step when every shard of it survived (a mesh with dp_replicate >= 2: HSDP):
    # no step is lost and nothing is read from storage. Otherwise, or False: the newest
    # checkpoint (memory replicas, then storage). A recovery_chosen event says which and why.
    live_recovery: bool = setting(True, flag("use True (resume from the survivors' memory when every shard "
                                             "survived) or False (always the newest checkpoint)"))
    # Failures expected per hour (a spot cluster's preemptions without notice, node and
    # process deaths). Set, layout="auto" prices them: a mesh whose shards have replicas
    # (dp_replicate >= 2) recovers from live peers, one without trains the steps since its
    # last checkpoint again, and the faster after failures wins (`rayflex plan` explains).
    # None: meshes rank by step time alone.
    failures_per_hour: Optional[float] = setting(None, number(
        ge=0, fix="use e.g. 2 for a spot cluster, or None to rank meshes by step time alone", optional=True))
    # Entries of torch's collective flight recorder per worker process (0 = off): on a
    # hang the controller reads every rank's and names the deadlock (a hang_diagnosed
    # event; docs/guides/hangs.md).
    flight_recorder: int = setting(2000, whole(0))

    def __post_init__(self) -> None:
        check_fields(self)


OPTIMIZER_IMPLEMENTATIONS = ("fused", "foreach", "for-loop")


@dataclass(kw_only=True, frozen=True)
class OptimizerConfig:
    """AdamW (or plain SGD: ``algorithm="sgd"``) with linear warm-up and cosine decay to
    ``min_lr_ratio * lr``.

    ``implementation`` picks torch's AdamW kernel, as torchtitan's optimizer config does:
    ``"fused"`` (the default: one kernel over all parameters, on CPU as on GPU), ``"foreach"``
    (a few list ops) or ``"for-loop"`` (torch's per-parameter loop, its default on CPU). The
    update is the same arithmetic; on FSDP-sharded (DTensor) parameters the loop pays the
    sharding dispatch per parameter and per op: on ``benchmarks/compare.py``'s model it took
    16 ms of a rank's ~100 ms CPU step, fused 3.5 ms."""

    lr: float = setting(3e-3, number(gt=0, fix="use e.g. 3e-4"))
    weight_decay: float = setting(0.0, number(ge=0, fix="use e.g. 0.1"))
    betas: tuple = setting((0.9, 0.95), custom(
        lambda v: None if isinstance(v, (tuple, list)) and len(v) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in v)
        else f"must be two numbers in [0, 1), got {v!r}", "use e.g. (0.9, 0.95)"))
    warmup_steps: int = setting(0, whole(0))
    min_lr_ratio: float = setting(0.1, number(ge=0, le=1, fix="use e.g. 0.1"))
    grad_clip: Optional[float] = setting(1.0, number(gt=0, fix="use e.g. 1.0, or None to disable clipping",
                                                     optional=True))
    implementation: str = setting("fused", one_of(OPTIMIZER_IMPLEMENTATIONS, "AdamW implementation"))
    # "sgd": plain SGD (no momentum; betas unused), e.g. as DiLoCo's inner optimizer in a check.
    algorithm: str = setting("adamw", one_of(("adamw", "sgd"), "optimizer algorithm"))

    def __post_init__(self) -> None:
        check_fields(self)

    def build(self, params):
        """torch's AdamW over ``params`` with these hyper-parameters and kernel; the learning
        rate is set per step (:meth:`lr_of_step`)."""
        import torch

        kernel = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
        if self.algorithm == "sgd":
            return torch.optim.SGD(params, lr=self.lr, weight_decay=self.weight_decay,
                                   foreach=self.implementation != "for-loop")
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
_DTYPE = one_of(PARAM_DTYPES, "dtype", f"use one of {', '.join(PARAM_DTYPES)} (bf16 compute usually pairs with "
                                       "reduce_dtype='fp32')")
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

    param_dtype: str = setting("fp32", _DTYPE)
    reduce_dtype: str = setting("fp32", _DTYPE)
    float8: bool = setting(False, flag("use True to train the linear layers in float8, False for param_dtype alone"))

    def __post_init__(self) -> None:
        check_fields(self)

    @property
    def mixed(self) -> bool:
        """Whether anything runs below fp32 (False: the fp32 reference behaviour)."""
        return (self.param_dtype, self.reduce_dtype) != ("fp32", "fp32")


REPLICATE_MODES = ("allreduce", "int8", "diloco", "auto")
PSEUDO_GRAD_WIRES = ("fp32", "bf16", "int8")


@dataclass(kw_only=True, frozen=True)
class CommConfig:
    """How the replicas of an HSDP mesh (``ParallelConfig.dp_shard``: FSDP shards inside a
    replica, the replicas sit across the slow tier) stay in step. docs/guides/slow-links.md
    says which to pick.

    ``replicate``:
    * ``"allreduce"``: every step FSDP2 all-reduces the gradient shards over the replicas in
      ``PrecisionConfig.reduce_dtype`` (fp32 or bf16): exact data parallelism.
    * ``"int8"``: every step the gradient shards cross in int8 (``block`` values share one
      scale) with error feedback: what a step's rounding loses is added to the next step's
      gradient, so nothing is dropped. A quarter of fp32's bytes.
    * ``"diloco"``: the replicas train apart for ``inner_steps`` steps, then average how far
      each moved (the pseudo-gradient, sent as ``pseudo_grad``) and take an outer Nesterov
      step (``outer_lr``, ``outer_momentum``); ``fragments`` > 1 synchronises the model a
      fragment at a time at staggered steps (streaming DiLoCo); ``overlap_steps`` > 0 sends a
      fragment's pseudo-gradient that many steps before its outer step, so its all-reduce runs
      behind those steps' compute (the progress made meanwhile is kept on top of the new
      anchor). ``inner_steps`` times fewer bytes than ``"allreduce"``. Each replica keeps its
      own inner optimizer state; a save does not synchronise: each replica saves its own.
    * ``"auto"`` (with ``ParallelConfig(layout="auto")``): the capacity planner picks, for the
      launch mesh on the run's cluster, the least approximate of the above (a bf16 all-reduce,
      int8, DiLoCo with the shortest round) whose modelled replica traffic is at most a fifth
      of the step's compute, and the run keeps it at every world size (a restart never
      switches how replicas meet). The ``plan_chosen`` event says which, and why.
    """

    replicate: str = setting("allreduce", one_of(REPLICATE_MODES, "replicate mode"))
    block: int = setting(256, whole(1, "use e.g. 256 values per int8 scale"))
    inner_steps: int = setting(32, whole(1, "use e.g. 32 (DiLoCo's H; 1 synchronises every step)"))
    outer_lr: float = setting(0.7, number(gt=0, fix="use e.g. 0.7 (1.0 with outer_momentum=0 averages the replicas)"))
    outer_momentum: float = setting(0.9, number(ge=0, le=0.999, fix="use e.g. 0.9, or 0 for plain SGD"))
    fragments: int = setting(1, whole(1, "use 1, or e.g. 4 for streaming DiLoCo"))
    pseudo_grad: str = setting("fp32", one_of(PSEUDO_GRAD_WIRES, "pseudo-gradient wire dtype"))
    overlap_steps: int = setting(0, whole(0, "use 0 (each fragment synchronised at its step), or e.g. 1-4"))

    def __post_init__(self) -> None:
        check_fields(self)
        c = "CommConfig"
        if self.replicate != "diloco":
            for name, default in (("inner_steps", 32), ("outer_lr", 0.7), ("outer_momentum", 0.9), ("fragments", 1),
                                  ("pseudo_grad", "fp32"), ("overlap_steps", 0)):
                if getattr(self, name) != default:
                    raise ConfigError(f"{c}.{name}", f"{name} is a DiLoCo setting and replicate={self.replicate!r}",
                                      f"set replicate='diloco', or leave {name} at its default ({default!r})")
        elif self.fragments > self.inner_steps:
            raise ConfigError(f"{c}.fragments", f"{self.fragments} fragments cannot each have their own step "
                              f"among inner_steps={self.inner_steps}",
                              f"use at most {self.inner_steps} fragments, or more inner_steps")
        elif self.overlap_steps and self.overlap_steps >= self.inner_steps // self.fragments:
            raise ConfigError(f"{c}.overlap_steps", f"overlap_steps={self.overlap_steps} would send a fragment "
                              f"before the one before it has taken its outer step ({self.fragments} fragment(s) "
                              f"in inner_steps={self.inner_steps}: one every {self.inner_steps // self.fragments} "
                              "steps)", f"use at most {self.inner_steps // self.fragments - 1}, or more inner_steps")
        elif self.overlap_steps and self.pseudo_grad == "int8":
            raise ConfigError(f"{c}.overlap_steps", "an int8 pseudo-gradient is re-quantized between its two "
                              "collectives and cannot cross in the background",
                              "use pseudo_grad='fp32' or 'bf16' with overlap_steps, or overlap_steps=0")
        if self.block % 16 or self.block > 65536:
            raise ConfigError(f"{c}.block", f"block={self.block} must be a multiple of 16 and at most 65536",
                              "use e.g. 256")

    @property
    def custom(self) -> bool:
        """Whether rayflex, not FSDP2, crosses the replicate dimension."""
        return self.replicate != "allreduce"


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

    activation_checkpointing: str = setting("none", one_of(ACTIVATION_CHECKPOINTING, "mode"))
    ac_every: int = setting(2, whole(1, "use an integer >= 1 (1 checkpoints every block, like 'full')"))
    compile: bool = setting(False, flag("use True to torch.compile each block, False to run eagerly"))
    compile_backend: str = setting("inductor", text("use 'inductor' (GPU) or 'aot_eager' (no compiler)",
                                                    what="a torch.compile backend name"))

    def __post_init__(self) -> None:
        check_fields(self)

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
_TRACKER_PLACE_FIX = ("use e.g. 'file:///tmp/mlruns' / 'http://127.0.0.1:5000' (mlflow), a local folder "
                      "(wandb_dir), or None for the tracker's default")
_PROJECT_FIX = "use e.g. the team's project name; the default is 'rayflex'"


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

    name: str = setting(rule=custom(
        lambda v: None if isinstance(v, str) and _NAME_RE.match(v) else f"invalid run name {v!r}",
        "use letters, digits, '_', '-', '.', starting with a letter or digit"))
    storage: str = "file:///tmp/rayflex"
    steps: int = setting(100, whole(0, "use an integer >= 1, or 0 to only save the initial weights"))
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    log_every: int = setting(1, whole(1))
    # Experiment trackers fed by the controller: any of "tensorboard", "mlflow", "wandb"
    # (docs/guides/trackers.md; rayflex/telemetry/trackers/).
    loggers: tuple = ()
    # None: MLflow's default (MLFLOW_TRACKING_URI)
    mlflow_tracking_uri: Optional[str] = setting(None, text(_TRACKER_PLACE_FIX, optional=True))
    mlflow_experiment: str = setting("rayflex", text(_PROJECT_FIX))
    wandb_project: str = setting("rayflex", text(_PROJECT_FIX))
    # "online" | "offline" | "disabled"; None: WANDB_MODE
    wandb_mode: Optional[str] = setting(None, one_of(
        ("online", "offline", "disabled"), "W&B mode",
        "use 'online', 'offline', 'disabled', or None for W&B's default (WANDB_MODE)", optional=True))
    # None: a local run directory, else W&B's default
    wandb_dir: Optional[str] = setting(None, text(_TRACKER_PLACE_FIX, optional=True))

    def __post_init__(self) -> None:
        check_fields(self)
        check_uri("RunConfig.storage", self.storage)
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
    return apply_overrides(obj, {dotted: raw})


def apply_overrides(obj: Any, items: Mapping[str, str]) -> Any:
    """:func:`apply_override` for several keys at once: each config object is rebuilt once
    with all of its new fields, so fields checked together (``comm.replicate=diloco`` and
    ``comm.inner_steps=8``) may come in any order."""
    import ast

    if not dataclasses.is_dataclass(obj):
        raise ConfigError(", ".join(items), "cannot set a field on a non-config value", "check the key")
    names = [f.name for f in dataclasses.fields(obj)]
    leaves: dict[str, Any] = {}
    nested: dict[str, dict[str, str]] = {}
    for dotted, raw in items.items():
        head, _, rest = dotted.partition(".")
        if head not in names:
            raise ConfigError(f"{type(obj).__name__}.{head}", "no such field", f"use one of {', '.join(names)}")
        if rest:
            nested.setdefault(head, {})[rest] = raw
            continue
        current = getattr(obj, head)
        try:
            value = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            value = raw
        if isinstance(current, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        leaves[head] = value
    changes = {head: apply_overrides(getattr(obj, head), sub) for head, sub in nested.items()}
    return dataclasses.replace(obj, **leaves, **changes)


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
    comm: CommConfig = field(default_factory=CommConfig)

    def __post_init__(self) -> None:
        for name, cls in (("data", DataConfig), ("run", RunConfig), ("scaling", ScalingConfig),
                          ("parallel", ParallelConfig), ("checkpoint", CheckpointConfig),
                          ("elastic", ElasticConfig), ("precision", PrecisionConfig), ("memory", MemoryConfig),
                          ("comm", CommConfig)):
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
        if self.comm.replicate == "auto" and not self.parallel.is_auto:
            raise ConfigError("CommConfig.replicate", "'auto' is chosen by the capacity planner, which only runs with "
                              "ParallelConfig(layout='auto')", "set layout='auto', or pick 'allreduce', 'int8' or "
                              "'diloco' yourself (docs/guides/slow-links.md says which)")
        if self.comm.custom and self.parallel.dp_shard is None and not self.parallel.is_auto:
            raise ConfigError("CommConfig.replicate", f"replicate={self.comm.replicate!r} changes how the replicas "
                              "of an HSDP mesh meet, and ParallelConfig.dp_shard is None (FSDP over every dp rank: "
                              "no replicas)", "set ParallelConfig(dp_shard=<ranks per fast-tier group>), e.g. the "
                              "GPUs of a node, or use replicate='allreduce'")
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
        for key in overrides:
            section, _, rest = key.partition(".")
            if section == "model" or not rest:
                raise ConfigError(key, "cannot override this key from the command line",
                                  "use section.field, e.g. run.steps=20 or parallel.pp=2")
        return apply_overrides(self, overrides)  # every section rebuilt once, its checks re-run
