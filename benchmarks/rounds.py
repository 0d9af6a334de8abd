"""The one throughput method of the comparison benchmarks (compare.py, overhead.py).

* Steady step time: the median wall-clock gap between consecutive *finished* steps of one
  uninterrupted attempt, the first ``SKIP`` steps (warm-up) and the gaps that contain a
  checkpoint save left out. Wall-clock gaps, not a system's own step timer: every system is
  measured the same way, whatever it counts as "a step" internally.
* Systems alternate in rounds (A B C A B C ...), so a slow minute of a shared machine hits
  every system; each figure is reported as the median over rounds with its spread
  (min, max), and each ratio to the reference system as the median and spread of the
  round-by-round ratios (a ratio of medians alone hides how much the rounds disagree).
* The machine's load average is recorded around every run.
"""

from __future__ import annotations

import os
import statistics
from typing import Callable, Iterable, Optional

SKIP = 2  # warm-up steps left out of the step-time median


def median_or_none(xs: Iterable) -> Optional[float]:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def step_figures(times: dict[int, float], ckpt_gaps: set[int], t_launch: float, tokens_per_step: int) -> dict:
    """Step-time figures from {step: wall time the step finished} of one uninterrupted attempt.
    ``ckpt_gaps``: steps whose gap from the previous step contains a checkpoint save."""
    gaps = {s: times[s] - times[s - 1] for s in times if s - 1 in times and s > SKIP}
    plain = median_or_none(g for s, g in gaps.items() if s not in ckpt_gaps)
    with_ckpt = median_or_none(g for s, g in gaps.items() if s in ckpt_gaps)
    overall = statistics.mean(gaps.values()) if gaps else None
    return {"tokens_per_s": tokens_per_step / plain if plain else None, "median_step_s": plain,
            "tokens_per_s_with_checkpoints": tokens_per_step / overall if overall else None,
            "time_to_first_step_s": times[min(times)] - t_launch if times else None,
            "checkpoint_step_excess_s": with_ckpt - plain if plain and with_ckpt is not None else None,
            "steps_completed": max(times) if times else 0}


def alternate(systems: list[str], rounds: int, run: Callable[[str, int], dict]) -> dict[str, list[dict]]:
    """``run(system, round)`` for every system in every round, in the order A B C A B C ...;
    each run's dict gains the 1-minute load average before it."""
    out: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(rounds):
        for system in systems:
            load = os.getloadavg()[0]
            got = run(system, r)
            got.setdefault("load_avg_1m_before", load)
            out[system].append(got)
    return out


def over_rounds(runs: list[dict], keys: Iterable[str]) -> dict:
    """One system's runs: each figure's median over the rounds, its (min, max), and the runs."""
    ok = [r for r in runs if "error" not in r]
    out: dict = {"rounds": runs, "spread": {}}
    if not ok:
        return {**out, "error": runs[0].get("error") if runs else "no run"}
    for key in keys:
        values = [r[key] for r in ok if isinstance(r.get(key), (int, float))]
        if values:
            out[key] = statistics.median(values)
            out["spread"][key] = [min(values), max(values)]
    return out


def paired_ratios(runs: list[dict], base_runs: list[dict], keys: Iterable[str]) -> dict:
    """Round by round, the system's figure over the reference's in the same round: median, min, max."""
    out = {}
    for key in keys:
        values = [a[key] / b[key] for a, b in zip(runs, base_runs)
                  if isinstance(a.get(key), (int, float)) and isinstance(b.get(key), (int, float)) and b[key]]
        if values:
            out[key] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                        "rounds": values}
    return out
