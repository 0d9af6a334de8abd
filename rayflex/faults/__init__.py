"""Fault handling: detecting dead, hung and slow ranks, preemption notices, and the
policies that decide what a fault means for the run."""
