"""A cluster's links on one machine: emulated nodes, each on its own loopback address, in a
private network namespace whose loopback is shaped pair by pair (``links``: the plan and
the tc rules; ``bed``: the Ray cluster and its counters; ``python -m
rayflex.testing.linkbed``: run a command or a function on it)."""
