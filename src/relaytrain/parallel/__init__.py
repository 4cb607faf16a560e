"""Parallelism on a device mesh: layout checks, FSDP2/HSDP, tensor/sequence, pipeline and context parallel."""
