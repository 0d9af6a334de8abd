"""``rayflex plan``: will it fit, and which pp x dp x tp is fastest, before anything launches.

    rayflex plan examples/gpt_small.py                      # the trainer's model, this host
    rayflex plan --model 70b --cluster examples/clusters/h100_8x8.yaml --explain
    rayflex plan --model 70b --cluster examples/clusters/h100_8x8.yaml --seq-len 4096 --ac auto
    rayflex plan SPEC --cluster cluster.yaml --json

Every run prints the table, the choice (pp, tp, dp and, with HSDP, the shard groups) and a
short *why*: the fastest mesh of every tensor-parallel degree and shard-group size with its
memory per rank and modeled step time, and the link tier each kind of group was priced at.
``--explain`` adds the full reasoning (memory breakdown, step-time terms, what does not
fit) and the placement planner's rank -> node plan.

SPEC is a Python file or ``module:attr`` defining ``trainer``; its model, seq_len, global
batch and worker count are planned for. ``--model`` plans a described model instead
(``7b``, ``70b`` or a YAML file, see docs/capacity.md). Without ``--cluster`` the cluster is
this host's CPUs, one slot per worker, or a ``pp="auto"`` SPEC's own
``ParallelConfig(cluster=...)``: the choice printed is then the mesh the launcher runs at
that world size.

``--ac`` sets the activation checkpointing planned for (``none``, ``full``, ``every_k`` with
``--ac-every``, or ``auto``: the planner tries each on every mesh and keeps the fastest that
fits, and the why says what it chose and what the others cost). Default: a SPEC's own
``MemoryConfig``, ``none`` for ``--model`` (or what a YAML description's blocks say).
"""

from __future__ import annotations

import json
import sys
from typing import Optional

from rayflex.errors import ConfigError


def add_subcommand(subparsers) -> None:
    p = subparsers.add_parser("plan", help="memory per rank and the fastest pp x dp x tp mesh that fits",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("spec", nargs="?", help="a .py file or module:attr defining `trainer`")
    p.add_argument("--model", help="a described model instead of SPEC: 7b, 70b or FILE.yaml")
    p.add_argument("--cluster", help="cluster description YAML (devices and topology)")
    p.add_argument("--world-size", type=int, help="ranks to plan for (default: SPEC's workers, else all slots)")
    p.add_argument("--global-batch", type=int, help="samples per step (default: SPEC's, else 512)")
    p.add_argument("--seq-len", type=int, help="tokens per sample (default: SPEC's or the description's)")
    p.add_argument("--precision", choices=("fp32", "bf16", "bf16-master"),
                   help="default: fp32 for SPEC (what workers run today), bf16-master for --model presets")
    p.add_argument("--ac", choices=("none", "full", "every_k", "auto"),
                   help="activation checkpointing to plan for; auto: the planner picks the fastest that fits "
                   "(default: SPEC's MemoryConfig, none for --model)")
    p.add_argument("--ac-every", type=int, help="every_k (and auto's every_k option): recompute every k-th block "
                   "(default: SPEC's ac_every, else 2)")
    p.add_argument("--all", action="store_true", help="list every candidate, not the best per mesh shape")
    p.add_argument("--tp", type=int, action="append", help="only this tensor-parallel degree (repeatable); "
                   "default: every divisor of the node size the model can take")
    p.add_argument("--failures-per-hour", type=float,
                   help="price failures: rank meshes by their step time stretched by what this many failures an "
                        "hour take from training (a mesh with replicas, dp_replicate >= 2, recovers from live peers; "
                        "one without trains the steps since its last checkpoint again). Default: SPEC's "
                        "ElasticConfig.failures_per_hour, else not priced")
    p.add_argument("--checkpoint-every", type=int, help="with --failures-per-hour: steps between checkpoints "
                   "(default: SPEC's CheckpointConfig.every_steps)")
    p.add_argument("--checkpoint-interval-s", type=float, help="with --failures-per-hour: seconds between "
                   "checkpoints instead of --checkpoint-every")
    p.add_argument("--restart-s", type=float, default=30.0, help="with --failures-per-hour: seconds one restart "
                   "takes (default 30)")
    p.add_argument("--explain", action="store_true", help="explain the choice and show its placement")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--topology", help="placement only: SPEC's mesh on a described topology "
                   "(YAML/JSON of nodes, slots and labels, e.g. examples/topologies/*.yaml); no cluster needed")
    p.add_argument("--live", action="store_true", help="placement only: SPEC's mesh on the connected Ray cluster")
    p.set_defaults(func=cmd_plan)


