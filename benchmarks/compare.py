"""rayflex vs Ray Train ``TorchTrainer`` vs plain ``torchrun``, side by side, in one invocation.

    python benchmarks/compare.py [--steps 40] [--every 10] [--fault-at 15] [--rounds 5]
                                 [--systems rayflex,ray_train,torchrun] [--skip-recovery] [--markdown]
                                 [--torchrun-nice 15] [--keep-dir]

The same model (overhead.py's GPT, 4 blocks x 128), data (the same ``GlobalSampler`` order),
global batch, optimizer (AdamW, cosine LR, grad clip 1.0), world size (4 workers, FSDP2 over
gloo, one torch thread each), step count and checkpoint interval, trained by:

* ``rayflex``: ``rf.Trainer(...).submit()`` with async sharded checkpoints every ``--every`` steps;
* ``ray_train``: Ray Train V2 ``TorchTrainer``, ``fully_shard`` in the train function, a torch
  DCP save + ``ray.train.report(checkpoint=...)`` every ``--every`` steps,
  ``FailureConfig(max_failures=3)`` (``recovery.py``'s train function and harness);
* ``torchrun``: ``python -m torch.distributed.run --standalone --nproc-per-node 4
  --max-restarts 3 compare_torchrun_worker.py``, a plain FSDP2 script with a synchronous DCP
  save every ``--every`` steps that resumes from the newest complete one.

rayflex and Ray Train run on one loopback ``ray.cluster_utils.Cluster`` (recovery.py's: 3 nodes x
2 CPUs on 127.0.0.1, started before the runs, so its start is not in their time to first step;
idle, it costs ~0.07 CPU/s while torchrun runs). The clean runs alternate in ``--rounds``
rounds (rayflex, Ray Train, torchrun, rayflex, ...), so a slow minute of a shared machine
hits every system; each figure is the median over rounds, with its spread (min, max) and,
per ratio to rayflex, the spread of the round-by-round ratios. Per system, a clean run measures:

* ``tokens_per_s``: global_batch x seq_len over the median wall-clock gap between consecutive
  finished steps, skipping the first 2 steps and the gaps that contain a checkpoint save
  (``tokens_per_s_with_checkpoints``: over all gaps after step 2);
* ``time_to_first_step_s``: from the launch call (``submit()`` / ``fit()`` / ``Popen``) to the
  first finished step;
* ``checkpoint_blocked_s``: median time per checkpoint the training loop waited for a save
  (rayflex: its ``checkpoint_committed`` events; torchrun: timed around ``get_state_dict`` +
  ``dcp.save`` in the script; Ray Train, whose train function does not time it: the median
  step gap with a save minus the median without); ``checkpoint_step_excess_s`` is that
  gap-based estimate for every system, as a cross-check;
* ``final_loss``: the loss of the last step.

Then a second run per system (unless ``--skip-recovery``) SIGKILLs rank 1's process after step
``--fault-at`` and measures ``recovery_s`` (from the kill to the first step finished after the
restart that stuck) and ``steps_lost`` (steps done before the kill that had to be redone).
``--rayflex-live`` runs rayflex's as HSDP 2 x 2, so the restart resumes from the survivors'
memory (live recovery, no step lost) where the peers reload their last checkpoint.
Prints one JSON object on stdout; logs go to stderr (``--markdown``: also the table).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(__file__))
import recovery  # noqa: E402  - Ray Train harness, loopback cluster, fault injection
from common import emit, machine, setup_logging  # noqa: E402
from rounds import SKIP, alternate, median_or_none as _median, over_rounds, paired_ratios, step_figures  # noqa: E402

WORKERS, SEQ, BATCH = 4, 64, 32
GPT = dict(vocab_size=256, seq_len=SEQ, d_model=128, n_layers=4, n_heads=4)  # = overhead.model_spec()
TOKENS_PER_STEP = BATCH * SEQ
SYSTEMS = ("rayflex", "ray_train", "torchrun")
MAX_RESTARTS = 3
CLUSTER_CPUS = 6  # the loopback Ray cluster's logical CPUs, over --nodes nodes
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "compare_torchrun_worker.py")
TORCHRUN = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORKERS),
            "--max-restarts", str(MAX_RESTARTS), "--local-addr", "127.0.0.1"]

# TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torch 2.13's default (the agent's TCPStore shared
# by every restart round) a restarted gloo group reads the previous round's peer addresses and
# fails in connectFullMesh ("Connection refused"), so --max-restarts never recovers; see
# pytorch/pytorch#135712. With it, rank 0 hosts a fresh store per round.
TORCHRUN_ENV = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}

# recovery.py's harness reads its workload from module constants: give it this one.
recovery.GPT, recovery.SEQ, recovery.GB, recovery.WORKERS = GPT, SEQ, BATCH, WORKERS
log = recovery.log


ROUND_KEYS = ("tokens_per_s", "median_step_s", "tokens_per_s_with_checkpoints", "time_to_first_step_s",
              "checkpoint_blocked_s", "checkpoint_step_excess_s", "final_loss")


def summarize(times: dict[int, float], ckpt_gaps: set[int], t_launch: float) -> dict:
    return step_figures(times, ckpt_gaps, t_launch, TOKENS_PER_STEP)


def save_gaps(steps: int, every: int, *, after: bool) -> set[int]:
    """Steps whose gap holds a save: the save of step k is inside gap k when the loop logs a
    step after saving it (Ray Train, torchrun), inside gap k+1 when it logs before (rayflex)."""
    saved = [k for k in range(every, steps + 1, every)]
    return {k + 1 for k in saved if k < steps} if after else set(saved) | {steps}


def train_cfg(data: str, args) -> dict:
    """The train function's config, shared by the Ray Train loop and the torchrun script."""
    return {"gpt": GPT, "lr": recovery.LR, "betas": list(recovery.BETAS), "clip": recovery.CLIP,
            "min_lr_ratio": recovery.MIN_LR_RATIO, "global_batch": BATCH, "steps": args.steps,
            "every": args.every, "keep": 2, "data": data, "report_every": args.every,
            "adamw_kwargs": recovery.peer_adamw_kwargs()}


