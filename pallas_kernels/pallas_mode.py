"""Where the Pallas kernels run: compiled for the GPU, or interpreted (CPU tests).

Interpret mode is the default off the GPU so that the same kernels run in CI on a
CPU machine; a call can still force either with its `interpret` argument.

Backends. Paged attention runs on Mosaic GPU (paged_attention_mosaic.py), JAX's maintained
backend: on the H200 it is 1.6x the Triton kernel at batch-64 decode and 1.5x at
prefill (docs/BENCHMARKS.md). CPU tests run it in Mosaic GPU's interpret mode (jax 0.10.2 and
0.11.2 have one: TMA copies, barriers and a race detector, but not wgmma on transposed or register
operands, so the kernel swaps in plain dots there) and lower its wgmma path for CUDA.

Still on Pallas' Triton backend (deprecated in JAX 0.11, shipped and working in 0.10 and 0.11),
each for a stated reason:
- the W8A16 GEMV paths (matmul_pallas.py: 1-4 rows on [in, out] weights, and the K-major GEMV that
  is the one-row default on GPU): a CUDA-core multiply-and-reduce. Mosaic GPU lowers matrix products
  only as wgmma on 64-row tiles (it has no lowering for a register-level dot); a K-major GEMV could be
  written there (TMA tiles, elementwise ops and row reductions in registers) but is not ported. The
  Triton version already reads a 4096x14336 layer at 82% of copy in one launch. A Mosaic GPU W8A16
  kernel for 8-64 rows (the transposed wgmma) beats XLA's dequantize-dot alone but loses in the
  engine, so it is not in the package (docs/BENCHMARKS.md keeps its figures).
- paged attention in float32 (paged_attention_pallas.py): wgmma takes float32 only as tf32; not
  ported. Over int8 KV pools the Mosaic GPU kernel takes pages of 32 and 64 tokens (6-9% faster
  than Triton at decode, ~20% at prefill); pages of 8 and
  16 stay on Triton, because one head's scales of such a page are 32 or 64 bytes and a Mosaic GPU
  TMA copy (lane semantics) must move a multiple of 128. The router
  (dispatch.mosaic_or_triton_attention) sends those inputs to the Triton kernel.
- the W8A8 and tensor-core W8A16 matmuls and the MoE grouped matmul: expressible in Mosaic GPU
  (int8 wgmma; JAX ships a Mosaic ragged dot), not yet ported. The W8A8 kernel already runs at
  1,258 TOP/s, 1.37x XLA's int8 dot on the same weights.
"""
import jax


def default_interpret() -> bool:
    return jax.default_backend() != "gpu"


def resolve(interpret: bool | None) -> bool:
    return default_interpret() if interpret is None else interpret
