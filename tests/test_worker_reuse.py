"""A worker process reused by the next attempt under another rank checkpoints correctly.

Elastic restarts keep surviving processes and renumber them. DTensor caches sharding
decisions (in Python and in its C++ dispatch fast path) keyed by DeviceMesh equality, which
ignores which rank a process is: without clearing them, a process that was rank 0 and is
now rank 1 of an equal-looking mesh gets the old mesh back, its shards claim rank 0's
offsets, and DCP refuses the save ("invalid fill tensor-volume"). Plain processes, no Ray.
"""

import multiprocessing as mp
import socket

from conftest import SEQ_LEN, small_gpt



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(commands, answers):
    """One reusable worker process: runs TrainWorker methods sent by the test."""
    import os
    import traceback

    os.environ["RAYFLEX_NODE_IP"] = "127.0.0.1"
    from rayflex.actors.parallel import plan_mesh
    from rayflex.actors.worker import TrainWorker

    worker = None
    while True:
        cmd, args = commands.get()
        try:
            if cmd == "exit":
                answers.put("bye")
                return
            if cmd in ("new", "reconfigure"):
                spec, rank, world = args
                plan = plan_mesh(spec.model, spec.parallel, spec.data, world)
                if worker is None:
                    worker = TrainWorker(rank, spec, plan)
                else:
                    worker.reconfigure(rank, plan)
                out = rank
            elif cmd == "setup":
                out = worker.setup("127.0.0.1", args[0], restore=True)["step"]
            elif cmd == "run":
                worker.start(args[0])
                worker.join(120)
                st = worker.poll()
                out = {"state": st.state, "step": st.step, "error": st.error,
                       "checkpoint_errors": [c["error"] for c in st.checkpoints if c.get("error")]}
            elif cmd == "release":
                out = worker.release(30, 0)
        except Exception:  # noqa: BLE001 - the test prints it
            out = {"exception": traceback.format_exc()}
        answers.put(out)


ATTEMPTS = [[0, 1, 2, 3], [4, 5, 0, 1]]


def test_renumbered_process_checkpoints_its_own_shards(dataset_uri, tmp_path):
    import rayflex as rf

    def spec(steps):
        return rf.Trainer(model=small_gpt(n_layers=2),
                          data=rf.DataConfig(uri=dataset_uri, seq_len=SEQ_LEN, global_batch=12),
                          run=rf.RunConfig(name="reuse", storage=f"file://{tmp_path}/runs", steps=steps),
                          scaling=rf.ScalingConfig(num_workers=4, min_workers=1),
                          checkpoint=rf.CheckpointConfig(every_steps=2, keep=5)).spec

    ctx = mp.get_context("spawn")
    queues = [(ctx.Queue(), ctx.Queue()) for _ in range(1 + max(max(a) for a in ATTEMPTS))]
    procs = [ctx.Process(target=_serve, args=q, daemon=True) for q in queues]
    for p in procs:
        p.start()

    def each(order, cmd, args_of):
        for k, i in enumerate(order):
            queues[i][0].put((cmd, args_of(k)))
        return [queues[i][1].get(timeout=240) for i in order]

    try:
        # Processes 0-3 are ranks 0-3; then two fresh processes (4, 5) take ranks 0 and 1
        # and processes 0, 1 are renumbered to ranks 2 and 3 (what a growth restart does).
        created = set()
        for attempt, order in enumerate(ATTEMPTS):
            steps = 4 * (attempt + 1)
            s = spec(steps)
            for k, i in enumerate(order):
                queues[i][0].put(("reconfigure" if i in created else "new", (s, k, len(order))))
                created.add(i)
            [queues[i][1].get(timeout=240) for i in order]
            port = _free_port()
            restored = each(order, "setup", lambda k: (port,))
            assert restored == [steps - 4] * len(order), restored
            runs = each(order, "run", lambda k: (steps,))
            for r in runs:
                assert r.get("state") == "done" and r["step"] == steps, r
                assert not r["checkpoint_errors"], r["checkpoint_errors"][0][-600:]
            assert each(order, "release", lambda k: ()) == [True] * len(order)
    finally:
        for q, _ in queues:
            q.put(("exit", ()))
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()

    from rayflex.storage import manifest as mf

    root = f"file://{tmp_path}/runs/reuse/checkpoints"
    last = 4 * len(ATTEMPTS)
    assert mf.list_committed(root)[-1] == last
    assert mf.verify(root, last).world_size == len(ATTEMPTS[-1])
