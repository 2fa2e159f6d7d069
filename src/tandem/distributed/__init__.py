"""Tensor parallelism on torch.distributed: process groups and collectives (parallel_state), and the
processes of ranks 1..N-1 that mirror rank 0's model steps (launcher); and the devices of data-parallel
replicas (data_parallel)."""
