"""Picks an implementation for each kernel: Pallas on GPU, the XLA reference elsewhere.

`attention_impl` / `matmul_impl` in the engine config override the choice
("auto", "reference", "pallas"; attention also "mosaic" or "triton"). Every implementation has the reference's signature:

  write_kv(k_cache, v_cache, layer, k, v, slot_mapping) -> (k_cache, v_cache)
  paged_attention(q, k_cache, v_cache, layer, md, *, scale, sliding_window, soft_cap=None, sinks=None) -> out
  matmul(x, w, out_dtype=None) -> y  (fp8 weights: W8A8-FP8 from `fp8_w8a8_min_rows` rows, weight-only below;
    GGUF block-quantized weights: the CPU kernel gguf_matmul_cpu up to `gguf_kernel_max_rows` rows, else the reference)
  write_latent(cache, layer, latent, slot_mapping) -> cache  (MLA; mla_reference.py)
  latent_attention(q_latent, q_rope, cache, layer, md, *, scale) -> out_latent  (MLA)
  causal_conv1d(x, weight, bias, conv_pool, layer, state_slots, md) -> (y, conv_pool)  (recurrent layers; ragged_scan.py)
  ssd_scan(x, dt, A, B, C, ssm_pool, layer, state_slots, md, *, chunk_size) -> (y, ssm_pool)  (Mamba-2; mamba_reference.py)
  ssm_update(x, dt, A, B, C, ssm_pool, layer, state_slots) -> (y, ssm_pool)  (Mamba-2, one token a row)
  delta_rule(q, k, v, g, beta, state_pool, layer, state_slots, md, *, chunk_size) -> (o, state_pool)  (gated DeltaNet; delta_rule_reference.py)
  delta_rule_update(q, k, v, g, beta, state_pool, layer, state_slots) -> (o, state_pool)  (gated DeltaNet, one token a row)
The recurrent layers' kernels have only their XLA references so far. On the CPU, steps of up to
`cpu_kernel_max_rows` tokens run attention in the C++ kernel paged_attention_cpu where it takes the inputs.

`moe_impl` names how MoE models compute their routed experts (models/moe.py: "auto", "pallas",
"ragged_dot", "gathered", "dense"); "auto" is resolved there, per call, from the grouped matmul the
kernels carry and the number of (token, expert) pairs. `grouped_matmul` is the Pallas grouped matmul
(grouped_matmul_pallas.py, jax.lax.ragged_dot's contract) for "pallas", and for "auto" on GPU.
"""
import functools
import math
from typing import Callable, NamedTuple

import jax

from jlight.core.gguf_weights import GGUF_WEIGHTS
from jlight.core.quantization import Fp8Weight, QuantizedWeight, W8A8Weight
from jlight.core.moe_impls import MOE_IMPLS
from jlight.pallas_kernels import (attention_reference, delta_rule_reference, gguf_matmul_cpu, mamba_reference, matmul_reference,
                                   mla_reference, paged_attention_cpu, ragged_scan)

IMPLS = ("auto", "reference", "pallas")
# Attention also names its Pallas backend: "pallas" (and "auto" on GPU) is the Mosaic GPU kernel
# where it takes the inputs, else the Triton one (PALLAS_ATTENTION says which is the default).
ATTENTION_IMPLS = IMPLS + ("mosaic", "triton")


class GroupedMatmul(NamedTuple):
    """The Pallas grouped matmul of the MoE experts and the shapes it takes."""
    matmul: Callable  # (rows [R, K], w [G, K, N] (int8 converted, MXFP4 expanded in registers), group_sizes [G], *, preferred_element_type) -> [R, N]
    fits: Callable  # (k, n) -> bool


class Kernels(NamedTuple):
    write_kv: Callable
    paged_attention: Callable
    matmul: Callable
    moe_impl: str = "auto"
    # MLA (DeepSeek) over its latent cache; only the XLA reference exists.
    write_latent: Callable = mla_reference.write_latent
    latent_attention: Callable = mla_reference.paged_latent_attention
    grouped_matmul: GroupedMatmul | None = None  # MoE experts' Pallas grouped matmul (moe_impl "pallas", "auto" on GPU)
    # Recurrent layers (hybrid models) over their state pools; only the XLA references exist.
    causal_conv1d: Callable = ragged_scan.causal_conv1d
    ssd_scan: Callable = mamba_reference.ssd_scan
    ssm_update: Callable = mamba_reference.ssm_update
    delta_rule: Callable = delta_rule_reference.chunked_delta_rule
    delta_rule_update: Callable = delta_rule_reference.delta_rule_update
    # (tokens, rows, KV heads) of a step -> a page-table width in positions at or under which the attention
    # runs a cheaper path for that step (0: none); the runner gives steps whose rows all fit it a table that
    # narrow. None: the attention has no such path.
    short_table_span: Callable | None = None
    # An unrolled layer loop traces and lowers layers alike once (models/module.call_layer) instead of each
    # layer anew; the program XLA compiles is the same once it inlines the calls.
    trace_layers_once: bool = True


