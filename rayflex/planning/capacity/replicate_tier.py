"""Which way across the replicate tier keeps a step compute-bound: the planner's advice
for ``CommConfig`` (``rayflex plan`` prints it under an HSDP choice).

The options, least approximate first, with the share of the fp32 all-reduce's bytes each
sends per step: the fp32 all-reduce (exact data parallelism), bf16 (half), int8 with error
feedback (a quarter and the scales), then DiLoCo with ever longer rounds (1/H of fp32's
per step, averaged over a round). The advice is the first whose seconds per step are at
most :data:`COMPUTE_BOUND_SHARE` of the step's compute; when none is, the last, said to
stay communication-bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

COMPUTE_BOUND_SHARE = 0.2
INT8_BYTES = (1 + 4 / 256) / 4  # int8 values and one fp32 scale per 256 (CommConfig.block), over fp32
DILOCO_ROUNDS = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class ReplicateAdvice:
    """The advised option: its configs (``comm``: CommConfig's fields, ``precision``:
    PrecisionConfig's), its modelled seconds per step on the replicate tier against the
    step's compute, and whether that keeps the step compute-bound."""

    label: str
    seconds_per_step: float
    compute_s: float
    compute_bound: bool
    comm: dict = field(default_factory=dict)
    precision: dict = field(default_factory=dict)

    def config(self) -> str:
        """The advice as the Python a user writes."""
        parts = []
        if self.comm:
            parts.append("CommConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.comm.items()) + ")")
        if self.precision:
            parts.append("PrecisionConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.precision.items()) + ")")
        return " + ".join(parts) or "the default (CommConfig())"


def _options():
    yield "the fp32 all-reduce", 1.0, {}, {}
    yield "a bf16 all-reduce", 0.5, {}, {"reduce_dtype": "bf16"}
    yield "int8 with error feedback", INT8_BYTES, {"replicate": "int8"}, {}
    for h in DILOCO_ROUNDS:
        yield f"DiLoCo, H={h}", 1.0 / h, {"replicate": "diloco", "inner_steps": h}, {}


def advise(compute_s: float, allreduce_s: float, share: float = COMPUTE_BOUND_SHARE) -> ReplicateAdvice:
    """``allreduce_s``: the modelled seconds of the fp32 replica all-reduce per step."""
    advice = None
    for label, fraction, comm, precision in _options():
        seconds = allreduce_s * fraction
        advice = ReplicateAdvice(label, seconds, compute_s, seconds <= share * compute_s, comm, precision)
        if advice.compute_bound:
            break
    return advice


def describe(advice: ReplicateAdvice) -> str:
    pct = 100 * advice.seconds_per_step / advice.compute_s if advice.compute_s else float("inf")
    if advice.comm or advice.precision:
        verdict = ("the first option that keeps the step compute-bound" if advice.compute_bound
                   else "still communication-bound: fewer replicas across the slow tier would help more")
        return (f"Replicate tier: {advice.label} costs {advice.seconds_per_step:.3f} s per step ({pct:.0f}% of "
                f"{advice.compute_s:.3f} s compute), {verdict} (<= {COMPUTE_BOUND_SHARE:.0%}): "
                f"{advice.config()}; docs/guides/slow-links.md.")
    return (f"Replicate tier: the fp32 all-reduce costs {advice.seconds_per_step:.3f} s per step ({pct:.0f}% of "
            f"{advice.compute_s:.3f} s compute): compute-bound as it is.")
