"""Saves after an attempt's first reuse its DCP save plan (storage.dcp_io.SavePlanCache):
each still writes the state as it is at that step, and the cache goes with the attempt."""

from __future__ import annotations

import torch

from checkpoint_helpers import tiny_state


def test_later_saves_reuse_the_plan_and_still_write_the_current_values(tmp_path):
    from torch.distributed.checkpoint.planner import SavePlanner

    from rayflex.storage.checkpoint import AsyncCheckpointer

    root = f"file://{tmp_path}/ckpt"
    state = tiny_state(seed=1)
    model, opt = state.modules[0], state.optimizers[0]
    ckpt = AsyncCheckpointer(root, rank=0, use_async=True, keep=3)
    key = ckpt._plans.key
    for step in (3, 4, 5):
        if step > 3:  # new values under an unchanged plan
            model(torch.randn(2, 8)).sum().backward()
            opt.step()
        ckpt.save(state, step=step)
        [report] = ckpt.wait(timeout_s=60)
        assert report.get("committed"), report.get("error")
        assert key in SavePlanner._cached_metadata, "the plan of the first save is kept for the next"
    other = AsyncCheckpointer(f"file://{tmp_path}/other", rank=0)
    assert other._plans.key != key, "another attempt in this process plans for itself"

    fresh = tiny_state(seed=9)
    info = AsyncCheckpointer(root, rank=0).load_latest(fresh)
    assert info["step"] == 5
    for a, b in zip(model.parameters(), fresh.modules[0].parameters()):
        assert torch.equal(a, b), "the last save wrote the weights of its step, not the first save's"
    saved, loaded = opt.state_dict()["state"], fresh.optimizers[0].state_dict()["state"]
    assert all(torch.equal(saved[k][n], loaded[k][n]) for k in saved for n in saved[k])

    ckpt.close()
    assert not any(key in getattr(SavePlanner, name) for name in ckpt._plans._CACHES), "the attempt's plans go with it"
