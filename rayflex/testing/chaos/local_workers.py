"""TrainWorkers in plain local processes (no Ray): a pool the caller drives rank by rank.

Used to replay a run's attempts without faults, and by tests that need exact control
over which process takes which rank. Processes are reused across attempts, as the
elastic controller reuses surviving actors.
"""

from __future__ import annotations

import traceback
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

from rayflex.testing.processes import ForkedContext


class _CallThreads:
    """Named threads kept for the process's life, each running the calls sent to it: the
    pool of call threads a Ray actor answers on, which outlive attempts."""

    def __init__(self) -> None:
        self._pools: dict[str, ThreadPoolExecutor] = {}

    def run(self, name: str, fn: Callable[[], Any]) -> Any:
        pool = self._pools.setdefault(name, ThreadPoolExecutor(1, thread_name_prefix=name))
        return pool.submit(fn).result()


def _serve(commands, answers) -> None:
    from rayflex.constants import set_node_ip

    set_node_ip("127.0.0.1")
    from rayflex.mesh.plan import plan_mesh
    from rayflex.worker.actor import cyclic_gc_paused
    from rayflex.worker.train_worker import TrainWorker

    worker, threads = None, _CallThreads()
    while True:
        cmd, args = commands.get()
        try:
            if cmd == "exit":
                answers.put("bye")
                return
            if cmd == "assign":  # take rank ``rank`` of a ``world``-rank attempt of ``spec``
                spec, rank, world = args
                plan = plan_mesh(spec.model, spec.parallel, spec.data, world)
                if worker is None:
                    with cyclic_gc_paused():  # as a Ray worker's start (rayflex.worker.actor)
                        worker = TrainWorker(rank, spec, plan)
                else:
                    worker.reconfigure(rank, plan)
                out = rank
            elif cmd == "setup":
                out = worker.setup("127.0.0.1", args[0], restore=True)["step"]
            elif cmd == "call":  # any method of the worker: (name, args, kwargs)
                name, call_args, call_kwargs = args
                out = getattr(worker, name)(*call_args, **call_kwargs)
            elif cmd == "call_on":  # the same, on a named thread kept across attempts
                thread, name, call_args, call_kwargs = args
                out = threads.run(thread, lambda: getattr(worker, name)(*call_args, **call_kwargs))
            elif cmd == "run":
                worker.start(args[0])
                worker.join(args[1])
                st = worker.poll()
                out = {"state": st.state, "step": st.step, "error": st.error,
                       "checkpoint_errors": [c["error"] for c in st.checkpoints if c.get("error")]}
            elif cmd == "release":
                out = worker.release(30, 0)
            else:
                raise ValueError(f"unknown command {cmd!r}")
        except Exception:  # noqa: BLE001 - the caller raises it with the traceback
            out = {"exception": traceback.format_exc()}
        answers.put(out)


class LocalWorkerPool:
    def __init__(self, size: int, timeout_s: float = 300):
        ctx = ForkedContext()
        self.timeout_s = timeout_s
        self._queues = [(ctx.Queue(), ctx.Queue()) for _ in range(size)]
        self._procs = [ctx.Process(target=_serve, args=q, daemon=True) for q in self._queues]
        for p in self._procs:
            p.start()

    def __enter__(self) -> "LocalWorkerPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def each(self, order: Sequence[int], cmd: str, args_of: Callable[[int], tuple]) -> list[Any]:
        """Send ``cmd`` to processes ``order`` (rank k gets ``args_of(k)``) and collect the answers."""
        for k, i in enumerate(order):
            self._queues[i][0].put((cmd, args_of(k)))
        answers = [self._queues[i][1].get(timeout=self.timeout_s) for i in order]
        for k, a in enumerate(answers):
            if isinstance(a, dict) and "exception" in a:
                raise RuntimeError(f"rank {k} ({cmd}) failed in its process:\n{a['exception']}")
        return answers

    def attempt(self, order: Sequence[int], spec, end_step: int) -> dict:
        """One attempt: processes ``order`` become ranks 0..n-1 of ``spec``, restore its
        newest checkpoint, train to ``end_step`` (saving there), and leave."""
        world = len(order)
        self.each(order, "assign", lambda k: (spec, k, world))
        # Rank 0 offers a port it already holds (as the controller asks it), never one merely free.
        port = self.each(order[:1], "call", lambda k: ("node_info", (), {}))[0]["port"]
        restored = self.each(order, "setup", lambda k: (port,))
        runs = self.each(order, "run", lambda k: (end_step, self.timeout_s))
        released = self.each(order, "release", lambda k: ())
        return {"restored_step": restored[0], "runs": runs, "released": released}

    def close(self) -> None:
        for q, _ in self._queues:
            try:
                q.put(("exit", ()))
            except Exception:  # noqa: BLE001 - already closed
                pass
        for p in self._procs:
            p.join(10)
            if p.is_alive():
                p.kill()