# ----------------------------------------------------------------------------- rayflex
def rayflex_clean(data: str, storage: str, name: str, args) -> dict:
    """The same Trainer recovery.run_rayflex builds, run without a fault."""
    import rayflex as rf
    from rayflex.storage.rundir import RunDirectory

    trainer = rf.Trainer(model=recovery.model_spec(), data=rf.DataConfig(uri=data, seq_len=SEQ, global_batch=BATCH),
                         run=rf.RunConfig(name=name, storage=storage, steps=args.steps,
                                          optimizer=recovery.rayflex_optimizer()),
                         scaling=rf.ScalingConfig(num_workers=WORKERS, min_workers=2, max_workers=WORKERS),
                         checkpoint=rf.CheckpointConfig(every_steps=args.every, keep=2, upload=args.rayflex_upload),
                         elastic=rf.ElasticConfig(max_failures=3, resource_wait_s=60))
    t0 = time.time()
    handle = trainer.submit()
    try:
        result = handle.wait(timeout_s=recovery.RUN_TIMEOUT_S * 2)
    except BaseException:
        handle.stop(wait=False)  # do not leave it training under the next run
        raise
    wall = time.time() - t0
    m = result.metrics
    commits = [e for e in RunDirectory(f"{storage}/{name}").read_jsonl("events.jsonl")
               if e["kind"] == "checkpoint_committed"]
    out = summarize({r["step"]: r["time"] for r in m}, save_gaps(args.steps, args.every, after=True), t0)
    out.update(checkpoint_blocked_s=_median(c["blocked_s"] for c in commits),
               checkpoint_blocked_source="checkpoint_committed events (rank 0's blocked_s)",
               checkpoints=len(commits), checkpoint_upload_s=_median(c["total_s"] for c in commits),
               median_worker_step_time_s=_median(r["step_time_s"] for r in m[SKIP:]),
               final_loss=result.final_loss, status=result.status, wall_s=wall)
    return out


