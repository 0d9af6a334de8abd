"""The mesh arithmetic (torch-free): valid world sizes, pp options, per-rank batch,
the stage split and the MeshPlan a run attempt is built from."""
