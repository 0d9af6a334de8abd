"""The checkpoint path end to end: a rank's asynchronous, sharded save (``checkpointer``),
when a due save is taken (``save_timing``), what repeat saves reuse (``save_plan``), DCP's
writer and reader over object stores (``dcp_io``), the uploader process (``upload_process``),
the commit protocol (``manifest``), the commit of an emergency save the memory replicas'
keepers finish (``handoff``), checkpoints read outside training (``reader``), and copies in
the cluster's host memory (``replicas``). Object-store I/O itself is ``rayflex.storage``."""
