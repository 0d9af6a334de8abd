"""Topology-aware placement of ranks on nodes: exact search, packer, lower bound, explanation."""
