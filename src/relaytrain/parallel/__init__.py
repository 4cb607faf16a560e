"""Parallelism on a device mesh: layout checks, FSDP2/HSDP, tensor/sequence, pipeline and context parallel."""

from relaytrain.parallel.dims import ParallelDims
from relaytrain.parallel.layout import resolve_dims, validate_layout
from relaytrain.parallel.parallel_model import ParallelModel, parallelize

__all__ = ["ParallelDims", "ParallelModel", "parallelize", "resolve_dims", "validate_layout"]