# ----------------------------------------------------------------------------- Ray Train
def ray_train_clean(data: str, storage: str, name: str, args) -> dict:
    """recovery.py's Ray Train train function, run without a fault."""
    import ray.train
    from ray.train.torch import TorchTrainer

    cfg = {**train_cfg(data, args), "log": os.path.join(storage, f"{name}.steps.jsonl")}
    trainer = TorchTrainer(
        recovery._rt_train_loop, train_loop_config=cfg,
        scaling_config=ray.train.ScalingConfig(num_workers=WORKERS, use_gpu=False, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=name, storage_path=storage,
                                       failure_config=ray.train.FailureConfig(max_failures=3)))
    t0 = time.time()
    res = trainer.fit()
    wall = time.time() - t0
    atts = recovery._attempts(recovery._read_log(cfg["log"]))
    steps = atts[-1]["steps"] if atts else []
    out = summarize({s["step"]: s["time"] for s in steps}, save_gaps(args.steps, args.every, after=False), t0)
    out.update(checkpoint_blocked_s=out["checkpoint_step_excess_s"],
               checkpoint_blocked_source="step gap with a DCP save + report minus the median gap without",
               checkpoints=len(save_gaps(args.steps, args.every, after=False)),
               final_loss=steps[-1]["loss"] if steps else None, attempts=len(atts),
               status="finished" if res.error is None else f"failed: {str(res.error)[:300]}", wall_s=wall)
    return out


# ----------------------------------------------------------------------------- torchrun
def _read_attempts(path: str) -> dict[int, dict]:
    """{restart count: {"starts": [...], "steps": [...]}} from the script's log."""
    out: dict[int, dict] = {}
    for rec in recovery._read_log(path):
        a = out.setdefault(rec["restart"], {"starts": [], "steps": []})
        a["starts" if rec["event"] == "start" else "steps"].append(rec)
    return out


def torchrun_command(nice: int) -> str:
    return " ".join([*(f"{k}={v}" for k, v in TORCHRUN_ENV.items()),
                     shlex.join(["nice", "-n", str(nice), "python", *TORCHRUN, os.path.relpath(WORKER),
                                 "--config", "cfg.json"])])


def torchrun(data: str, root: str, name: str, args, *, fault: bool) -> dict:
    """One torchrun launch of the plain script; with ``fault``, SIGKILL rank 1 after ``--fault-at``."""
    d = os.path.join(root, name)
    os.makedirs(d)
    cfg = {**train_cfg(data, args), "ckpt_dir": os.path.join(d, "ckpt"), "log": os.path.join(d, "steps.jsonl")}
    cfg_path = os.path.join(d, "cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    cmd = ["nice", "-n", str(args.torchrun_nice), sys.executable, *TORCHRUN, WORKER, "--config", cfg_path]
    env = {**os.environ, **TORCHRUN_ENV}
    t0 = time.time()
    # Its own session: on any failure the whole tree (agent + ranks) goes with one killpg.
    proc = subprocess.Popen(cmd, stdout=sys.stderr, stderr=sys.stderr, env=env, start_new_session=True)
    out: dict = {}
    try:
        deadline = t0 + recovery.RUN_TIMEOUT_S * 2
        if fault:
            while True:
                a0 = _read_attempts(cfg["log"]).get(0, {"starts": [], "steps": []})
                if a0["steps"] and a0["steps"][-1]["step"] >= args.fault_at and len(a0["starts"]) == WORKERS:
                    break
                if proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"torchrun {name} never reached step {args.fault_at} (rc {proc.poll()})")
                time.sleep(0.05)
            victim = next(s for s in a0["starts"] if s["rank"] == 1)
            fault_time = time.time()
            os.kill(victim["pid"], signal.SIGKILL)
            out["killed"] = {"rank": 1, "pid": victim["pid"], "after_step": a0["steps"][-1]["step"]}
            log(f"torchrun: killed rank 1 (pid {victim['pid']}) after step {a0['steps'][-1]['step']}")
        rc = proc.wait(timeout=max(1.0, deadline - time.time()))
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this function started
        proc.wait()
        raise
    wall = time.time() - t0
    atts = _read_attempts(cfg["log"])
    first, last = atts.get(0, {"steps": []}), atts[max(atts)] if atts else {"steps": []}
    out.update(status="finished" if rc == 0 else f"failed: torchrun exit code {rc}", restarts=max(atts, default=0),
               final_loss=last["steps"][-1]["loss"] if last["steps"] else None, wall_s=wall,
               command=torchrun_command(args.torchrun_nice))
    if not fault:
        out.update(summarize({s["step"]: s["time"] for s in first["steps"]},
                             save_gaps(args.steps, args.every, after=False), t0),
                   checkpoint_blocked_s=_median(s["ckpt_blocked_s"] for s in first["steps"]),
                   checkpoint_blocked_source="rank 0: get_state_dict + dcp.save, timed in the script",
                   checkpoints=sum(1 for s in first["steps"] if s["ckpt_blocked_s"] is not None))
        return out
    done_before = max((s["step"] for s in first["steps"] if s["time"] <= fault_time + 0.05), default=0)
    nxt = atts.get(1)
    if nxt is None or not nxt["starts"]:
        out.update(recovered=False, fault_to_kept_resumed_step_s=None, steps_lost=None)
        return out
    resumed_from = nxt["starts"][0]["resumed_from"]
    resumed = next((s for s in nxt["steps"] if s["step"] == resumed_from + 1), None)
    kept = next((s for s in last["steps"] if s["step"] == last["starts"][0]["resumed_from"] + 1), None)
    out.update(resumed_from_step=resumed_from, steps_lost=max(0, done_before - resumed_from),
               fault_to_restart_process_start_s=min(s["time"] for s in nxt["starts"]) - fault_time,
               fault_to_restart_ready_s=max(s["ready"] for s in nxt["starts"]) - fault_time,
               fault_to_resumed_step_s=resumed["time"] - fault_time if resumed else None,
               fault_to_kept_resumed_step_s=kept["time"] - fault_time if kept else None,
               recovered=rc == 0 and kept is not None)
    return out


