"""Chaos runs: many faults of every kind during one training run, then invariants that
say nothing was lost (see ``run.py``; ``python -m rayflex.testing.chaos``)."""

from rayflex.testing.chaos.run import ChaosConfig, run_chaos
from rayflex.testing.chaos.schedule import KINDS, plan_faults

__all__ = ["ChaosConfig", "KINDS", "plan_faults", "run_chaos"]
