"""Memory capacity: per-rank memory estimates, the layout search and pp="auto"."""