def _check(name, impl, allowed=IMPLS):
    if impl not in allowed:
        raise ValueError(f"{name}={impl!r} is not one of {', '.join(allowed)}")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _use_pallas(impl: str) -> bool:
    return impl == "pallas" or (impl == "auto" and on_gpu())


def get_kernels(attention_impl: str = "auto", matmul_impl: str = "auto", moe_impl: str = "auto",
                sharded: bool = False, fp8_w8a8_min_rows: int = matmul_reference.FP8_W8A8_MIN_ROWS,
                cpu_kernel_max_rows: int = 0, gguf_kernel_max_rows: int = 0, fp8_prefill_qk: bool = False,
                trace_layers_once: bool = True) -> Kernels:
    """sharded: the engine runs under a mesh. There "auto"/"pallas" attention stays on the Triton
    kernel, the one measured under tp/ep meshes on H200s; the Mosaic GPU kernel has run on one GPU only.
    fp8_w8a8_min_rows (EngineConfig.fp8_w8a8_min_rows): fp8 weights run W8A8-FP8 in steps of at least
    this many rows and weight-only below, on every matmul_impl (XLA's fp8 dot: no Pallas fp8 kernel).
    cpu_kernel_max_rows: steps of at most this many tokens run paged_attention_cpu (with attention_impl "auto"),
    gguf_kernel_max_rows: steps of at most this many rows multiply GGUF block-quantized weights in gguf_matmul_cpu
    (the reference above); both C++ CPU kernels (cpu_ffi), loaded by the caller (0: the XLA reference).
    fp8_prefill_qk (EngineConfig.fp8_prefill_qk): where the Mosaic GPU prefill kernel runs over fp8 pools,
    it runs S = Q K^T on e4m3 queries (paged_prefill_mosaic's fp8_qk); other pools and kernels ignore it.
    trace_layers_once (EngineConfig.trace_layers_once): Kernels.trace_layers_once."""
    _check("attention_impl", attention_impl, ATTENTION_IMPLS)
    _check("matmul_impl", matmul_impl)
    if moe_impl not in MOE_IMPLS:
        raise ValueError(f"moe_impl={moe_impl!r} is not one of {', '.join(MOE_IMPLS)}")
    write_kv, attention = attention_reference.write_kv, attention_reference.paged_attention
    matmul = matmul_reference.matmul
    named = ("mosaic", "triton")
    backend = attention_impl if attention_impl in named else "triton" if sharded else PALLAS_ATTENTION
    short_table_span = None
    if attention_impl in named or _use_pallas(attention_impl):
        # GPU kernel modules load only when chosen.
        from jlight.pallas_kernels import paged_attention_mosaic, paged_attention_pallas

        write_kv, attention = paged_attention_pallas.write_kv, paged_attention_pallas.paged_attention
        if backend == "mosaic":
            attention = functools.partial(mosaic_or_triton_attention, fp8_qk=True) if fp8_prefill_qk \
                else mosaic_or_triton_attention
            # short contexts skip flash-decoding's combine
            short_table_span = paged_attention_mosaic.short_table_span
        attention = functools.partial(kernel_or_reference_attention, attention)
    elif attention_impl == "auto" and cpu_kernel_max_rows:
        attention = functools.partial(cpu_or_reference_attention, cpu_kernel_max_rows)
    # "auto" on GPU keeps XLA's matmuls but for W8A8: end to end on the H200 (Llama-3-8B shape,
    # int8 weights, batch-1 decode) XLA's fused dequantize-dot takes 4.49 ms per token against
    # 6.82 ms with the Pallas W8A16 kernels (docs/BENCHMARKS.md): a batch-1 step
    # pads to the 8-token bucket, which the GEMV path (<= 4 rows) does not take. The Pallas W8A8
    # kernel on K-major weights beats XLA's int8 dot from 64 rows (4096 rows: 382 vs 523 us on the
    # same weights, 900 us on [in, out] ones), so "auto" uses it there.
    # matmul_impl="pallas" selects every Pallas matmul.
    if _use_pallas(matmul_impl):
        # GPU kernel modules load only when chosen.
        from jlight.pallas_kernels import matmul_pallas

        matmul = matmul_pallas.matmul if matmul_impl == "pallas" else matmul_pallas.matmul_gpu_default
    if fp8_w8a8_min_rows < 0:
        raise ValueError(f"fp8_w8a8_min_rows={fp8_w8a8_min_rows} must be >= 0 (0: W8A8-FP8 at every step)")
    matmul = functools.partial(fp8_or, matmul, fp8_w8a8_min_rows)
    if gguf_kernel_max_rows:  # elsewhere GGUF weights (which only the CPU engine keeps) go to the reference
        matmul = functools.partial(gguf_or, matmul, gguf_kernel_max_rows)
    grouped = None
    if _use_pallas(moe_impl):
        # GPU kernel modules load only when chosen.
        from jlight.pallas_kernels import grouped_matmul_pallas

        grouped = GroupedMatmul(grouped_matmul_pallas.grouped_matmul, grouped_matmul_pallas.fits)
    return Kernels(write_kv, attention, matmul, moe_impl, grouped_matmul=grouped, short_table_span=short_table_span,
                   trace_layers_once=trace_layers_once)


