"""Testing aids shipped with rayflex: chaos runs and the single-process reference."""