def cmd_placement(args) -> int:
    """Where SPEC's ranks would go and why (the controller's planner, as a dry run)."""
    from rayflex.cli.run import load_trainer

    if not args.spec:
        raise ConfigError("rayflex plan --topology/--live", "needs SPEC", "e.g. `rayflex plan "
                          "examples/gpt_small.py --topology examples/topologies/two_racks_64gpu.yaml`")
    trainer = load_trainer(args.spec)
    plan = trainer.plan(args.topology if args.topology else None, world_size=args.world_size)
    if args.json:
        json.dump(plan.to_dict(), sys.stdout, indent=2, default=float)
        print()
    else:
        print(plan.format(ranks=True))
    return 0


def _memory(args, memory=None):
    """The MemoryConfig to plan for: ``memory`` (a SPEC's) with ``--ac`` / ``--ac-every``
    applied; None when neither is given and there is no SPEC."""
    import dataclasses

    from rayflex.config import MemoryConfig

    if args.ac is None and args.ac_every is None:
        return memory
    memory = memory or MemoryConfig()
    over = {}
    if args.ac is not None:
        over["activation_checkpointing"] = args.ac
    if args.ac_every is not None:
        over["ac_every"] = args.ac_every
    try:
        return dataclasses.replace(memory, **over)
    except ConfigError as e:  # e.g. --ac-every 0
        raise ConfigError("--ac-every", e.problem, "give an integer >= 1") from None


def _checkpointing(model, memory):
    """``model`` with ``memory``'s recomputed blocks, and the AC options to search (None
    unless ``memory`` says "auto")."""
    from rayflex.planning.capacity.search import ac_options

    if memory is None:
        return model, None
    if memory.activation_checkpointing == "auto":
        return model, ac_options(memory)
    return model.with_checkpointing(memory), None


def _inputs(args):
    from rayflex.planning.capacity.memory import ModelDescription, Precision, preset
    from rayflex.planning.capacity.search import ClusterDescription, describe_model

    precision = Precision.named(args.precision) if args.precision else None
    if bool(args.spec) == bool(args.model):
        raise ConfigError("rayflex plan", "give either SPEC or --model", "e.g. `rayflex plan --model 70b "
                          "--cluster cluster.yaml` or `rayflex plan examples/gpt_small.py`")
    if args.spec:
        from rayflex.cli.run import load_trainer

        spec = load_trainer(args.spec).spec
        seq_len = args.seq_len or spec.data.seq_len
        model = (describe_model(spec.model, seq_len, precision) if precision else
                 describe_model(spec.model, seq_len).for_run(spec.precision, comm_config=spec.comm))
        model, ac = _checkpointing(model, _memory(args, spec.memory))
        global_batch = args.global_batch or spec.data.global_batch
        world = args.world_size or spec.scaling.num_workers
        # an auto spec's own description: the table then shows what pp="auto" will pick
        path = args.cluster or (spec.parallel.cluster if spec.parallel.is_auto else None)
        cluster = ClusterDescription.from_file(path) if path else ClusterDescription.local_cpu(world)
        return model, cluster, global_batch, world, ac, _failure_cost(args, spec)
    if args.model.lower().endswith((".yaml", ".yml", ".json")):
        import yaml

        with open(args.model) as f:
            model = ModelDescription.from_dict(yaml.safe_load(f))
        if precision:
            model = model.with_precision(precision)
    else:
        model = preset(args.model, precision)
    if args.seq_len:
        model = model.with_seq_len(args.seq_len)
    model, ac = _checkpointing(model, _memory(args))
    if not args.cluster:
        raise ConfigError("--cluster", "a described model needs a described cluster",
                          "pass --cluster cluster.yaml (see docs/capacity.md)")
    cluster = ClusterDescription.from_file(args.cluster)
    return model, cluster, args.global_batch or 512, args.world_size or None, ac, _failure_cost(args)


def _failure_cost(args, spec=None):
    """What failures cost each mesh (``planning.capacity.failures``), or None: not priced."""
    from rayflex.planning.capacity.failures import FailureCost, for_run

    rate = args.failures_per_hour if args.failures_per_hour is not None else (
        spec.elastic.failures_per_hour if spec is not None else None)
    if rate is None:
        if args.checkpoint_every or args.checkpoint_interval_s:
            raise ConfigError("--checkpoint-every", "the checkpoint interval only prices failures",
                              "add --failures-per-hour N (e.g. 2 for a spot cluster)")
        return None
    if args.checkpoint_interval_s is not None:
        return FailureCost(rate, restart_s=args.restart_s, rollback_s=args.checkpoint_interval_s / 2)
    every = args.checkpoint_every or (spec.checkpoint.every_steps if spec is not None else 0)
    return for_run(rate, every, restart_s=args.restart_s)


