"""Training data: token datasets, the deterministic global sampler, dataset writers."""
