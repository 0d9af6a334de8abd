"""The model contract, checked on the driver before any actor exists.

A ModelSpec that breaks the contract (a block returning a tuple, a loss that is not a
scalar, a block whose output the next one cannot take) otherwise fails inside a worker,
after Ray and the workers have started, often with a message about pipeline internals
(``Stage.forward() takes 2 positional arguments but 3 were given``). Here every block is
built on the ``meta`` device (shapes and dtypes, no memory, no initialisation cost) and a
meta batch of token ids runs through the blocks in order and into ``loss_fn``: what the
first training step does, in milliseconds, with errors that name the block.

The meta device has no data, so models with data-dependent operations (``.item()``,
boolean masks, ``nonzero``, ``unique``, host copies) cannot run there. Those are not
rejected: a ``NotImplementedError``, or a ``RuntimeError``/``TypeError`` whose message
mentions the meta device (``Tensor.item() cannot be called on meta tensors``, ``Tensor on
device cpu is not on the expected device meta!``, ``can't convert meta device type tensor
to numpy``), ends the check at that point with a debug log; everything before it has been
checked. Meta kernels also skip the dtype checks real kernels make (an int64 activation
into ``nn.Linear`` "works" on meta), so the dtype ``nn.Linear`` and convolutions receive is
checked against their weight's, as the CPU and CUDA kernels would.
"""

from __future__ import annotations

import inspect
import logging
import os
import re
import time
from typing import Any

import torch
from torch import nn

from rayflex.errors import ConfigError
from rayflex.models.meta import SkipMetaInit, on_meta

log = logging.getLogger(__name__)

# Batch of the meta forward when DataConfig.micro_batch is unset: more than 1, so a block
# that squeezes or mixes the batch dimension shows it; on meta the size costs nothing.
DEFAULT_BATCH = 2

_META_WORD = re.compile(r"\bmeta\b", re.IGNORECASE)
# What torch says when a block gets an input of the wrong shape or dtype (the hint is then
# about the block before it); anything else is a bug inside the block itself.
_INPUT_MISMATCH = re.compile(r"shape|size|dimension|\bdims?\b|mat1|mat2|dtype|scalar type|index out of range|"
                             r"must match|expected .*(tensor|input)", re.IGNORECASE)


class _MetaUnsupported(Exception):
    """The model cannot run on the meta device from here on; not the user's mistake."""


class _DtypeMismatch(Exception):
    def __init__(self, module: str, kind: str, got: torch.dtype, weight: torch.dtype):
        self.module, self.kind, self.got, self.weight = module, kind, got, weight
        super().__init__(f"{module} ({kind}) got {got} input but its weight is {weight}")


def cannot_run_on_meta(err: BaseException) -> bool:
    """Whether ``err`` says the meta device cannot run an operation (not a model bug)."""
    if isinstance(err, NotImplementedError):
        return True
    return isinstance(err, (RuntimeError, TypeError)) and bool(_META_WORD.search(str(err)))


def describe(value: Any) -> str:
    """A value as the messages show it: ``Tensor[2, 32, 64] float32``, ``tuple of 2 (...)``."""
    if isinstance(value, torch.Tensor):
        return f"Tensor[{', '.join(str(d) for d in value.shape)}] {str(value.dtype).removeprefix('torch.')}"
    if value is None:
        return "None"
    name = type(value).__name__
    article = "an" if name[:1].lower() in "aeiou" else "a"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe(v) for v in value[:4]) + (", ..." if len(value) > 4 else "")
        return f"{article} {name} of {len(value)} ({inner})"
    if isinstance(value, dict):
        return f"{article} {name} with keys {sorted(map(str, value))[:6]}"
    return f"{article} {name}"


def check_model_contract(model, *, batch: int, seq_len: int) -> None:
    """Raise ConfigError if ``model`` (a ModelSpec) breaks the block/loss contract.

    Runs token ids ``[batch, seq_len]`` (int64) through every block on the meta device,
    checks that each block returns one tensor that the next block takes, and that
    ``loss_fn(output, targets)`` returns a scalar floating-point tensor.
    """
    from rayflex.models.summary import ModelSummary

    t0 = time.perf_counter()
    if isinstance(model, ModelSummary):
        model = model.load()
    _check_gpt_positions(model, seq_len)
    with on_meta():
        try:
            _check(model, batch=batch, seq_len=seq_len)
        except _MetaUnsupported as why:
            log.debug("model contract of %s checked only up to %s: it cannot run on the meta device",
                      getattr(model, "name", "model"), why)
    log.debug("model contract of %s checked in %.3fs", getattr(model, "name", "model"), time.perf_counter() - t0)


