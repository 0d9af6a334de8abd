"""Recovery from faults, rayflex vs Ray Train's ``TorchTrainer``, on one loopback cluster.

    python benchmarks/recovery.py [--steps 30] [--every 5] [--fault-at 12]

One ``ray.cluster_utils.Cluster`` on 127.0.0.1 (3 nodes x 2 CPUs). Both systems train the
same small GPT (FSDP2 over 4 ranks, gloo) on the same samples, with the same checkpoint
interval and step count, and each run gets one fault after step ``--fault-at``:

* ``kill_actor``: SIGKILL the process of rank 1;
* ``remove_node``: ``cluster.remove_node`` a non-head node hosting workers (a fresh node
  is added back after the run so every run starts on the same 3-node cluster).

For each (system, fault) it measures, from the wall-clock moment of the fault:

* ``detection_s``: until the system notices (rayflex: its ``worker_died`` / ``node_lost``
  event; Ray Train: the end time its controller records on the failed run attempt, i.e.
  when it decided to tear the worker group down);
* ``fault_to_resumed_step_s``: until the first step after the restart is completed
  (``fault_to_kept_resumed_step_s``: the same for the restart that stuck, when the first
  one had to be redone; the goal is judged on this one);
* ``steps_lost``: steps completed before the fault that had to be redone (last step done
  in the failed attempt minus the step the restart resumed from).

With ``restart_while_warming`` (rayflex's default) the recovery restart goes on at once with
the surviving processes and a later growth restart brings the replacements in at a step
boundary; that growth is reported separately (``grown_back_to``, ``fault_to_grown_back_s``)
and is not a redo.

Both systems run with their default timing knobs (rayflex: ``rayflex/constants.py``; Ray
Train: 2 s health-check interval). Ray Train V2 runs with ``RAY_TRAIN_ENABLE_STATE_TRACKING=1``
(its only record of when the controller noticed) and its train function calls
``ray.train.report`` with each checkpoint; ``--rt-report-every-step`` reports every step, which
in V2 paces every step to the controller's 2 s poll. Prints one JSON object on stdout; logs
go to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from common import emit, machine, setup_logging  # noqa: E402

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Ray Train V2 records run attempts (start/end, status) in its state actor only with this:
# the end time of the errored attempt is its controller's detection timestamp.
os.environ.setdefault("RAY_TRAIN_ENABLE_STATE_TRACKING", "1")

WORKERS, SEQ, GB = 4, 32, 12
GPT = dict(vocab_size=128, seq_len=SEQ, d_model=32, n_layers=2, n_heads=2)
LR, BETAS, CLIP, MIN_LR_RATIO = 3e-3, (0.9, 0.95), 1.0, 0.1
# The AdamW kernel every system trains with: "default" = each system's own (rayflex's
# OptimizerConfig default, fused; torch's for the peers: the per-parameter loop on CPU),
# or one kernel named for all of them (compare.py --adamw).
ADAMW = "default"
_TORCH_ADAMW_KWARGS = {"default": {}, "fused": {"fused": True}, "foreach": {"foreach": True},
                       "for-loop": {"foreach": False}}


def peer_adamw_kwargs() -> dict:
    """torch.optim.AdamW's keyword arguments for the peers' train functions (ADAMW's kernel)."""
    return dict(_TORCH_ADAMW_KWARGS[ADAMW])


def rayflex_optimizer():
    """The OptimizerConfig every rayflex run of the harness trains with."""
    import rayflex as rf

    kernel = {} if ADAMW == "default" else {"implementation": ADAMW}
    return rf.OptimizerConfig(lr=LR, betas=BETAS, grad_clip=CLIP, min_lr_ratio=MIN_LR_RATIO, **kernel)
RUN_TIMEOUT_S = 240
DETECT_KINDS = ("worker_died", "node_lost", "worker_failed", "hang_detected")
# Actors that belong to one run (rayflex's controller and workers, Ray Train's controller and
# workers): the only ones the harness kills if a finished case left them behind.
RUN_ACTOR_CLASSES = ("Controller", "TrainWorkerActor", "TrainController", "RayTrainWorker")


def log(msg: str) -> None:
    print(f"[recovery {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def model_spec():
    from rayflex.models import GPTConfig, gpt

    return gpt(GPTConfig(**GPT))


# ----------------------------------------------------------------------------- cluster
class LoopbackCluster:
    """3 nodes x 2 CPUs on 127.0.0.1; always shut down by ``close``."""

    def __init__(self, nodes: int = 3, cpus: int = 2, object_store_bytes: int | None = None):
        import ray
        from ray.cluster_utils import Cluster

        from rayflex.local_ray import head_node_args

        self.cpus = cpus
        # ray.cluster_utils gives every node a 150 MB object store unless told otherwise.
        self.store = {"object_store_memory": object_store_bytes} if object_store_bytes else {}
        # Every process of this cluster inherits RAY_ADDRESS: Ray Train's helper actors that
        # call ray.init() without an address would otherwise pick another cluster running on
        # this (shared) machine.
        head = {**head_node_args(cpus), **self.store}  # every port with a Ray default chosen free
        os.environ["RAY_ADDRESS"] = f"127.0.0.1:{head['gcs_server_port']}"
        self.cluster = Cluster(initialize_head=True, head_node_args=head)
        for _ in range(nodes - 1):
            self.cluster.add_node(node_ip_address="127.0.0.1", num_cpus=cpus, **self.store)
        self.cluster.wait_for_nodes()
        if self.cluster.address != os.environ["RAY_ADDRESS"]:
            log(f"warning: GCS at {self.cluster.address}, not {os.environ['RAY_ADDRESS']}")
            os.environ["RAY_ADDRESS"] = self.cluster.address
        ray.init(address=self.cluster.address)
        self.wait_cpus(nodes * cpus)

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id

    def node(self, node_id: str):
        return next(n for n in self.cluster.list_all_nodes() if n.node_id == node_id)

    def remove(self, node_id: str) -> None:
        if node_id == self.head_id:
            raise ValueError("refusing to remove the head node")
        self.cluster.remove_node(self.node(node_id))

    def restore(self, nodes: int) -> None:
        """Add nodes until ``nodes`` are alive (after a remove_node run)."""
        import ray

        while len(self.cluster.list_all_nodes()) < nodes:
            self.cluster.add_node(node_ip_address="127.0.0.1", num_cpus=self.cpus, **self.store)
        self.cluster.wait_for_nodes()
        self.wait_cpus(nodes * self.cpus)
        log(f"cluster back to {len([n for n in ray.nodes() if n['Alive']])} live nodes")

    def wait_cpus(self, cpus: float, timeout_s: float = 60) -> bool:
        """Wait until the cluster's available CPUs are back to ``cpus`` (previous run gone)."""
        import ray

        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if ray.available_resources().get("CPU", 0) >= cpus:
                return True
            time.sleep(0.2)
        log(f"warning: only {ray.available_resources().get('CPU', 0)} of {cpus} CPUs free after {timeout_s}s")
        return False

    def settle(self, timeout_s: float = 20) -> dict:
        """After a case: wait for its resources to come back; clean up what its system leaked.

        Returns how long the release took, and what had to be removed by hand (actors still
        alive, placement groups still holding CPUs), so a leak shows in the JSON.
        """
        import ray

        want = self.cpus * len([n for n in ray.nodes() if n["Alive"]])
        t0 = time.time()
        if self.wait_cpus(want, timeout_s):
            return {"cpus_released_after_s": time.time() - t0}
        leaked = {"cpus_free": ray.available_resources().get("CPU", 0), "cpus_total": want,
                  "actors": [], "placement_groups": []}
        try:
            from ray._private import state
            from ray._raylet import PlacementGroupID
            from ray.util.placement_group import PlacementGroup

            alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
            for info in state.actors().values():
                if info["State"] != "ALIVE" or info["ActorClassName"] not in RUN_ACTOR_CLASSES:
                    continue  # Ray Train's own long-lived helpers hold no CPUs: leave them
                leaked["actors"].append({"class": info["ActorClassName"], "name": info["Name"], "pid": info["Pid"]})
                if info["Address"]["NodeID"] in alive and info["Pid"]:
                    try:
                        os.kill(info["Pid"], signal.SIGKILL)  # a process of this benchmark's cluster
                    except ProcessLookupError:
                        pass
            for pg_id, pg in ray.util.placement_group_table().items():
                if pg["state"] in ("CREATED", "PENDING", "PREPARED", "RESCHEDULING"):
                    leaked["placement_groups"].append({"name": pg.get("name"), "state": pg["state"],
                                                       "bundles": len(pg.get("bundles", {}))})
                    ray.util.remove_placement_group(PlacementGroup(PlacementGroupID.from_hex(pg_id)))
        except Exception as e:  # noqa: BLE001 - private APIs: best effort, logged
            leaked["cleanup_error"] = f"{type(e).__name__}: {e}"
        log(f"leftovers after the case, removed by hand: {leaked}")
        leaked["cpus_back_after_cleanup"] = self.wait_cpus(want, 30)
        return {"cpus_released_after_s": None, "leaked": leaked}

    def close(self) -> None:
        import ray

        try:
            ray.shutdown()
        finally:
            self.cluster.shutdown()


def actor_node(name_part: str) -> str | None:
    """Node of the live actor whose name or class contains ``name_part`` (best effort)."""
    try:
        from ray._private import state

        for info in state.actors().values():
            if info.get("State") != "ALIVE":
                continue
            if name_part in (info.get("Name") or "") or name_part in str(info.get("ActorClassName", "")):
                return info.get("Address", {}).get("NodeID")
    except Exception as e:  # noqa: BLE001 - private API: only used for a log line / a choice
        log(f"could not look up actor {name_part!r}: {e}")
    return None


def pick_node(worker_nodes: list[str], head_id: str, avoid: str | None) -> str:
    """The non-head node hosting the most workers (not the one hosting the controller)."""
    counts: dict[str, int] = {}
    for n in worker_nodes:
        if n and n != head_id:
            counts[n] = counts.get(n, 0) + 1
    if not counts:
        raise RuntimeError(f"no non-head node hosts a worker: {worker_nodes}")
    ranked = sorted(counts, key=lambda n: (n == avoid, -counts[n]))
    return ranked[0]


# ----------------------------------------------------------------------------- rayflex
def run_rayflex(lc: LoopbackCluster, fault: str, data: str, storage: str, name: str, args,
                memory_replicas: int = 0, live_recovery: bool = True, dp_shard: int | None = None) -> dict:
    import rayflex as rf
    from rayflex.storage.rundir import RunDirectory

    if getattr(args, "memory", False):  # the memory path: a model whose restore moves real bytes
        from rayflex.models import GPTConfig, gpt

        model = gpt(GPTConfig(vocab_size=args.memory_vocab, seq_len=args.memory_seq, d_model=args.memory_d_model,
                              n_layers=1, n_heads=4))
        data_cfg = rf.DataConfig(uri=data, seq_len=args.memory_seq, global_batch=4)
    else:
        model, data_cfg = model_spec(), rf.DataConfig(uri=data, seq_len=SEQ, global_batch=GB)
    trainer = rf.Trainer(model=model, data=data_cfg,
                         run=rf.RunConfig(name=name, storage=storage, steps=args.steps,
                                          optimizer=rayflex_optimizer()),
                         parallel=rf.ParallelConfig(dp_shard=dp_shard),
                         scaling=rf.ScalingConfig(num_workers=WORKERS, min_workers=2, max_workers=WORKERS),
                         checkpoint=rf.CheckpointConfig(every_steps=args.every, keep=2,
                                                        memory_replicas=memory_replicas),
                         # --memory-wait-for-spawn: every restart waits for its replacement
                         # processes (the restore is then a smaller share of the recovery).
                         elastic=rf.ElasticConfig(max_failures=3, resource_wait_s=60, live_recovery=live_recovery,
                                                  restart_while_warming=not getattr(args, "memory_wait_for_spawn",
                                                                                    False)))
    t_submit = time.time()
    handle = trainer.submit()
    deadline = time.time() + RUN_TIMEOUT_S
    while True:
        st = handle.status()
        if st["step"] >= args.fault_at and st["state"] == "RUNNING" and st["workers"]:
            break
        if st["state"] in ("FINISHED", "FAILED", "STOPPED") or time.time() > deadline:
            raise RuntimeError(f"rayflex run {name} never reached step {args.fault_at}: {st}")
        time.sleep(0.05)
    out: dict = {"status_step_at_fault": st["step"]}
    if fault == "kill_actor":
        victim = next(w for w in st["workers"] if w["rank"] == 1)
        fault_time = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        out["killed"] = {"rank": 1, "pid": victim["pid"], "node_id": victim["node_id"]}
    else:
        ctrl_node = actor_node(f"rayflex-controller:{name}")
        node = pick_node([w["node_id"] for w in st["workers"]], lc.head_id, ctrl_node)
        ranks = [w["rank"] for w in st["workers"] if w["node_id"] == node]
        fault_time = time.time()
        lc.remove(node)
        out["removed"] = {"node_id": node, "ranks": ranks, "remove_node_call_s": time.time() - fault_time,
                          "controller_on_removed_node": ctrl_node == node}
    log(f"rayflex {fault}: fault injected at step {st['step']}: {out}")
    # metrics.jsonl is rewritten when a restart rolls steps back: keep every line seen live,
    # so the first step after a restart is known even if a later restart replaced it.
    seen: dict = {}
    deadline = time.time() + RUN_TIMEOUT_S
    while time.time() < deadline:
        try:
            if handle.done():
                break
            for m in handle.metrics():
                seen[(m["step"], m["time"])] = m
        except Exception:  # noqa: BLE001 - the controller may be gone; wait() reports it
            break
        time.sleep(0.2)
    try:
        result = handle.wait(timeout_s=max(1.0, deadline - time.time()), raise_on_failure=False)
        final = {"status": result.status, "steps_completed": result.steps_completed,
                 "final_loss": result.final_loss, "world_size": result.raw.get("world_size")}
        metrics = result.metrics
    except TimeoutError:
        handle.stop(wait=False)
        final = {"status": "timed_out", "steps_completed": handle.status().get("step")}
        metrics = handle.metrics()
    except Exception as e:  # noqa: BLE001 - e.g. the controller died: report the symptom
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        final = {"status": "run_lost", "error": f"{type(e).__name__}: {first_line}",
                 "error_detail": " | ".join(x.strip() for x in str(e).splitlines()[1:] if x.strip())[:600]}
        metrics = RunDirectory(f"{storage}/{name}").read_jsonl("metrics.jsonl")
        log(f"rayflex {fault}: the run was lost: {final}")
    for m in metrics:
        seen[(m["step"], m["time"])] = m
    live = sorted(seen.values(), key=lambda m: m["time"])
    events = RunDirectory(f"{storage}/{name}").read_jsonl("events.jsonl")
    after = [e for e in events if e["time"] >= fault_time - 0.05]
    detect = next((e for e in after if e["kind"] in DETECT_KINDS), None)
    restarts = [e for e in after if e["kind"] == "restarted"]
    loaded = next((e for e in after if e["kind"] == "checkpoint_loaded"), None)
    if loaded is not None:
        out["checkpoint_loaded"] = {k: loaded.get(k) for k in ("step", "uri", "load_s", "sources", "fell_back",
                                                               "remote_reads", "world_size", "saved_world_size")}
    chosen = next((e for e in after if e["kind"] == "recovery_chosen"), None)
    if chosen is not None:
        out["recovery_chosen"] = {k: chosen.get(k) for k in ("source", "step", "holders", "snapshot_s",
                                                             "snapshot_bytes", "reason")}
    out.update(final=final, time_to_first_step_s=(metrics[0]["time"] - t_submit) if metrics else None,
               median_step_s=statistics.median(m["step_time_s"] for m in metrics) if metrics else None)
    if detect is not None:
        out["detected"] = {k: detect.get(k) for k in ("kind", "rank", "node_id", "ranks", "error") if detect.get(k)}
        out["detection_s"] = detect["time"] - fault_time
    else:
        out["detection_s"] = None
    if not restarts:
        out.update(fault_to_resumed_step_s=None, fault_to_kept_resumed_step_s=None, steps_lost=None,
                   recovered=False,
                   events_after_fault=[{k: v for k, v in e.items() if k not in ("explanation", "stage_costs")}
                                       for e in after])
        log(f"rayflex {fault}: NO restart; events after the fault: {out['events_after_fault']}")
        return out

    def first_step_after(restart, lines):
        return next((m for m in lines if m["step"] == restart["from_step"] + 1 and m["time"] >= restart["time"]),
                    None)

    # A growth restart (capacity returned: the warm replacements join at a checkpointed step
    # boundary, losing nothing) is not a redo of the recovery; the restart that "stuck" is
    # the last one caused by the fault.
    recoveries = [e for e in restarts if "capacity returned" not in e.get("reason", "")] or restarts
    first, last = recoveries[0], recoveries[-1]
    setup_s = next((e.get("setup_s") for e in after if e["kind"] == "workers_started"
                    and e["time"] >= first["time"]), None)
    resumed = first_step_after(first, live)
    kept = first_step_after(last, metrics)
    started = next((e for e in after if e["kind"] == "workers_started" and e["time"] >= first["time"]), None)
    if started is not None:  # where the restart's setup went
        out["restart_phases_s"] = {k: started.get(k) for k in ("spawn_s", "rendezvous_s", "build_s", "restore_s",
                                                                "setup_s")}
    out.update(
        steps_lost=first["lost_steps"], resumed_from_step=first["from_step"],
        restart_world_size=first["world_size"], reused_workers=first.get("reused_workers"),
        restart_reason=first.get("reason"),
        # ``restarted`` is recorded once the new group is set up (checkpoint loaded), so
        # detection -> (restarted - setup_s) is releasing the survivors and re-planning.
        fault_to_restarted_event_s=first["time"] - fault_time,
        restart_setup_s=setup_s,
        detect_to_setup_start_s=(first["time"] - setup_s - detect["time"]) if setup_s and detect else None,
        fault_to_workers_started_s=(started["time"] - fault_time) if started else None,
        fault_to_resumed_step_s=(resumed["time"] - fault_time) if resumed else None,
        restarts_after_fault=len(restarts),
        growth_restarts=len(restarts) - len(recoveries),
        grown_back_to=restarts[-1]["world_size"] if len(restarts) > len(recoveries) else None,
        fault_to_grown_back_s=(restarts[-1]["time"] - fault_time) if len(restarts) > len(recoveries) else None,
        fault_to_kept_resumed_step_s=(kept["time"] - fault_time) if kept else None,
        recovered=final["status"] == "finished" and kept is not None)
    if len(restarts) > 1:
        # The first restart did not hold: say why and what it cost.
        out["later_restarts"] = [{"time_after_fault_s": e["time"] - fault_time, "from_step": e["from_step"],
                                  "lost_steps": e["lost_steps"], "reused_workers": e.get("reused_workers"),
                                  "reason": (e.get("reason") or "")[:400]} for e in restarts[1:]]
        out["steps_redone_by_later_restarts"] = sum(e["lost_steps"] for e in restarts[1:])
        failures = [e for e in after if e["kind"] in DETECT_KINDS and e["time"] > first["time"]]
        out["later_faults"] = [{"kind": e["kind"], "rank": e.get("rank"), "step": e.get("step"),
                                "time_after_fault_s": e["time"] - fault_time,
                                "error_tail": (e.get("error") or "")[-700:]} for e in failures]
    # Where the seconds to the resumed step went: each event until then, and the steps around it.
    until = (kept or resumed or {"time": float("inf")})["time"]
    out["timeline_s"] = [[e["kind"], round(e["time"] - fault_time, 3)] for e in after if e["time"] <= until] + [
        [f"step {m['step']}", round(m["time"] - fault_time, 3)] for m in live if fault_time <= m["time"] <= until]
    out["timeline_s"].sort(key=lambda item: item[1])
    return out


# ----------------------------------------------------------------------------- Ray Train
def _rt_train_loop(cfg: dict) -> None:
    """Ray Train's train function: same model (FSDP2 per block + root), data, optimizer."""
    import math
    import shutil

    import ray.train
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rayflex.data.dataset import GlobalSampler, TokenDataset
    from rayflex.models import GPTConfig, gpt
    from rayflex.models.spec import build_stage

    t_enter = time.time()
    torch.set_num_threads(1)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    spec = gpt(GPTConfig(**cfg["gpt"]))
    model = build_stage(spec, list(range(spec.num_blocks)))
    for i in model.indices:
        fully_shard(model.blocks[str(i)], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], betas=tuple(cfg["betas"]), weight_decay=0.0,
                            **cfg.get("adamw_kwargs", {}))
    start = 0
    ckpt = ray.train.get_checkpoint()
    if ckpt is not None:
        with ckpt.as_directory() as d:
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=d)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
            with open(os.path.join(d, "meta.json")) as f:
                start = json.load(f)["step"]

    def note(rec: dict) -> None:
        with open(cfg["log"], "a") as f:
            f.write(json.dumps(rec) + "\n")

    note({"event": "start", "rank": rank, "pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
          "time": t_enter, "ready": time.time(), "resumed_from": start})
    ds = TokenDataset(cfg["data"])
    sampler = GlobalSampler(len(ds), cfg["global_batch"], 0, block_rows=ds.block_rows)  # rayflex's order
    seq, steps, every = cfg["gpt"]["seq_len"], cfg["steps"], cfg["every"]
    for step in range(start, steps):
        progress = step / max(1, steps)
        factor = cfg["min_lr_ratio"] + (1 - cfg["min_lr_ratio"]) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        for g in opt.param_groups:
            g["lr"] = cfg["lr"] * factor
        rows = ds.rows(sampler.indices(step, rank, world))
        x, y = rows[:, :seq], rows[:, 1:seq + 1]
        opt.zero_grad(set_to_none=True)
        loss = spec.loss_fn(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["clip"])
        opt.step()
        lv = loss.detach().clone()
        dist.all_reduce(lv)
        done = step + 1
        metrics = {"step": done, "loss": float(lv) / world}
        if done % every == 0 or done == steps:
            tmp = tempfile.mkdtemp(prefix="rt-ckpt-")
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=tmp)
            if rank == 0:
                with open(os.path.join(tmp, "meta.json"), "w") as f:
                    json.dump({"step": done}, f)
            ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp),
                             checkpoint_dir_name=f"step_{done:06d}")
            shutil.rmtree(tmp, ignore_errors=True)
        elif done % cfg["report_every"] == 0:
            ray.train.report(metrics)
        if rank == 0:
            note({"event": "step", "step": done, "time": time.time(), "loss": metrics["loss"]})


