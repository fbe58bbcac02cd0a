"""A synthetic regression task: a tiny model that trains in seconds on a CPU.

It exercises the whole training stack (registry, input order, optimizer,
checkpoints, BatchNorm statistics, the pipeline) without any dataset on disk,
so the binaries' end-to-end tests run anywhere.
"""