def _check(model, *, batch: int, seq_len: int) -> None:
    x: Any = torch.zeros(batch, seq_len, dtype=torch.long)
    targets = torch.zeros(batch, seq_len, dtype=torch.long)
    what_in = f"the token ids ({describe(x)})"
    last = model.num_blocks - 1
    for i in range(model.num_blocks):
        block = _build(model, i)
        hooks = _watch_dtypes(block)
        try:
            with torch.no_grad():
                out = block(x)
        except _DtypeMismatch as err:
            src = "the token ids" if i == 0 else f"block {i - 1}"
            raise ConfigError(
                f"ModelSpec block {i}",
                f"its {err.module} ({err.kind}) received {str(err.got).removeprefix('torch.')} input from "
                f"{src} ({describe(x)}) but its weight is {str(err.weight).removeprefix('torch.')}",
                f"make {src} return {str(err.weight).removeprefix('torch.')} (cast with .to(...)) or give "
                f"block {i} matching parameter dtypes") from None
        except Exception as err:  # noqa: BLE001 - classified: meta limitation or a model bug
            if cannot_run_on_meta(err):
                raise _MetaUnsupported(f"block {i} ({type(err).__name__}: {_first_line(err)})") from err
            if not _INPUT_MISMATCH.search(str(err)):
                fix = f"fix block {i}'s forward: it raised at {_raised_at(err)}"
            elif i == 0:
                fix = "make block 0 take int64 token ids of shape [batch, seq_len]"
            else:
                fix = (f"make block {i - 1} return what block {i} takes (shape and dtype), "
                       f"or make block {i} accept {describe(x)}")
            if isinstance(err, TypeError) and "positional argument" in str(err):
                fix = f"give block {i} a forward(self, x) that takes exactly one tensor"
            raise ConfigError(f"ModelSpec block {i}",
                              f"forward on {what_in} raised {type(err).__name__}: {_first_line(err)}",
                              fix) from err
        finally:
            for h in hooks:
                h.remove()
        if not isinstance(out, torch.Tensor):
            role = "the head (last block)" if i == last else f"block {i}"
            raise ConfigError(
                f"ModelSpec block {i}", f"{role} returned {describe(out)}, not a single tensor",
                "return one tensor from forward(): blocks are chained one tensor at a time (a "
                "pipeline stage sends exactly one activation to the next); drop extra outputs or "
                "keep them as module state" + (", and return the logits" if i == last else ""))
        x, what_in = out, f"the output of block {i} ({describe(out)})"
    _check_loss(model.loss_fn, x, targets)


def _check_gpt_positions(model, seq_len: int) -> None:
    """rayflex's GPT has ``GPTConfig.seq_len`` learned positions; longer rows index past
    them, which the meta device does not notice (it reads no indices)."""
    from rayflex.models.gpt_config import gpt_config_of

    cfg = gpt_config_of(model)
    if cfg is not None and seq_len > cfg.seq_len:
        raise ConfigError("DataConfig.seq_len", f"seq_len={seq_len} is longer than the model's "
                          f"GPTConfig.seq_len={cfg.seq_len} (its learned positions)",
                          f"use DataConfig(seq_len<={cfg.seq_len}) or GPTConfig(seq_len>={seq_len})")


def _build(model, i: int) -> nn.Module:
    try:
        with SkipMetaInit():
            block = model.build_block(i)
    except Exception as err:  # noqa: BLE001 - classified: meta limitation or a model bug
        if cannot_run_on_meta(err):
            raise _MetaUnsupported(f"building block {i} ({type(err).__name__}: {_first_line(err)})") from err
        raise ConfigError(f"ModelSpec.build_block({i})", f"raised {type(err).__name__}: {_first_line(err)}",
                          f"make build_block accept every index 0..{model.num_blocks - 1}") from err
    if not isinstance(block, nn.Module):
        raise ConfigError(f"ModelSpec.build_block({i})", f"returned {describe(block)}, not a torch.nn.Module",
                          "return an nn.Module for each block index")
    return block


def _watch_dtypes(block: nn.Module) -> list:
    """Pre-hooks doing the input/weight dtype check the meta kernels leave out."""
    kinds = (nn.Linear, nn.modules.conv._ConvNd)
    hooks = []
    for name, mod in block.named_modules():
        if isinstance(mod, kinds) and isinstance(getattr(mod, "weight", None), torch.Tensor):
            def pre(m, args, _name=name or "block itself"):
                if args and isinstance(args[0], torch.Tensor) and args[0].dtype != m.weight.dtype:
                    raise _DtypeMismatch(_name, type(m).__name__, args[0].dtype, m.weight.dtype)
            hooks.append(mod.register_forward_pre_hook(pre))
    return hooks


def _check_loss(loss_fn, output: torch.Tensor, targets: torch.Tensor) -> None:
    field = "ModelSpec.loss_fn"
    shown = f"output {describe(output)} and targets {describe(targets)}"
    try:
        sig = inspect.signature(loss_fn)
    except (TypeError, ValueError):  # a builtin without a signature: just call it
        sig = None
    if sig is not None:
        try:
            sig.bind(output, targets)
        except TypeError as err:
            raise ConfigError(field, f"has signature {sig} but rayflex calls loss_fn(output, targets) "
                              f"({err})", "define loss_fn(output, targets) returning the mean loss "
                              "of the microbatch as a scalar tensor") from None
    try:
        with torch.no_grad():
            loss = loss_fn(output, targets)
    except Exception as err:  # noqa: BLE001 - classified: meta limitation or a model bug
        if cannot_run_on_meta(err):
            raise _MetaUnsupported(f"loss_fn ({type(err).__name__}: {_first_line(err)})") from err
        raise ConfigError(field, f"on the head's {shown} raised {type(err).__name__}: "
                          f"{_first_line(err)}", "make loss_fn(output, targets) accept the last block's "
                          "output and int64 targets of shape [batch, seq_len]") from err
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise ConfigError(field, f"returned {describe(loss)} on the head's {shown}; rayflex needs a scalar "
                          "tensor (it calls loss.backward())",
                          "reduce it to the mean loss of the microbatch, e.g. return loss.mean()")
    if not loss.is_floating_point():
        raise ConfigError(field, f"returned {describe(loss)}: backward needs a floating-point loss",
                          "compute the loss in a floating dtype, e.g. loss.float()")


def _raised_at(err: BaseException) -> str:
    """``file:line`` of the innermost frame outside torch that ``err`` passed through: the
    user's code that raised it (or called into torch with what torch refused)."""
    where, tb = "its forward", err.__traceback__
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if f"{os.sep}torch{os.sep}" not in name:
            where = f"{name}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0].rstrip(".") if text else type(err).__name__
