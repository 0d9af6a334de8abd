"""The optimizer a run trains with: AdamW from ``OptimizerConfig``, whichever kernel, and the
global gradient norm the clipping uses."""

import pytest
import torch

import rayflex as rf
from rayflex.worker.parallelize import clip_grads_


def _model_after(implementation: str, steps: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    opt = rf.OptimizerConfig(lr=1e-2, weight_decay=0.1, implementation=implementation).build(model.parameters())
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(torch.randn(8, 16, generator=gen)).square().mean().backward()
        opt.step()
    return model


def test_every_implementation_trains_the_same_weights():
    """The kernel is a speed choice: fused, foreach and torch's per-parameter loop give the
    same weights (to float32 rounding) after the same steps."""
    loop = _model_after("for-loop")
    for implementation in ("fused", "foreach"):
        other = _model_after(implementation)
        for (name, a), b in zip(loop.named_parameters(), other.parameters()):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=f"{implementation}: {name}")


def test_default_is_fused():
    model = torch.nn.Linear(4, 4)
    opt = rf.OptimizerConfig().build(model.parameters())
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["fused"]


@pytest.mark.parametrize("max_norm", [1e-3, 1e3])
def test_clipping_matches_torch(max_norm):
    """Outside a process group the norm and the clipped gradients are torch's own."""
    torch.manual_seed(0)
    ours, theirs = (torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 8)
    for m in (ours, theirs):
        m(x).sum().backward()
    norm = clip_grads_(list(ours.parameters()), max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    for a, b in zip(ours.parameters(), theirs.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
