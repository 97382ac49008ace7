"""Attention and matmul kernels: each Pallas kernel beside its pure-XLA reference.

Model code calls only the kernels `jlight.pallas_kernels.dispatch` hands it; it never knows which
implementation runs.
"""
