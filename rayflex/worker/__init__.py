"""Inside one training worker process: the step loop, FSDP2/pipeline parallelization,
instrumentation, and the gloo abort that unblocks a collective on a dead peer."""
