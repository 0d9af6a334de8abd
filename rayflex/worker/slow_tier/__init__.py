"""Crossing the slow tier: how the replicas of an HSDP mesh (``dp_replicate`` groups, placed
by the planner so that each sits inside a fast tier) keep their weights in step.

* :mod:`.quantize` — blockwise int8 with per-block scales, and the error-feedback residual
  that carries what a quantization dropped to the next reduction.
* :mod:`.reduce` — :class:`ReplicateReducer`: the mean over the replicate group of a flat
  buffer, in fp32, bf16 or int8 (a reduce-scatter and an all-gather of int8 blocks), with the
  bytes it sent counted.
* :mod:`.hooks` — gradients reduced by that reducer every step (``CommConfig(replicate="int8")``):
  FSDP2 shards over ``dp_shard`` alone and its post-reduce-scatter hook averages each
  shard over the replicas.
* :mod:`.tier` — :class:`SlowTier`: the one object the training loop asks, per ``CommConfig``.
* :mod:`.diloco` — low-communication training (``replicate="diloco"``): the replica groups
  train apart for ``inner_steps`` and meet with an outer Nesterov step on the averaged
  pseudo-gradient, optionally one fragment of the model at a time (streaming).
"""
