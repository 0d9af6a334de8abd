"""``rayflex run SPEC``: train a Trainer defined in a file or module, stopping gracefully on a signal.

SPEC is a Python file (``examples/gpt_small.py``) or ``module:attr`` defining ``trainer``
(a :class:`rayflex.Trainer`, or a function returning one).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from typing import Optional

from rayflex.errors import RayflexError


def add_subcommand(subparsers) -> None:
    r = subparsers.add_parser("run", help="train SPEC on the current Ray cluster (or a local one)")
    r.add_argument("spec", help="a .py file or module:attr defining `trainer`")
    r.add_argument("--set", action="append", metavar="KEY=VALUE",
                   help="override a config field, e.g. --set parallel.pp=2 (or =auto) --set run.steps=50")
    r.add_argument("--steps", type=int, help="shorthand for --set run.steps=N")
    r.add_argument("--name", help="shorthand for --set run.name=NAME")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.set_defaults(func=cmd_run)


def load_trainer(spec: str):
    """Import SPEC and return its Trainer (attribute ``trainer`` unless ``module:attr``)."""
    from rayflex.api.trainer import Trainer

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

        from rayflex.constants import CONTROLLER_NAMESPACE, controller_name

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
    from rayflex.local_ray import ensure_ray

    trainer.preflight()
    scaling = trainer.spec.scaling
    ensure_ray(scaling.num_workers * scaling.cpus_per_worker)
    with _GracefulStop(trainer.spec.run.name) as stop:
        result = trainer.fit(progress=not args.no_progress, checked=True)
    print(json.dumps({k: result.raw.get(k) for k in ("status", "steps_completed", "first_loss", "final_loss",
                                                       "tokens_per_s", "time_to_first_step_s", "run_dir")},
                     indent=2), flush=True)
    if stop.signum is not None and result.status == "stopped":
        return 128 + stop.signum
    return 0 if result.status == "finished" else 3
