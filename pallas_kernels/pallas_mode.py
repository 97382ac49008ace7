"""Where the Pallas kernels run: compiled for the GPU, or interpreted (CPU tests).

Interpret mode is the default off the GPU so that the same kernels run in CI on a
CPU machine; a call can still force either with its `interpret` argument.

Backend choice: the kernels use Pallas' Triton backend (deprecated in JAX 0.11, still
shipped and working in 0.10 and 0.11), not Mosaic GPU, for two reasons:
(1) CPU testing. CI has no GPU, so every kernel must run in interpret mode there. A Triton-
backend kernel is written with plain ref loads/stores and dots, which the interpreter runs, so
the CI tests exercise the kernel's own indexing and masking. A Mosaic GPU kernel that is fast
on Hopper is built from TMA copies, barriers and wgmma (plgpu.copy_gmem_to_smem, plgpu.wgmma,
...), which interpret mode does not run; only its lowering could be checked on CPU (Mosaic GPU
does lower without a GPU in JAX 0.10.2: `jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`,
checked 2026-11-29; an earlier note here said it could not, which was wrong for this version).
(2) Shapes. Decode attention and the batch-1 GEMV have 1-16 rows per program, below the
64-row wgmma tile that Mosaic GPU's matmuls are built on; a port would compute the transposed
products (weights or K as the 64-row operand) and is open work (docs/BENCHMARKS.md, kernels).
"""
import jax


def default_interpret() -> bool:
    return jax.default_backend() != "gpu"


def resolve(interpret: bool | None) -> bool:
    return default_interpret() if interpret is None else interpret