def _read_log(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def _attempts(lines: list[dict]) -> list[dict]:
    """Split the log into attempts (one per start of the worker group)."""
    out: list[dict] = []
    for rec in lines:
        if rec["event"] == "start":
            # Ranks of one attempt all start before its first step ends (collectives), and
            # a restarted attempt starts after the failed one's last step line.
            if not out or out[-1]["steps"]:
                out.append({"starts": [], "steps": []})
            out[-1]["starts"].append(rec)
        elif out:
            out[-1]["steps"].append(rec)
    for a in out:
        a["start"] = next((s for s in a["starts"] if s["rank"] == 0), a["starts"][0])
    return out


def _median_gap(steps: list[dict]):
    gaps = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]
    return statistics.median(gaps) if gaps else None


def _rt_attempt_times(name: str) -> list[dict]:
    """Ray Train's own record of run attempts (start/end, status) from its state actor."""
    import ray
    from ray.train.v2._internal.state.state_actor import get_state_actor

    actor = get_state_actor()
    if actor is None:
        return []
    runs = ray.get(actor.get_train_runs.remote(), timeout=30)
    attempts = ray.get(actor.get_train_run_attempts.remote(), timeout=30)
    run_ids = [rid for rid, run in runs.items() if getattr(run, "name", None) == name]
    out = []
    for rid in run_ids:
        for a in attempts.get(rid, {}).values():
            out.append({"start": a.start_time_ns / 1e9, "end": a.end_time_ns / 1e9 if a.end_time_ns else None,
                        "status": str(getattr(a.status, "name", a.status)),
                        "detail": (getattr(a, "status_detail", None) or "")[:300]})
    return sorted(out, key=lambda a: a["start"])


