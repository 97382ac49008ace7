"""Where the Pallas kernels run: compiled for the GPU, or interpreted (CPU tests).

Interpret mode is the default off the GPU so that the same kernels run in CI on a
CPU machine; a call can still force either with its `interpret` argument.

Backend choice: the kernels use Pallas' Triton backend (deprecated in JAX 0.11, still
shipped and working in 0.10 and 0.11). Mosaic GPU was not used because (1) its
lowering needs the CUDA plugin, so nothing could be lowered or checked on the CPU
development machine, while Triton-backend kernels lower to Triton IR on CPU
(`jax.jit(...).trace(...).lower(lowering_platforms=("cuda",))`) and were checked
that way before each (rationed) GPU run; (2) the decode and GEMV shapes here have
1-16 query rows per program, below the 64-row wgmma tile Mosaic GPU's matmuls are
built on. Porting to Mosaic GPU is open work (see docs/BENCHMARKS.md, kernels).
"""
import jax


def default_interpret() -> bool:
    return jax.default_backend() != "gpu"


def resolve(interpret: bool | None) -> bool:
    return default_interpret() if interpret is None else interpret
