"""Building modules on the ``meta`` device: shapes and dtypes, no memory, no init.

Initialisers on meta tensors must return at once. They would write values a meta tensor
does not have, and more: meta ``normal_``/``uniform_`` run a Python reference that imports
``torch._dynamo`` on first use — 1.5-2 s of CPU in every process that builds a model on
meta (every worker, the driver's contract check), for nothing.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


class SkipMetaInit(torch.overrides.TorchFunctionMode):
    """Initialisers (``torch.nn.init.*``, in-place random/fill tensor methods) called on a
    meta tensor return it unchanged; on any other tensor they run as usual."""

    INIT = {getattr(torch.nn.init, n) for n in (
        "uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
        "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
        "sparse_") if hasattr(torch.nn.init, n)}
    INIT |= {getattr(torch.Tensor, n) for n in (
        "normal_", "uniform_", "fill_", "zero_", "random_", "bernoulli_", "exponential_",
        "log_normal_", "cauchy_", "geometric_") if hasattr(torch.Tensor, n)}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.INIT:  # torch.nn.init passes its tensor by keyword
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Build on the meta device, initialisers skipped (see the module docstring)."""
    with torch.device("meta"), SkipMetaInit():
        yield
