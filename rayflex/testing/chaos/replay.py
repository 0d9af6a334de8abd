"""A fault-free replay of a run's attempts, and the comparison of final parameters.

The replay restarts at the same committed steps with the same world sizes as the run
did (read from its events), in plain local processes with no faults. Training math is
deterministic on CPU for a given mesh, so the two runs' final checkpoints must be equal
bit for bit; where they are not, the largest difference is reported.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Segment:
    world_size: int
    from_step: int
    to_step: int


def segments_from_events(events, total_steps: int) -> list[Segment]:
    """Each attempt that trained: (world size, the step it resumed from, where the next
    one resumed from — or the end). ``events``: typed events (or their stored dicts)."""
    from rayflex.telemetry import events as ev

    events = ev.as_events(events)
    first = next(e for e in events if isinstance(e, ev.PlanChosen))
    starts = [(first.world_size, 0)] + [(e.world_size, e.step) for e in events if isinstance(e, ev.CheckpointLoaded)]
    out = []
    for i, (world, start) in enumerate(starts):
        end = starts[i + 1][1] if i + 1 < len(starts) else total_steps
        if end > start:
            out.append(Segment(world, start, end))
    return out


def split_at_restores(segments: list[Segment]) -> list[Segment]:
    """Each segment cut at every step a later segment resumes from (same world size on both
    sides). A run can go back past the end of an attempt — the checkpoint that attempt
    resumed from was corrupted as the next fault struck, and the restart after that loaded
    an older one — and the replay, which saves only where its segments end, must have
    saved that older step too. A restart at the same world size continues bit for bit."""
    out = []
    for i, seg in enumerate(segments):
        cuts = sorted({later.from_step for later in segments[i + 1:] if seg.from_step < later.from_step < seg.to_step})
        bounds = [seg.from_step, *cuts, seg.to_step]
        out += [Segment(seg.world_size, a, b) for a, b in zip(bounds, bounds[1:])]
    return out


def replay(spec, segments: list[Segment], storage: str) -> str:
    """Run ``segments`` in order with no faults; returns the replay's checkpoint root."""
    from rayflex.testing.chaos.local_workers import LocalWorkerPool
    from rayflex.checkpoint import manifest as mf

    spec = dataclasses.replace(
        spec, run=dataclasses.replace(spec.run, storage=storage, name=f"{spec.run.name}-replay"),
        checkpoint=dataclasses.replace(spec.checkpoint, keep=10_000, every_steps=10**9, resume=True, uri=None))
    root = spec.checkpoint_uri
    with LocalWorkerPool(max(s.world_size for s in segments)) as pool:
        for seg in split_at_restores(segments):
            # The run resumed from ``from_step``: everything it had after that was rolled back
            # (a newer step it skipped as corrupted is withdrawn here as the run withdrew it).
            for newer in [c for c in mf.list_committed(root) if c > seg.from_step]:
                mf.quarantine(root, newer, f"the run went back to step {seg.from_step}")
            mf.clear_after(root, seg.from_step if seg.from_step > 0 else -1)
            got = pool.attempt(range(seg.world_size), spec, seg.to_step)
            if got["restored_step"] != seg.from_step:
                raise RuntimeError(f"replay of {seg}: restored step {got['restored_step']}, expected {seg.from_step}")
            bad = [r for r in got["runs"] if r["state"] != "done" or r["step"] != seg.to_step or r["checkpoint_errors"]]
            if bad:
                raise RuntimeError(f"replay of {seg} failed: {bad[0]}")
    return root


def load_full(step_uri: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, unsharded, keyed by its flattened name."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    from rayflex.checkpoint.dcp_io import CheckpointReader
    from rayflex.storage.fs import fsspec_kwargs

    # Explicit storage options (endpoint included): fsspec caches filesystems by their
    # arguments, and one made for an earlier endpoint must not be reused. No checkpoint_id:
    # DCP would reset the reader to it through a filesystem built without these options.
    reader = CheckpointReader(step_uri, **fsspec_kwargs(step_uri), skip_instance_cache=True)
    nested = _load_state_dict_from_keys(storage_reader=reader)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, obj) -> None:
        if isinstance(obj, dict):
            for k, v in obj.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, torch.Tensor):
            flat[prefix] = obj

    walk("", nested)
    return flat


def compare(a_uri: str, b_uri: str) -> dict:
    a, b = load_full(a_uri), load_full(b_uri)
    if set(a) != set(b):
        return {"same_keys": False, "only_run": sorted(set(a) - set(b))[:5], "only_replay": sorted(set(b) - set(a))[:5]}
    diffs = {k: float((a[k].double() - b[k].double()).abs().max()) if a[k].numel() else 0.0 for k in a}
    worst = max(diffs, key=diffs.get)
    return {"same_keys": True, "tensors": len(a), "bitwise_equal": all(torch.equal(a[k], b[k]) for k in a),
            "max_abs_diff": diffs[worst], "worst_tensor": worst}


def first_divergence(run_root: str, replay_root: str) -> dict:
    """Where a run and its replay part: every step both committed (the run keeps a few, the
    replay every segment's end), compared in order; the first that differs, with the last
    that was still equal."""
    from rayflex.checkpoint import manifest as mf

    common = sorted(set(mf.list_committed(run_root)) & set(mf.list_committed(replay_root)))
    equal_until = None
    for step in common:
        cmp = compare(mf.step_dir(run_root, step), mf.step_dir(replay_root, step))
        if not cmp.get("bitwise_equal", False):
            return {"compared_steps": common, "last_equal": equal_until, "first_different": step, **cmp}
        equal_until = step
    return {"compared_steps": common, "last_equal": equal_until, "first_different": None}
