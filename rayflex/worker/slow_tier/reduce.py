"""The mean of a flat buffer over the replicate group: the one place the slow tier is crossed.

``fp32`` and ``bf16`` are an all-reduce in that dtype. ``int8`` is a reduce-scatter and an
all-gather of int8 blocks: each rank quantizes its buffer (with its error feedback), sends
chunk ``j`` to rank ``j`` (all-to-all), rank ``j`` averages the chunks it received in fp32,
quantizes its mean (with a second error feedback: what the owner's rounding lost) and
all-gathers it. A rank sends ``2 (R-1)/R`` of the buffer in int8 — the bytes of a ring
all-reduce, at a quarter of fp32's width — and no value is summed in int8.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from rayflex.worker.slow_tier.quantize import ErrorFeedback, dequantize, padded_length, quantize

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
WIRE_DTYPES = ("fp32", "bf16", "int8")


def ring_bytes(numel: int, element_bytes: float, ranks: int) -> int:
    """Bytes one rank sends in a ring all-reduce of ``numel`` values over ``ranks``."""
    return int(round(2 * (ranks - 1) / ranks * numel * element_bytes)) if ranks > 1 else 0


class ReplicateReducer:
    """Averages buffers over ``group`` (the ranks holding the same shard in every replica)
    sending ``wire`` values; counts what it sent (``take_bytes``) and what its
    quantization still owes (``residual_norm``)."""

    def __init__(self, group, wire: str = "fp32", block: int = 256) -> None:
        if wire not in WIRE_DTYPES:
            raise ValueError(f"wire must be one of {WIRE_DTYPES}, got {wire!r}")
        self.group = group
        self.wire = wire
        self.block = block
        self.ranks = dist.get_world_size(group) if group is not None else 1
        self._sent = ErrorFeedback()  # what this rank's quantization lost
        self._owned = ErrorFeedback()  # what its quantized mean of the chunk it owns lost
        self._bytes = 0

    def mean_(self, flat: torch.Tensor, key: str) -> torch.Tensor:
        """Replace ``flat`` (1-D) by its mean over the group; ``key`` names the buffer
        (a gradient bucket, a fragment) whose residuals carry to its next reduction."""
        if self.ranks == 1:
            return flat
        if self.wire == "int8":
            flat.copy_(self._int8_mean(flat, key))
            return flat
        wire = flat if flat.dtype == DTYPES[self.wire] else flat.to(DTYPES[self.wire])
        dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=self.group)
        wire.div_(self.ranks)
        if wire is not flat:
            flat.copy_(wire)
        self._bytes += ring_bytes(flat.numel(), wire.element_size(), self.ranks)
        return flat

    def start_mean_(self, flat: torch.Tensor, key: str) -> Callable[[], torch.Tensor]:
        """Start replacing ``flat`` by its mean in the background (fp32 and bf16 wires: one
        asynchronous all-reduce); returns the call that waits for it and returns ``flat``."""
        if self.ranks == 1:
            return lambda: flat
        if self.wire == "int8":
            raise ValueError("an int8 mean re-quantizes between its two collectives: it cannot run in the "
                             "background; use the fp32 or bf16 wire")
        wire = flat if flat.dtype == DTYPES[self.wire] else flat.to(DTYPES[self.wire])
        work = dist.all_reduce(wire, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        self._bytes += ring_bytes(flat.numel(), wire.element_size(), self.ranks)

        def wait() -> torch.Tensor:
            work.wait()
            wire.div_(self.ranks)
            if wire is not flat:
                flat.copy_(wire)
            return flat
        return wait

    def _int8_mean(self, flat: torch.Tensor, key: str) -> torch.Tensor:
        n, ranks, block = flat.numel(), self.ranks, self.block
        chunk = padded_length(-(-n // ranks), block)  # each rank owns one chunk of whole blocks
        wanted = torch.zeros(ranks * chunk, dtype=torch.float32, device=flat.device)
        wanted[:n] = flat
        wanted = self._sent.compensate(key, wanted)
        q, scales = quantize(wanted, block)
        self._sent.keep(key, wanted, dequantize(q, scales))
        # Reduce-scatter: chunk j of every rank to rank j.
        got_q = torch.empty_like(q)
        got_scales = torch.empty_like(scales)
        dist.all_to_all_single(got_q, q, group=self.group)
        dist.all_to_all_single(got_scales, scales, group=self.group)
        mine = dequantize(got_q, got_scales).view(ranks, chunk).sum(dim=0).div_(ranks)
        mine = self._owned.compensate(key, mine)
        q_mine, s_mine = quantize(mine, block)
        self._owned.keep(key, mine, dequantize(q_mine, s_mine))
        # All-gather: every rank's mean of its chunk.
        all_q = torch.empty(ranks * chunk, dtype=torch.int8, device=flat.device)
        all_scales = torch.empty(ranks * s_mine.numel(), dtype=s_mine.dtype, device=flat.device)
        dist.all_gather_single(all_q, q_mine, group=self.group)
        dist.all_gather_single(all_scales, s_mine, group=self.group)
        per_chunk = chunk * q.element_size() + scales.numel() // ranks * scales.element_size()
        self._bytes += 2 * (ranks - 1) * per_chunk
        return dequantize(all_q, all_scales)[:n].to(flat.dtype)

    def take_bytes(self) -> int:
        """Bytes this rank sent since the last call."""
        sent, self._bytes = self._bytes, 0
        return sent

    def residuals(self) -> dict[str, torch.Tensor]:
        """What the int8 roundings still owe, by ``sent.<key>`` / ``owned.<key>`` (the
        tensors themselves: a checkpoint of this rank reads them)."""
        return {f"{side}.{key}": r for side, fb in (("sent", self._sent), ("owned", self._owned))
                for key, r in fb.state().items()}

    def load_residuals(self, residuals: dict[str, torch.Tensor]) -> None:
        """Carry on from ``residuals`` (:meth:`residuals` of the same rank of the same mesh)."""
        for side, fb in (("sent", self._sent), ("owned", self._owned)):
            fb.load({name[len(side) + 1:]: r for name, r in residuals.items() if name.startswith(f"{side}.")})

    def residual_norm(self) -> float:
        """L2 norm of what the int8 reductions still owe (0 for fp32 and bf16)."""
        return float((self._sent.norm() ** 2 + self._owned.norm() ** 2) ** 0.5)