# ----------------------------------------------------------------------------- report
METRICS = (("tokens_per_s", "tokens/s (steps without a save; min-max over rounds)", "{:,.0f}"),
           ("tokens_per_s_with_checkpoints", "tokens/s (all steps)", "{:,.0f}"),
           ("time_to_first_step_s", "launch to first step (s)", "{:.1f}"),
           ("checkpoint_blocked_s", "blocked per checkpoint (ms)", "ms"),
           ("checkpoint_step_excess_s", "step slowdown around a checkpoint (ms)", "ms"),
           ("recovery_s", "recovery: kill to first resumed step (s)", "{:.1f}"),
           ("steps_lost", "steps lost", "{:d}"), ("final_loss", "final loss", "{:.4f}"))
LABELS = {"rayflex": "rayflex", "ray_train": "Ray Train `TorchTrainer` (FSDP2 in the loop)",
          "torchrun": "`torchrun --max-restarts 3` (plain FSDP2 script)"}


def markdown(results: dict, by_round: dict) -> str:
    """The benchmarks/README.md table (medians over rounds; tokens/s with its min-max) and the
    round-by-round ratios of each peer to rayflex."""
    def fmt(v, spec):
        if v is None:
            return "-"
        return f"{v * 1e3:,.0f}" if spec == "ms" else spec.format(v)

    rows = ["| system | " + " | ".join(label for _, label, _ in METRICS) + " |", "|" + "---|" * (len(METRICS) + 1)]
    for system, r in results.items():
        cells = [fmt(r.get(key), spec) for key, _, spec in METRICS]
        lo_hi = r.get("spread", {}).get("tokens_per_s")
        if lo_hi:
            cells[0] += f" ({lo_hi[0]:,.0f}-{lo_hi[1]:,.0f})"
        rows.append(f"| {LABELS.get(system, system)} | " + " | ".join(cells) + " |")
    notes = []
    for system, ratios in by_round.items():
        tps = ratios.get("tokens_per_s")
        if system != "rayflex" and tps:
            notes.append(f"{system} / rayflex tokens/s round by round: {tps['median']:.2f} "
                         f"({tps['min']:.2f}-{tps['max']:.2f})")
    return "\n".join(rows) + ("\n\n" + "; ".join(notes) if notes else "")


