"""Pieces of the Mosaic GPU kernels (paged_attention_mosaic.py) that are not attention-specific."""
import hashlib

import jax.numpy as jnp
from jax.experimental.pallas import mosaic_gpu as plgpu


def interpret_params():
    """Mosaic GPU's interpret mode (CPU tests): TMA copies, barriers and slots, buffers started as NaN."""
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams  # private in jax 0.10/0.11

    return InterpretGPUParams()


def kernel_name(prefix: str, **static) -> str:
    """A kernel's name, distinct for every distinct set of static parameters and the same in every process
    (so JAX's persistent cache still hits). Mosaic GPU names the kernel and its host entry point after it;
    unnamed, every kernel is `anonymous`, in profiles and in the errors of a stored executable."""
    digest = hashlib.sha256(repr(sorted(static.items())).encode()).hexdigest()[:12]
    return f"{prefix}_{digest}"


def swizzled_smem(shape, dtype):
    """A shared-memory tile in the swizzled layout that TMA and wgmma share: 128-byte swizzle, or the
    row's bytes where a row is shorter (an int8 row of head_dim 64, a float32 row of 8 tokens)."""
    swizzle = min(128, shape[-1] * jnp.dtype(dtype).itemsize)
    minor = swizzle // jnp.dtype(dtype).itemsize
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, minor)), plgpu.SwizzleTransform(swizzle)))


def upcast_tile(src, dst, interpreting: bool, wide: bool = True):
    """An int8 or fp8 shared-memory tile (a multiple of 64 rows) converted into dst's 16-bit dtype, exactly: read four
    bytes a thread at a time (the 8-bit wgmma layout: four consecutive values a thread), converted in
    registers, stored. wide=False reads through the 16-bit wgmma layout, two bytes at a time (int8 pools,
    whose 4-byte reads have not run on a GPU; over fp8 pools on the H200 the 2-byte reads were 2-7% slower)."""
    if interpreting or not wide:
        dst[...] = src[...].astype(dst.dtype)
    else:
        dst[...] = plgpu.load(src, (), layout=plgpu.Layout.WGMMA_8BIT).astype(dst.dtype)