def run_ray_train(lc: LoopbackCluster, fault: str, data: str, storage: str, name: str, args) -> dict:
    import ray.train
    from ray.train.torch import TorchTrainer

    logfile = os.path.join(storage, f"{name}.steps.jsonl")
    cfg = {"gpt": GPT, "lr": LR, "betas": list(BETAS), "clip": CLIP, "min_lr_ratio": MIN_LR_RATIO,
           "global_batch": GB, "steps": args.steps, "every": args.every, "data": data, "log": logfile,
           "report_every": 1 if args.rt_report_every_step else args.every,
           "adamw_kwargs": peer_adamw_kwargs()}
    trainer = TorchTrainer(
        _rt_train_loop, train_loop_config=cfg,
        scaling_config=ray.train.ScalingConfig(num_workers=WORKERS, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=name, storage_path=storage,
                                       failure_config=ray.train.FailureConfig(max_failures=3)))
    outcome: dict = {}

    def fit() -> None:
        try:
            res = trainer.fit()
            outcome["status"] = "finished" if res.error is None else "failed"
            outcome["error"] = None if res.error is None else str(res.error)[:500]
            outcome["final_metrics"] = res.metrics
        except Exception as e:  # noqa: BLE001 - reported, not raised
            outcome["status"] = "failed"
            outcome["error"] = f"{type(e).__name__}: {str(e)[:500]}"

    t_submit = time.time()
    thread = threading.Thread(target=fit, daemon=True, name=f"fit-{name}")
    thread.start()
    deadline = time.time() + RUN_TIMEOUT_S
    while True:
        atts = _attempts(_read_log(logfile))
        if atts and atts[0]["steps"] and atts[0]["steps"][-1]["step"] >= args.fault_at \
                and len(atts[0]["starts"]) == WORKERS:
            break
        if not thread.is_alive() or time.time() > deadline:
            raise RuntimeError(f"Ray Train run {name} never reached step {args.fault_at}: {outcome}")
        time.sleep(0.05)
    first = atts[0]
    out: dict = {"log_step_at_fault": first["steps"][-1]["step"]}
    if fault == "kill_actor":
        victim = next(s for s in first["starts"] if s["rank"] == 1)
        fault_time = time.time()
        os.kill(victim["pid"], signal.SIGKILL)
        out["killed"] = {"rank": 1, "pid": victim["pid"], "node_id": victim["node_id"]}
    else:
        ctrl_node = actor_node("TrainController")
        node = pick_node([s["node_id"] for s in first["starts"]], lc.head_id, ctrl_node)
        ranks = sorted(s["rank"] for s in first["starts"] if s["node_id"] == node)
        fault_time = time.time()
        lc.remove(node)
        out["removed"] = {"node_id": node, "ranks": ranks, "remove_node_call_s": time.time() - fault_time,
                          "controller_on_removed_node": ctrl_node == node}
    log(f"ray_train {fault}: fault injected at step {out['log_step_at_fault']}: {out}")
    thread.join(RUN_TIMEOUT_S)
    if thread.is_alive():
        outcome["status"] = f"hung: still running {RUN_TIMEOUT_S}s after the fault"
    atts = _attempts(_read_log(logfile))
    out.update(final={k: outcome.get(k) for k in ("status", "error")},
               attempts=len(atts),
               time_to_first_step_s=(atts[0]["steps"][0]["time"] - t_submit) if atts and atts[0]["steps"] else None,
               median_step_s=_median_gap(atts[0]["steps"]) if atts else None)
    if atts and atts[-1]["steps"]:
        out["final"]["steps_completed"] = atts[-1]["steps"][-1]["step"]
        out["final"]["final_loss"] = atts[-1]["steps"][-1]["loss"]
    try:
        recorded = _rt_attempt_times(name)
    except Exception as e:  # noqa: BLE001 - internal API; fall back to the train-function restart
        log(f"could not read Ray Train's attempt records: {e}")
        recorded = []
    out["ray_train_attempts"] = recorded
    failed = next((a for a in recorded if a["end"] and a["end"] >= fault_time - 0.05
                   and a["status"] != "FINISHED"), None)
    if failed is not None:
        out["detection_s"] = failed["end"] - fault_time
        out["detection_source"] = "Ray Train controller: end time of the errored run attempt (state actor)"
    nxt = atts[1] if len(atts) > 1 else None
    if nxt is None:
        out.update(fault_to_resumed_step_s=None, fault_to_kept_resumed_step_s=None, steps_lost=None,
                   recovered=False)
        if "detection_s" not in out:
            out["detection_s"] = None
        return out
    if "detection_s" not in out:
        out["detection_s"] = nxt["start"]["time"] - fault_time
        out["detection_source"] = "no controller timestamp: time until the restarted train function began"
    resumed_from = nxt["start"]["resumed_from"]
    resumed = next((s for s in nxt["steps"] if s["step"] == resumed_from + 1), None)
    done_before = max((s["step"] for s in first["steps"]), default=0)
    # Rank 0 logs a step after its report returned, i.e. after the checkpoint was persisted.
    out["checkpoint_persisted_before_fault"] = (done_before // args.every) * args.every
    nodes = {s["node_id"] for s in nxt["starts"]}
    last = atts[-1]
    kept = next((s for s in last["steps"] if s["step"] == last["start"]["resumed_from"] + 1), None)
    out.update(resumed_from_step=resumed_from, steps_lost=max(0, done_before - resumed_from),
               restart_world_size=len(nxt["starts"]), restart_nodes=len(nodes),
               fault_to_train_fn_restart_s=min(s["time"] for s in nxt["starts"]) - fault_time,
               fault_to_resumed_step_s=(resumed["time"] - fault_time) if resumed else None,
               restarts_after_fault=len(atts) - 1,
               fault_to_kept_resumed_step_s=(kept["time"] - fault_time) if kept else None,
               recovered=outcome.get("status") == "finished" and kept is not None)
    return out


def knobs() -> dict:
    """The timing settings both systems ran with (their defaults unless the environment says)."""
    from ray.train.v2._internal import constants as rtc

    from rayflex.constants import knob

    return {"rayflex": {k: knob(k) for k in ("POLL_INTERVAL_S", "RELEASE_TIMEOUT_S", "HEARTBEAT_TIMEOUT_S",
                                             "COLLECTIVE_TIMEOUT_S")},
            "ray_train": {"health_check_interval_s": float(os.environ.get(
                rtc.HEALTH_CHECK_INTERVAL_S_ENV_VAR, rtc.DEFAULT_HEALTH_CHECK_INTERVAL_S)),
                "worker_group_start_timeout_s": float(os.environ.get(
                    rtc.WORKER_GROUP_START_TIMEOUT_S_ENV_VAR, rtc.DEFAULT_WORKER_GROUP_START_TIMEOUT_S)),
                "state_tracking": os.environ.get("RAY_TRAIN_ENABLE_STATE_TRACKING")}}


# ----------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--fault-at", type=int, default=12)
    ap.add_argument("--faults", default="kill_actor,remove_node")
    ap.add_argument("--systems", default="rayflex,ray_train")
    ap.add_argument("--rt-report-every-step", action="store_true",
                    help="call ray.train.report every step (V2 then paces each step to its controller's "
                         "2 s poll: the result queue holds one report); default: with each checkpoint")
    ap.add_argument("--memory", action="store_true",
                    help="the memory-replica path instead (benchmarks/recovery_memory.py): restore from memory "
                         "vs S3, and fault -> first resumed step with and without replicas; S3 is moto")
    ap.add_argument("--memory-mb", type=int, default=256, help="state per rank of the restore measurement")
    ap.add_argument("--memory-rounds-restore", type=int, default=5)
    ap.add_argument("--memory-rounds", type=int, default=2, help="rounds of the fault cases (each: both paths)")
    ap.add_argument("--live", action="store_true",
                    help="with --memory: a third path, live recovery from the survivors' memory; every path runs "
                         "HSDP (2 replicas x 2 shards) so only the recovery source differs")
    ap.add_argument("--paths", help="with --memory: only these recovery paths, e.g. memory,live")
    ap.add_argument("--memory-faults", type=int, default=1, help="0: the restore measurement only")
    ap.add_argument("--memory-nodes", type=int, default=3)
    ap.add_argument("--memory-fault-kinds", default="kill_actor,remove_node")
    ap.add_argument("--memory-object-store-mb", type=int, default=2048,
                    help="each node's object store (a GPU node has tens of GB; Ray's test clusters 150 MB)")
    ap.add_argument("--memory-wait-for-spawn", action="store_true",
                    help="restart_while_warming=False in the fault cases (default: rayflex's default, True)")
    ap.add_argument("--memory-vocab", type=int, default=32768)
    ap.add_argument("--memory-d-model", type=int, default=512)
    ap.add_argument("--memory-seq", type=int, default=16)
    args = ap.parse_args()
    setup_logging()
    if args.memory:
        from recovery_memory import memory_main

        real_stdout, sys.stdout = sys.stdout, sys.stderr
        t0 = time.time()
        try:
            results = memory_main(args, log, run_rayflex, LoopbackCluster)
        finally:
            sys.stdout = real_stdout
        emit({"benchmark": "recovery_live" if args.live else "recovery_memory", "machine": machine(),
              "workload": {"restore_state_mb_per_rank": args.memory_mb, "storage": "moto S3 on 127.0.0.1",
                           "cluster": f"ray.cluster_utils.Cluster on 127.0.0.1, {args.memory_nodes} nodes x 2 CPUs",
                           "fault_model": {"vocab_size": args.memory_vocab, "d_model": args.memory_d_model,
                                           "n_layers": 1, "seq_len": args.memory_seq, "global_batch": 4,
                                           "workers": WORKERS, "steps": args.steps,
                                           "checkpoint_every_steps": args.every, "fault_after_step": args.fault_at,
                                           "restart_while_warming": not args.memory_wait_for_spawn,
                                           "mesh": "hsdp 2x2 (dp_shard=2)" if args.live else "fsdp 4"},

                           "wall_s": time.time() - t0},
              "results": results})
        return
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # worker logs Ray forwards to the driver: stderr

    from ray.train.v2._internal.constants import is_v2_enabled

    from rayflex.data.dataset import write_synthetic_dataset

    tmp = tempfile.mkdtemp(prefix="rayflex-recovery-")
    data = write_synthetic_dataset(f"file://{tmp}/data", num_samples=1024, seq_len=SEQ, vocab_size=128,
                                   num_shards=3, seed=7)
    rf_storage, rt_storage = f"file://{tmp}/rayflex", f"{tmp}/raytrain"
    os.makedirs(rt_storage, exist_ok=True)
    results: dict = {"rayflex": {}, "ray_train": {}}
    t0 = time.time()
    lc = None
    try:
        lc = LoopbackCluster(nodes=3, cpus=2)
        for fault in args.faults.split(","):
            for system in args.systems.split(","):  # the same fault for both, back to back
                name = f"{system.replace('_', '-')}-{fault.replace('_', '-')}"
                log(f"--- {system} / {fault}")
                try:
                    if system == "rayflex":
                        r = run_rayflex(lc, fault, data, rf_storage, name, args)
                    else:
                        r = run_ray_train(lc, fault, data, rt_storage, name, args)
                except Exception as e:  # noqa: BLE001 - one broken case must not hide the others
                    log(f"{system} {fault} failed: {type(e).__name__}: {e}")
                    r = {"error": f"{type(e).__name__}: {e}", "detection_s": None, "fault_to_resumed_step_s": None,
                         "fault_to_kept_resumed_step_s": None, "steps_lost": None, "recovered": False}
                results[system][fault] = r
                log(f"{system} {fault}: " + json.dumps({k: r.get(k) for k in (
                    "detection_s", "fault_to_resumed_step_s", "fault_to_kept_resumed_step_s", "steps_lost",
                    "restarts_after_fault", "recovered")}, default=float))
                r["after_run"] = lc.settle()
                if fault == "remove_node":
                    lc.restore(3)
    finally:
        if lc is not None:
            lc.close()
        sys.stdout = real_stdout
    results["ray_train"]["train_version"] = "v2" if is_v2_enabled() else "v1"
    rf_res, rt_res = results["rayflex"], results["ray_train"]
    ratios, goal_half, goal_lost = {}, [], []
    for fault in args.faults.split(","):
        for key in ("fault_to_resumed_step_s", "fault_to_kept_resumed_step_s"):
            a, b = rf_res.get(fault, {}).get(key), rt_res.get(fault, {}).get(key)
            ratios[f"{fault}_{key}_rayflex_over_ray_train"] = a / b if a and b else None
        # The goal is judged on the step that stuck: a restart that had to be redone
        # does not count as recovered.
        a = rf_res.get(fault, {}).get("fault_to_kept_resumed_step_s")
        b = rt_res.get(fault, {}).get("fault_to_kept_resumed_step_s")
        goal_half.append(bool(a and b and a <= 0.5 * b))
        lost = rf_res.get(fault, {}).get("steps_lost")
        goal_lost.append(lost is not None and lost <= args.every)
    det = rf_res.get("kill_actor", {}).get("detection_s")
    emit({"benchmark": "recovery", "machine": machine(),
          "workload": {"model": "gpt-2x32-v128", "seq_len": SEQ, "global_batch": GB, "workers": WORKERS,
                       "steps": args.steps, "checkpoint_every_steps": args.every, "fault_after_step": args.fault_at,
                       "cluster": "ray.cluster_utils.Cluster on 127.0.0.1, 3 nodes x 2 CPUs",
                       "rayflex_scaling": {"num_workers": WORKERS, "min_workers": 2, "max_workers": WORKERS},
                       "ray_train_scaling": {"num_workers": WORKERS, "resources_per_worker": {"CPU": 1},
                                             "max_failures": 3},
                       "ray_train_report_every_steps": 1 if args.rt_report_every_step else args.every,
                       "step_times": "rayflex: metrics.jsonl (every step); Ray Train: a wall-clock line "
                                     "rank 0 writes after every step of its train function",
                       "knobs": knobs(),
                       "wall_s": time.time() - t0},
          "results": results,
          "ratios": ratios,
          "goals": {"detection_le_2s": bool(det is not None and det <= 2.0),
                    "fault_to_resumed_le_half_ray_train": all(goal_half) if goal_half else False,
                    "steps_lost_le_interval": all(goal_lost) if goal_lost else False}})


if __name__ == "__main__":
    main()
