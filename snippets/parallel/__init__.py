"""Library versions of the parallelisms built from scratch in snippets/scratch/: FSDP2, DTensor
tensor parallelism, torch.distributed.pipelining, applied to a plain model as TorchTitan does."""
