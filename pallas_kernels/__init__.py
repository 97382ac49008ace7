"""Attention and matmul kernels: each Pallas kernel beside its pure-XLA reference.

Model code calls only `jlight.pallas_kernels.dispatch`; it never knows which
implementation runs.
"""
from jlight.pallas_kernels.batch_metadata import BatchMetadata

__all__ = ["BatchMetadata"]