def table_from(path: str) -> str:
    """The benchmarks/README.md table from a committed result (``--table-from benchmarks/results/compare.json``)."""
    with open(path) as f:
        got = json.load(f)
    return markdown(got["results"], got.get("ratios_vs_rayflex_by_round", {}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10, help="checkpoint interval in steps")
    ap.add_argument("--fault-at", type=int, default=None,
                    help="kill rank 1 after this step (default: every + every // 2)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds of clean runs")
    ap.add_argument("--skip-recovery", action="store_true", help="only the clean runs")
    ap.add_argument("--torchrun-nice", type=int, default=15,
                    help="niceness of the torchrun tree; 15 = Ray's default worker niceness, which the "
                         "rayflex and Ray Train workers run at (matters only on a busy machine)")
    ap.add_argument("--nodes", type=int, default=3, choices=(1, 2, 3),
                    help=f"Ray nodes the {CLUSTER_CPUS} CPUs of the loopback cluster are split over; 1: one "
                         "raylet, as on one host (torchrun --standalone); 3: three emulated hosts, whose "
                         "per-node daemons all run on this one")
    ap.add_argument("--adamw", default="default", choices=("default", "fused", "foreach", "for-loop"),
                    help="AdamW kernel: each system's own default (rayflex: fused; the peers: torch's, "
                         "the per-parameter loop on CPU), or one kernel for all (what remains is overhead)")
    ap.add_argument("--rayflex-upload", default="auto", choices=("auto", "thread", "process"),
                    help="rayflex's CheckpointConfig.upload (where an async save's bytes are written from)")
    ap.add_argument("--rayflex-live", action="store_true",
                    help="rayflex's recovery run as HSDP 2 x 2 (dp_shard=2): the killed rank's shard has a live "
                         "replica, and the restart resumes from the survivors' memory (live recovery)")
    ap.add_argument("--table-from", metavar="JSON", help="only print the benchmarks/README.md table of a committed result")
    ap.add_argument("--keep-dir", action="store_true", help="keep the temporary data, logs and checkpoints")
    ap.add_argument("--markdown", action="store_true", help="also print the markdown table to stderr")
    ap.add_argument("--out", help="also write the JSON here (Ray's driver log lines can share stdout)")
    args = ap.parse_args()
    recovery.ADAMW = args.adamw
    if args.table_from:
        if not os.path.isfile(args.table_from):
            ap.error(f"--table-from {args.table_from}: no such file; give a compare.py result, "
                     "e.g. benchmarks/results/compare.json")
        print(table_from(args.table_from))
        return
    args.fault_at = args.fault_at if args.fault_at is not None else args.every + args.every // 2
    args.rt_report_every_step = False  # recovery.run_ray_train reads it
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not systems or set(systems) - set(SYSTEMS):
        ap.error(f"--systems: choose from {','.join(SYSTEMS)}")
    if not args.skip_recovery and not args.every <= args.fault_at < args.steps:
        ap.error("--fault-at must be in [--every, --steps): the kill should come after a checkpoint")
    setup_logging()
    real_stdout, sys.stdout = sys.stdout, sys.stderr  # worker output Ray forwards to the driver: stderr
    from rayflex.data.dataset import write_synthetic_dataset

    t_start = time.time()
    tmp = tempfile.mkdtemp(prefix="rayflex-compare-")
    data = write_synthetic_dataset(f"file://{tmp}/data", num_samples=4096, seq_len=SEQ)
    results: dict = {s: {} for s in systems}
    recov: dict = {s: None for s in systems}
    cluster_start_s = lc = None

    def attempt(system: str, what: str, fn):
        log(f"--- {system}: {what}")
        try:
            r = fn()
        except Exception as e:  # noqa: BLE001 - one broken run must not hide the others
            log(f"{system} {what} failed: {type(e).__name__}: {e}")
            r = {"error": f"{type(e).__name__}: {e}"}
        log(f"{system} {what}: " + json.dumps(r, default=float)[:1500])
        return r

    load_before = os.getloadavg()
    rounds: dict[str, list] = {}
    try:
        ray_systems = [s for s in ("rayflex", "ray_train") if s in systems]
        rf_storage, rt_storage = f"file://{tmp}/rayflex", f"{tmp}/raytrain"
        os.makedirs(rt_storage, exist_ok=True)
        if ray_systems:
            t0 = time.time()
            lc = recovery.LoopbackCluster(nodes=args.nodes, cpus=CLUSTER_CPUS // args.nodes)
            cluster_start_s = time.time() - t0
        clean = {"rayflex": lambda r: rayflex_clean(data, rf_storage, f"rf-clean-{r}", args),
                 "ray_train": lambda r: ray_train_clean(data, rt_storage, f"rt-clean-{r}", args),
                 "torchrun": lambda r: torchrun(data, tmp, f"tr-clean-{r}", args, fault=False)}
        def clean_run(system: str, r: int) -> dict:
            got = attempt(system, f"clean run, round {r + 1}/{args.rounds}", lambda: clean[system](r))
            if system in ray_systems:
                got["after_run"] = lc.settle()
            return got

        rounds = alternate(systems, args.rounds, clean_run)
        if not args.skip_recovery:
            if "torchrun" in systems:
                recov["torchrun"] = attempt("torchrun", "kill rank 1", lambda: torchrun(data, tmp, "tr-kill", args,
                                                                                         fault=True))
            kill = {"rayflex": lambda: recovery.run_rayflex(lc, "kill_actor", data, rf_storage, "rf-kill", args,
                                                            dp_shard=2 if args.rayflex_live else None),
                    "ray_train": lambda: recovery.run_ray_train(lc, "kill_actor", data, rt_storage, "rt-kill", args)}
            for system in ray_systems:
                recov[system] = attempt(system, "kill rank 1", kill[system])
                recov[system]["after_run"] = lc.settle()
    finally:
        if lc is not None:
            lc.close()
        sys.stdout = real_stdout
        if args.keep_dir:
            log(f"run directories kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    for system in systems:
        results[system] = over_rounds(rounds[system], ROUND_KEYS)
    for system in systems:
        r, k = results[system], recov[system]
        if k is not None:
            r["recovery_s"] = k.get("fault_to_kept_resumed_step_s")
            r["steps_lost"] = k.get("steps_lost")
            r["recovery"] = k
    ratios, ratio_spread = {}, {}
    if "rayflex" in systems:
        base = results["rayflex"]
        for system in systems:
            ratios[system] = {key: (results[system].get(key) / base[key]
                                    if isinstance(results[system].get(key), (int, float)) and base.get(key) else None)
                              for key, _, _ in METRICS if key not in ("steps_lost",)}
            ratio_spread[system] = paired_ratios(rounds[system], rounds["rayflex"], ROUND_KEYS)
    command = shlex.join(["python", os.path.relpath(os.path.abspath(sys.argv[0])), *sys.argv[1:]])
    emit({"benchmark": "compare", "machine": machine(), "command": command,
          "workload": {"model": "gpt-4x128-v256", "gpt": GPT, "seq_len": SEQ, "global_batch": BATCH,
                       "tokens_per_step": TOKENS_PER_STEP, "workers": WORKERS, "steps": args.steps,
                       "checkpoint_every_steps": args.every, "fault": None if args.skip_recovery else
                       f"SIGKILL rank 1's process after step {args.fault_at}",
                       "optimizer": {"name": "AdamW", "kernel": recovery.ADAMW if recovery.ADAMW != "default"
                                     else "each system's default (rayflex: fused; peers: torch's)",
                                     "lr": recovery.LR, "betas": recovery.BETAS,
                                     "weight_decay": 0.0, "schedule": "cosine to 0.1 x lr",
                                     "grad_clip": recovery.CLIP},
                       "step_time": f"median wall-clock gap between finished steps after step {SKIP}, "
                                    "gaps containing a checkpoint save left out",
                       "ray_cluster": f"ray.cluster_utils.Cluster on 127.0.0.1, {args.nodes} node(s) x "
                                      f"{CLUSTER_CPUS // args.nodes} CPUs "
                                      "(rayflex and ray_train; started before their runs)",
                       "ray_cluster_start_s": cluster_start_s,
                       "rounds": args.rounds,
                       "run_order": f"{args.rounds} rounds of clean runs ({', '.join(systems)}), the Ray cluster "
                                    "up throughout; then the kill runs (torchrun, rayflex, Ray Train)",
                       "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
                       "rayflex": {"scaling": {"num_workers": WORKERS, "min_workers": 2, "max_workers": WORKERS},
                                   "checkpoint": f"async sharded DCP, keep 2, upload={args.rayflex_upload!r}",
                                   "max_failures": 3,
                                   "recovery_run_mesh": ("hsdp 2x2 (dp_shard=2): live recovery" if args.rayflex_live
                                                         else "fsdp 4")},
                       "ray_train": {"train_loop": "recovery._rt_train_loop (fully_shard, sync dcp.save + "
                                                   "ray.train.report(checkpoint=...) every interval)",
                                     "max_failures": 3},
                       "torchrun": {"command": torchrun_command(args.torchrun_nice),
                                    "env": TORCHRUN_ENV, "checkpoint": "sync dcp.save to a local dir, keep 2"},
                       "wall_s": time.time() - t_start},
          "results": results, "ratios_vs_rayflex": ratios,
          "ratios_vs_rayflex_by_round": ratio_spread}, out=args.out)
    if args.markdown:
        print(markdown({s: results[s] for s in systems}, ratio_spread), file=sys.stderr)


if __name__ == "__main__":
    main()