def fp8_or(matmul, fp8_w8a8_min_rows: int, x, w, out_dtype=None):
    """fp8 weights to matmul_reference.fp8_matmul (W8A8-FP8 from fp8_w8a8_min_rows rows, weight-only
    below), every other weight to `matmul`."""
    if isinstance(w, matmul_reference.FP8_WEIGHTS):
        return matmul_reference.matmul(x, w, out_dtype, fp8_w8a8_min_rows=fp8_w8a8_min_rows)
    return matmul(x, w, out_dtype)


def gguf_or(matmul, max_rows: int, x, w, out_dtype=None):
    """GGUF block-quantized weights to the CPU kernel in steps of at most max_rows rows and to the
    reference (dequantize, XLA's dot) otherwise; every other weight to `matmul`."""
    if not isinstance(w, GGUF_WEIGHTS):
        return matmul(x, w, out_dtype)
    if math.prod(x.shape[:-1]) <= max_rows:
        return gguf_matmul_cpu.matmul(x, w, out_dtype)
    return matmul_reference.matmul(x, w, out_dtype)


def cpu_or_reference_attention(max_tokens: int, q, k_cache, v_cache, layer, md, *, scale, sliding_window=None,
                               soft_cap=None, sinks=None):
    """Steps of at most max_tokens tokens to paged_attention_cpu where it takes the inputs, the rest to the reference."""
    kw = dict(scale=scale, sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    if q.shape[0] <= max_tokens and paged_attention_cpu.takes(q, k_cache, sliding_window=sliding_window,
                                                              soft_cap=soft_cap, sinks=sinks):
        return paged_attention_cpu.paged_attention(q, k_cache, v_cache, layer, md, **kw)
    return attention_reference.paged_attention(q, k_cache, v_cache, layer, md, **kw)


# Which Pallas attention kernel "pallas"/"auto" runs on one device. The Mosaic GPU kernel, measured
# on the H200 (docs/BENCHMARKS.md): decode at batch 64 and 4k context 256 vs 421 us
# (Triton), at batch 8 59 vs 76 us, a 4096-token prefill 460 vs 684 us; 8B-shaped offline serving
# 2,368 vs 2,126 output tok/s. Inputs it does not take (float32; int8 KV pools with pages of 8 or 16
# tokens) go to the Triton kernel.
PALLAS_ATTENTION = "mosaic"


# The smallest sliding window the warp-specialized prefill kernel takes; smaller windows prefill in the
# decode kernel's 64-row blocks. On the H200 (docs/BENCHMARKS.md, Kernels) a 4096-token chunk with a
# 128-token window ran 125 us in the prefill kernel against 96 us in the blocks (a block's rows see two
# K/V steps, too few to fill its pipeline), and with a 4096-token window 295 against 582 us; windows
# between those are not measured.
PREFILL_KERNEL_MIN_WINDOW = 512


def mosaic_or_triton_attention(q, k_cache, v_cache, layer, md, *, soft_cap=None, sinks=None, fp8_qk: bool = False, **kw):
    """The Mosaic GPU kernels where they take the inputs, else the Triton kernel (float32, int8 pools
    with pages of 8 or 16, other sizes): prefill-shaped steps over 16-bit or fp8 pools run the
    warp-specialized prefill kernel (paged_prefill_mosaic.takes; on the H200 a 4096-token causal chunk
    at 486 TFLOP/s against the decode kernel's prefill blocks' 299, docs/BENCHMARKS.md), decode steps
    of 16 or more rows over fp8 pools the transposed fp8 decode kernel (paged_decode_mosaic.takes), every
    other step the Mosaic GPU attention (paged_attention_mosaic.supports: 16-bit floats, head_dim 64/128,
    pages of 8, 16, 32 or 64 tokens; int8 KV pools with pages of 32 or 64; fp8 pools). Both Mosaic
    kernels take every attention kind (a static sliding window, soft-capping, sink logits); the
    Triton kernel takes windows only, so a soft-capped or sink layer it would run goes to the XLA
    reference instead. fp8_qk: the prefill kernel over fp8 pools multiplies Q K^T in e4m3
    (paged_prefill_mosaic.fp8_queries); off everywhere else."""
    # GPU kernel modules load only when chosen.
    from jlight.pallas_kernels import paged_attention_mosaic, paged_attention_pallas, paged_decode_mosaic, paged_prefill_mosaic

    kinds = dict(soft_cap=soft_cap, sinks=sinks)
    window = kw.get("sliding_window")
    if paged_prefill_mosaic.takes(q, k_cache, md, window) and (window is None or window >= PREFILL_KERNEL_MIN_WINDOW):
        fp8_pools = k_cache.dtype == paged_prefill_mosaic.FP8_DTYPE
        return paged_prefill_mosaic.paged_attention(q, k_cache, v_cache, layer, md, fp8_qk=fp8_qk and fp8_pools, **kinds, **kw)
    if paged_decode_mosaic.takes(q, k_cache, md):
        return paged_decode_mosaic.paged_attention(q, k_cache, v_cache, layer, md, **kinds, **kw)
    if paged_attention_mosaic.supports(q, k_cache):
        return paged_attention_mosaic.paged_attention(q, k_cache, v_cache, layer, md, **kinds, **kw)
    if soft_cap is None and sinks is None:
        return paged_attention_pallas.paged_attention(q, k_cache, v_cache, layer, md, **kw)
    return attention_reference.paged_attention(q, k_cache, v_cache, layer, md, **kinds, **kw)


def kernel_takes_kinds(kernel, sliding_window, soft_cap, sinks) -> bool:
    """Whether `kernel` takes these attention kinds. Every Pallas kernel takes a static sliding window
    (a Python int or None), none a traced one (a scanned stack of layers whose windows differ: the
    kernels cut their K/V steps by the window while tracing). Logit soft-capping and sink logits:
    mosaic_or_triton_attention (the Mosaic GPU kernels; it sends what the Triton kernel would run to
    the reference), not the Triton kernel."""
    if sliding_window is not None and not isinstance(sliding_window, int):
        return False
    return getattr(kernel, "func", kernel) is mosaic_or_triton_attention or (soft_cap is None and sinks is None)


def kernel_or_reference_attention(kernel, q, k_cache, v_cache, layer, md, *, scale, sliding_window=None,
                                  soft_cap=None, sinks=None):
    """`kernel` where it takes the layer's attention kinds (kernel_takes_kinds), else the XLA
    reference on the same pools, so no kind is silently dropped on the GPU."""
    if not kernel_takes_kinds(kernel, sliding_window, soft_cap, sinks):
        return attention_reference.paged_attention(q, k_cache, v_cache, layer, md, scale=scale,
                                                   sliding_window=sliding_window, soft_cap=soft_cap, sinks=sinks)
    if soft_cap is None and sinks is None:  # the kernels' plain signature (the Triton kernel has no kinds)
        return kernel(q, k_cache, v_cache, layer, md, scale=scale, sliding_window=sliding_window)
    return kernel(q, k_cache, v_cache, layer, md, scale=scale, sliding_window=sliding_window, soft_cap=soft_cap,
                  sinks=sinks)


def kmajor_weight_types(matmul_impl: str) -> tuple:
    """The quantized weight types the engine stores K-major (quantization.transpose_to_kmajor) for
    its matmuls (never under a mesh: the sharding rules name the [in, out] layout): W8A8 weights
    for the Pallas kernel on the Pallas path; weight-only int8 when "auto" runs it on GPU, for XLA's
    dequantize-dot and the one-row Pallas GEMV. On the H200 the engine's 8-row decode step of the
    Llama-3-8B shape took 2.97 ms/token with K-major weights against 3.78 with [in, out] ones (bf16:
    4.60; docs/BENCHMARKS.md), e.g. the fused gate/up matmul 32.5 vs 47.7 us. fp8 weights on every
    backend: XLA's GPU fp8 gemm takes them K-major without a transpose (matmul_reference.fp8_matmul),
    and the CPU runs the same layout as the GPU."""
    kinds = (Fp8Weight,) + ((W8A8Weight,) if _use_pallas(matmul_impl) else ())
    if matmul_impl == "auto" and on_gpu():
        kinds += (QuantizedWeight,)
    return kinds
