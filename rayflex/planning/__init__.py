"""Pure planners: topology, communication cost model, placement, memory capacity
and the parallel-layout search. No Ray actors, no run-time state."""