def cmd_plan(args) -> int:
    from rayflex.planning.capacity.explain import summary
    from rayflex.planning.capacity.search import search

    if args.topology or args.live:
        return cmd_placement(args)
    model, cluster, global_batch, world, ac, failures = _inputs(args)
    result = search(model, cluster, global_batch=global_batch, world_size=world, tp=args.tp,
                    activation_checkpointing=ac, failures=failures)
    placement = _placement(result) if (args.explain and args.cluster) else None
    cost = _expected_cost(cluster, result, model, global_batch)
    if args.json:
        out = result.to_dict()
        if cost is not None:
            out["cost"] = cost
        if placement is not None:
            out["placement"] = placement.to_dict()
        json.dump(out, sys.stdout, indent=2, default=float)
        print()
        return 0
    print(f"model: {model.name}, {model.total_params / 1e9:.3g}B params, {model.num_blocks} blocks, seq_len "
          f"{model.seq_len}, precision {_precision_name(model)}, {_ac_words(result)}; global batch {global_batch}")
    print(f"cluster: {cluster.describe()}; world size {result.world_size}")
    print(f"searched {len(result.candidates)} candidates in {result.search_s:.2f} s")
    print()
    print(result.table(result.candidates if args.all else _table_rows(result)))
    print()
    best = result.best
    lay = best.layout
    hsdp = f" (HSDP: dp_shard={lay.dp_shard} x dp_replicate={lay.dp_replicate})" if lay.dp_replicate > 1 else ""
    ac = ""
    if result.ac_searched:
        from rayflex.planning.capacity.search import ac_name

        ac = f", activation checkpointing {ac_name(best.activation_checkpointing, best.ac_every)}"
    print(f"choice: {best.label()}: pp={lay.pp} tp={lay.tp} dp={lay.dp}{hsdp}{ac}, {best.peak_bytes / 1e9:.2f} GB "
          f"per rank, modeled step {best.step_s:.3f} s")
    if cost is not None:
        print(f"cost: ${cost['usd_per_hour']:,.2f} an hour for the {cost['nodes']} nodes it fills; "
              f"${cost['usd_per_1k_tokens']:.3g} per 1k tokens at the modeled step")
    print()
    print(summary(result))
    if args.explain:
        print()
        print(result.explanation)
        if placement is not None:
            print()
            print("placement of the chosen mesh:")
            print(placement.format())
    return 0


def _expected_cost(cluster, result, model, global_batch: int) -> Optional[dict]:
    """What the chosen mesh costs by the cluster file's node prices (None: unpriced)."""
    held = cluster.hourly_cost(result.world_size)
    if held is None or not result.best.fits:
        return None
    per_hour, nodes = held
    tokens = global_batch * model.seq_len
    return {"usd_per_hour": per_hour, "nodes": nodes,
            "usd_per_1k_tokens": per_hour / 3600 * result.best.step_s / (tokens / 1000)}


def _table_rows(result, not_fitting: int = 8):
    """The best of every mesh shape that fits, and the few smallest that do not."""
    rows = result.best_per_shape()
    fit = [c for c in rows if c.fits]
    return fit + [c for c in rows if not c.fits][:not_fitting]


def _ac_words(result) -> str:
    """``activation checkpointing auto (none, every 2nd block, full)`` / ``... none``."""
    from rayflex.planning.capacity.search import ac_name

    if result.ac_searched:
        return "activation checkpointing auto (" + ", ".join(
            ac_name(m.activation_checkpointing, m.ac_every) for m in result.ac_options) + ")"
    mask = result.model.recompute_mask
    if not any(mask):
        return "no activation checkpointing"
    if all(mask):
        return "activation checkpointing full"
    return f"activation checkpointing on {sum(mask)} of {len(mask)} blocks"


def _precision_name(model) -> str:
    p = model.precision
    return f"{8 * p.param_bytes}-bit compute" + (", fp32 master weights" if p.master_weights else "")


def _placement(result):
    """The Planner's rank -> node plan for the chosen mesh (refines the search's layout)."""
    from rayflex.planning.capacity.step_time import layout_profile
    from rayflex.planning.placement.planner import Planner

    lay = result.best.layout
    model = result.model_of(result.best)
    return Planner(result.cluster.topology).plan(lay, layout_profile(model, lay, result.global_batch))
