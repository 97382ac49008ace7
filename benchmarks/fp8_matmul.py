"""The fp8 matmuls (quantization="fp8") against bf16's at the Llama-3-8B layer shapes, as the engine runs
them: K-major Fp8WeightT weights (q/k/v and gate/up fused), matmul_reference.fp8_matmul's W8A8-FP8 path
(per-token e4m3 activations, XLA's fp8 dot) and its weight-only path (the values upcast inside the dot),
and the bf16 dot (matmul_reference.matmul). The `fp8` section of benchmarks/kernel_bench.py:

  python benchmarks/kernel_bench.py --skip-checks --sections fp8 --fp8-rows 1,8,64,256,2048,4096 --out DIR

Each row prints the time, the FLOP rate against its ceiling (fp8 778 TFLOP/s for W8A8, bf16 645 for the
others) and the bytes read and written (weights + activations + output) per second, and its relative
error against the bf16 dot of the same fp8 weights dequantized (float32). Where the W8A8 line overtakes
the weight-only one is what EngineConfig.fp8_w8a8_min_rows should be.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jlight.core.quantization import Fp8Weight, quantize_fp8, transpose_to_kmajor
from jlight.pallas_kernels import matmul_reference

# [in, out] of each matmul of a Llama-3-8B layer, as the engine fuses them on one device
LLAMA3_8B_SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
DEFAULT_ROWS = "1,8,64,256,2048,4096"


def _weights(key, k, n, sets):
    """`sets` random bf16 [k, n] weights and their K-major fp8 versions, made on the device."""
    make = jax.jit(lambda key: (jax.random.normal(key, (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16))
    bf16 = [make(kk) for kk in jax.random.split(key, sets)]
    fp8 = [transpose_to_kmajor(jax.jit(quantize_fp8)(w), kinds=(Fp8Weight,)) for w in bf16]
    return bf16, fp8


def bench_fp8(rng, quick, reps, trials, *, time_call, rel_err, rates, fp8_rows=DEFAULT_ROWS, shapes=None):
    """Rows for kernel_bench.py's print_table: kernel, impl, seconds, flops, rate, ceiling, bw (bytes/s), rel_err.
    time_call, rel_err: kernel_bench.py's; rates: (bf16 FLOP/s, fp8 FLOP/s) ceilings."""
    bf16_rate, fp8_rate = rates
    shapes = shapes or ({"tiny": (128, 256)} if quick else LLAMA3_8B_SHAPES)
    row_counts = [1, 64] if quick else [int(r) for r in fp8_rows.split(",")]
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    rows, sets = [], 2
    for shape_name, (k, n) in shapes.items():
        w_bf16, w_fp8 = _weights(key, k, n, sets)
        dequantized = jnp.swapaxes(w_fp8[0].values_t, 0, 1).astype(jnp.float32) * w_fp8[0].scales  # [k, n]
        variants = {
            "bf16 dot": (matmul_reference.matmul, w_bf16, bf16_rate, 2),
            "fp8 W8A8 (e4m3 x e4m3), K-major": (lambda x, w: matmul_reference.fp8_matmul(x, w, w8a8=True), w_fp8, fp8_rate, 1),
            "fp8 weight-only (upcast in the dot), K-major": (
                lambda x, w: matmul_reference.fp8_matmul(x, w, w8a8=False), w_fp8, bf16_rate, 1),
        }
        for m in row_counts:
            xs = [jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16) for _ in range(sets)]
            want = np.asarray(jnp.dot(xs[0].astype(jnp.float32), dequantized))
            flops = 2 * m * k * n
            for name, (fn, weights, ceiling, weight_bytes) in variants.items():
                label = f"{shape_name} M={m} {k}x{n}"
                try:
                    err = None if weights is w_bf16 else rel_err(jax.jit(fn)(xs[0], weights[0]).astype(jnp.float32), want)
                    t = time_call(jax.jit(lambda xs, ws, fn=fn: [fn(x, w) for x, w in zip(xs, ws)]), (xs, weights), sets, trials)
                    moved = weight_bytes * k * n + 2 * m * k + 2 * m * n  # weights, bf16 activations in and out
                    rows.append(dict(kernel=f"fp8 {label}", impl=name, seconds=t, flops=flops, rate=flops / t,
                                     ceiling=ceiling, bw=moved / t, rel_err=err))
                except Exception as e:  # noqa: BLE001 - one failed variant must not lose the rest
                    rows.append(dict(kernel=f"fp8 {label}", impl=name, error=repr(e)[:300]))
    return rows

