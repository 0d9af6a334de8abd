"""``rayflex run | plan | status | report | ckpt``.

SPEC is a Python file (``examples/gpt_small.py``) or ``module:attr`` defining ``trainer``
(a :class:`rayflex.Trainer`, or a function returning one).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import os
import sys
from typing import Optional

from rayflex.errors import RayflexError


def load_trainer(spec: str):
    """Import SPEC and return its Trainer (attribute ``trainer`` unless ``module:attr``)."""
    from rayflex.trainer import Trainer

    path, _, attr = spec.partition(":") if not os.path.exists(spec) else (spec, "", "")
    attr = attr or "trainer"
    if path.endswith(".py") or os.path.exists(path):
        if not os.path.exists(path):
            raise RayflexError(f"spec file {path!r} does not exist")
        mod_spec = importlib.util.spec_from_file_location("rayflex_user_spec", path)
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules["rayflex_user_spec"] = module
        mod_spec.loader.exec_module(module)
    else:
        module = importlib.import_module(path)
    if not hasattr(module, attr):
        raise RayflexError(f"{spec!r} defines no {attr!r}; define `{attr} = Trainer(...)` in it")
    obj = getattr(module, attr)
    if callable(obj) and not isinstance(obj, Trainer):
        obj = obj()
    if not isinstance(obj, Trainer):
        raise RayflexError(f"{spec}:{attr} is a {type(obj).__name__}, not a rayflex.Trainer")
    return obj


def _overrides(args) -> dict[str, str]:
    out = {}
    for item in args.set or []:
        key, eq, value = item.partition("=")
        if not eq:
            raise RayflexError(f"--set {item!r}: expected key=value, e.g. --set parallel.pp=2")
        out[key.strip()] = value.strip()
    if getattr(args, "steps", None) is not None:
        out["run.steps"] = str(args.steps)
    if getattr(args, "name", None):
        out["run.name"] = repr(args.name)
    return out


class _GracefulStop:
    """SIGTERM (``ray job stop``, a scheduler) or Ctrl-C: stop the run at the next step.

    The first signal asks the run's Controller to stop (every rank agrees on the step,
    a checkpoint is written, workers and placement groups are released) while ``fit()``
    keeps waiting for the result; a second signal exits at once. Only the main thread
    can install handlers; elsewhere this does nothing.
    """

    def __init__(self, run_name: str):
        self.run_name = run_name
        self.signum: Optional[int] = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "_GracefulStop":
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        import signal
        import threading

        if self.signum is not None:  # second signal: give up waiting
            self.__exit__()
            raise KeyboardInterrupt(f"signal {signum} while stopping run {self.run_name!r}")
        self.signum = signum
        print(f"rayflex: {signal.Signals(signum).name}: stopping run {self.run_name!r} at the next step "
              f"(a checkpoint is kept); send it again to exit now", file=sys.stderr, flush=True)
        # Not from inside the handler: it may interrupt a Ray call in the main thread.
        threading.Thread(target=self._request_stop, args=(signal.Signals(signum).name,), daemon=True).start()

    def _request_stop(self, signame: str, timeout_s: float = 60.0) -> None:
        import time

        import ray

        from rayflex.platform.controller import CONTROLLER_NAMESPACE, controller_name

        deadline = time.monotonic() + timeout_s
        while True:  # the signal may come before the Controller exists: retry briefly
            try:
                ray.get_actor(controller_name(self.run_name), namespace=CONTROLLER_NAMESPACE) \
                    .request_stop.remote(f"stopped by {signame}")
                return
            except Exception as e:  # noqa: BLE001 - not connected or no controller yet
                if time.monotonic() > deadline:
                    print(f"rayflex: could not ask run {self.run_name!r} to stop: {e}", file=sys.stderr,
                          flush=True)
                    return
                time.sleep(0.5)


def cmd_run(args) -> int:
    trainer = load_trainer(args.spec).with_overrides(_overrides(args))
    print(f"rayflex: run {trainer.spec.run.name!r} -> run directory {trainer.spec.run.run_dir}", flush=True)
    # Connect first: ray.init() installs its own SIGTERM handler (exit at once), which the
    # graceful one must replace. Storage and data are probed before Ray starts, as in fit().
    from rayflex.trainer import ensure_ray

    trainer._preflight()
    scaling = trainer.spec.scaling
    ensure_ray(scaling.num_workers * scaling.cpus_per_worker)
    with _GracefulStop(trainer.spec.run.name) as stop:
        result = trainer.fit(progress=not args.no_progress)
    print(json.dumps({k: result.raw.get(k) for k in ("status", "steps_completed", "first_loss", "final_loss",
                                                       "tokens_per_s", "time_to_first_step_s", "run_dir")},
                     indent=2), flush=True)
    if stop.signum is not None and result.status == "stopped":
        return 128 + stop.signum
    return 0 if result.status == "finished" else 3


def cmd_status(args) -> int:
    from rayflex.status import run_statuses

    rows = run_statuses(name=args.name, storage=args.storage)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
        return 0
    if not rows:
        print("no runs found" + (f" named {args.name!r}" if args.name else ""))
        return 1 if args.name else 0
    cols = ("name", "state", "step", "target_steps", "loss", "tokens_per_s", "world_size", "last_checkpoint",
            "restarts", "goodput")
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        vals = []
        for c in cols:
            v = r.get(c)
            if isinstance(v, float):
                v = f"{v:.4g}"
            elif isinstance(v, dict):
                v = v.get("step")
            vals.append(f"{str(v):>14}")
        print("  ".join(vals))
    return 0


def cmd_ckpt(args) -> int:
    from rayflex.storage import manifest as mf

    if args.action == "list":
        for step in mf.list_committed(args.uri):
            print(mf.step_dir(args.uri, step))
        return 0
    step = args.step if args.step is not None else mf.latest_committed(args.uri)
    if step is None:
        print(f"no committed checkpoint under {args.uri}", file=sys.stderr)
        return 1
    if args.action == "inspect":
        m = mf.read_manifest(args.uri, step)
        print(m.to_json())
        return 0
    try:
        m = mf.verify(args.uri, step, deep=True)
    except RayflexError as e:
        print(f"CORRUPT: {e}", file=sys.stderr)
        return 2
    print(f"ok: step {m.step}, {len(m.files)} files verified")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rayflex", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    r = sub.add_parser("run", help="train SPEC on the current Ray cluster (or a local one)")
    r.add_argument("spec", help="a .py file or module:attr defining `trainer`")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config field, e.g. --set parallel.pp=2 (or =auto) --set run.steps=50")
    r.add_argument("--steps", type=int, help="shorthand for --set run.steps=N")
    r.add_argument("--name", help="shorthand for --set run.name=NAME")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run)

    s = sub.add_parser("status", help="runs on the cluster and in a storage location")
    s.add_argument("name", nargs="?")
    s.add_argument("--storage", help="also list finished runs under this storage URI")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_status)

    c = sub.add_parser("ckpt", help="list, inspect or verify checkpoints")
    c.add_argument("action", choices=("list", "inspect", "verify"))
    c.add_argument("uri", help="checkpoint root, e.g. s3://bucket/runs/NAME/checkpoints")
    c.add_argument("--step", type=int)
    c.set_defaults(func=cmd_ckpt)

    for extra in _extra_commands():
        extra(sub)
    return p


def _extra_commands():
    """Subcommands living beside their feature (plan, report) register here."""
    out = []
    for modname in ("rayflex.platform.plan_cli", "rayflex.report"):
        try:
            mod = importlib.import_module(modname)
        except ImportError:
            continue
        if hasattr(mod, "add_subcommand"):
            out.append(mod.add_subcommand)
    return out


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except RayflexError as e:
        print(f"rayflex: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
