"""Checkpoint replicas in the cluster's host memory (``CheckpointConfig.memory_replicas``):
per-node keepers (``keeper``), who replicates to whom (``peers``), the run's keeper set
(``keepers``), a rank's side (``client``) and DCP's reader and writer over them (``dcp_io``)."""
