"""Check and time the Pallas kernels against their XLA references, JAX's bundled Pallas
paged_attention, and the roofline.

  python benchmarks/kernel_bench.py --out DIR          # GPU: correctness checks, then timings
  python benchmarks/kernel_bench.py --quick --out DIR  # CPU smoke run (interpret mode, tiny sizes)
  python benchmarks/kernel_bench.py --skip-checks --sections large_pool --out DIR   # attention on engine-sized pools

Timing: each measured executable runs the kernel on `reps` different input sets (unrolled
in one jit, so no host dispatch between launches and the working set exceeds L2), timed
with a host clock after block_until_ready; median of `trials` calls, divided by reps.
Roofline ceilings are the measured H200 numbers given in the brief (copy 3.70 TB/s,
bf16 645 TFLOP/s, int8 762 TOP/s); the copy bandwidth is also re-measured in the run.
"""
import argparse
import functools
import json
import os
import re
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from kernel_batches import random_batch, reference_attention  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402
import fp8_matmul  # noqa: E402

from jlight.pallas_kernels import attention_reference, matmul_reference  # noqa: E402
from jlight.pallas_kernels import matmul_pallas, paged_attention_mosaic, paged_attention_pallas, paged_prefill_mosaic  # noqa: E402
from jlight.core.quantization import (  # noqa: E402
    QuantizedWeight, W8A8Weight, quantize_int8, quantize_kv_pool, to_fp8_kv, transpose_to_kmajor)

COPY_BW = 3.70e12
BF16_RATE = 645e12
INT8_RATE = 762e12
FP8_RATE = 778e12


def time_call(fn, args, reps, trials, by_kernel=None):
    """Seconds per kernel launch of fn(*args), where one call runs `reps` kernels.

    On a GPU: the summed device time of every kernel the call launched, from CUPTI
    (`jax.experimental.mosaic.gpu.profiler.measure`), median over `trials` calls; this leaves
    out host dispatch, which the host-clock method below counts and which inflated the short
    GEMV times by up to ~20% in earlier runs. Elsewhere, or if CUPTI is unavailable: the host
    clock after block_until_ready, median of `trials` calls.
    """
    out = fn(*args)
    jax.block_until_ready(out)
    if jax.default_backend() == "gpu":
        try:
            from jax.experimental.mosaic.gpu import profiler

            _, per_call = profiler.measure(fn, aggregate=False, iterations=trials)(*args)
            totals = [sum(ms for _, ms in kernels) for kernels in per_call]
            if by_kernel is not None:  # seconds per launch of each kernel name (median call)
                median_call = sorted(per_call, key=lambda kernels: sum(ms for _, ms in kernels))[len(per_call) // 2]
                for name, ms in median_call:
                    by_kernel[name] = by_kernel.get(name, 0.0) + ms / 1e3 / reps
            return statistics.median(totals) / 1e3 / reps
        except Exception as e:  # noqa: BLE001 - fall back to the host clock, and say so once
            if not getattr(time_call, "warned", False):
                print(f"CUPTI timing unavailable ({e!r:.200}); using the host clock", flush=True)
                time_call.warned = True
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / reps


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


# ---------------------------------------------------------------- correctness

ATTENTION_KERNELS = dict(triton=paged_attention_pallas.paged_attention, mosaic=paged_attention_mosaic.paged_attention,
                         prefill=paged_prefill_mosaic.paged_attention,
                         # fp8 pools only: run_checks adds it to "prefill"'s fp8 cases
                         **{"prefill fp8 qk": functools.partial(paged_prefill_mosaic.paged_attention, fp8_qk=True)})


def check_attention(rng, dtype, group, head_dim, q_lens, ctx_lens, num_tokens, sliding_window=None, impl="triton",
                    page_size=16, soft_cap=None, sinks=False, pools=None):
    """One kernel against the reference on random inputs: (relative error, every real output written).
    pools="fp8": e4m3 K/V pools (the reference reads them as float32); sinks: random per-head sink logits."""
    num_kv_heads, num_layers = 2, 2
    num_pages = sum(-(-c // page_size) for c in ctx_lens) + 8
    md = random_batch(rng, q_lens, ctx_lens, page_size=page_size, num_pages=num_pages, num_tokens=num_tokens)
    shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
    k = jnp.asarray(rng.standard_normal(shape), dtype)
    v = jnp.asarray(rng.standard_normal(shape), dtype)
    if pools == "fp8":
        k, v = to_fp8_kv(k), to_fp8_kv(v)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)), dtype)
    layer = jnp.int32(1)
    kw = dict(scale=head_dim ** -0.5, sliding_window=sliding_window)
    if soft_cap is not None or sinks:
        kw.update(soft_cap=soft_cap, sinks=jnp.asarray(rng.standard_normal(num_kv_heads * group) * 2, jnp.float32) if sinks else None)
    f32 = lambda a: a.astype(jnp.float32)
    want = attention_reference.paged_attention(f32(q), f32(k), f32(v), layer, md, **kw)
    got = ATTENTION_KERNELS[impl](q, k, v, layer, md, **kw)
    n = int(md.query_start[-1])
    finite = bool(np.all(np.isfinite(np.asarray(got[:n], np.float32))))
    return rel_err(got[:n], want[:n]), finite


def attention_cases(quick):
    """The paged-attention check grid (also used by kv_int8_attention.py): tuples of
    (case, dtype, group, head_dim, q_lens, ctx_lens, num_tokens, sliding_window)."""
    cases = [
        ("decode ragged", [1] * 6, [1, 16, 17, 0, 300, 2047 if not quick else 90], 6),
        ("prefill+decode", [37, 1, 0, 16, 5], [37, 200, 0, 48, 700 if not quick else 70], 64),
        ("long prefill chunk", [256 if not quick else 40], [3000 if not quick else 100], 256 if not quick else 48),
    ]
    for dtype in (jnp.bfloat16, jnp.float32):
        for group in (1, 4, 8):
            for head_dim in (64, 128):
                for name, q_lens, ctx, t in cases:
                    yield name, dtype, group, head_dim, q_lens, ctx, t, None
    yield "sliding window 64", jnp.bfloat16, 4, 128, [1, 20], [500, 300], 24, 64


def mosaic_kind_cases(quick):
    """The Mosaic GPU kernels' extra check grid, bf16 q: the attention kinds (gpt-oss: sinks and a 128-token
    window; Gemma 2: soft-capping at 50 and a 4096-token window) and fp8 pools. Tuples of
    (case, group, head_dim, q_lens, ctx_lens, num_tokens, sliding_window, soft_cap, sinks, pools)."""
    decode = ([1] * 6, [1, 16, 17, 0, 300, 2047 if not quick else 90], 6)
    mixed = ([37, 1, 0, 16, 5], [37, 200, 0, 48, 700 if not quick else 70], 64)
    chunk = ([256 if not quick else 40], [3000 if not quick else 100], 256 if not quick else 48)
    return [
        ("decode sinks w128", 8, 64, *decode, 128, None, True, None),
        ("decode cap50 w4096", 2, 128, *decode, 4096, 50.0, False, None),
        ("decode fp8 all kinds", 4, 128, *decode, 128, 50.0, True, "fp8"),
        ("prefill+decode all kinds", 4, 128, *mixed, 128, 50.0, True, None),
        ("long chunk w1000", 4, 128, *chunk, 1000 if not quick else 30, None, False, None),
        ("long chunk fp8", 4, 128, *chunk, None, None, False, "fp8"),
        ("long chunk fp8 sinks w128", 8, 64, *chunk, 128 if not quick else 30, None, True, "fp8"),
        ("long chunk g1 cap50", 1, 128, *chunk, None, 50.0, False, None),
    ]


def run_checks(rng, quick, attention_impls=("triton", "mosaic"), matmuls=True, page_sizes=(16,)):
    rows = []
    for impl, page_size in ((impl, p) for impl in attention_impls for p in page_sizes):
        cases = [(name, dtype, group, head_dim, q_lens, ctx, t, window, None, False, None)
                 for name, dtype, group, head_dim, q_lens, ctx, t, window in attention_cases(quick)]
        if impl in ("mosaic", "prefill"):
            cases += [(name, jnp.bfloat16, *rest) for name, *rest in mosaic_kind_cases(quick)]
        for name, dtype, group, head_dim, q_lens, ctx, t, window, cap, sinks, pools in cases:
            if impl in ("mosaic", "prefill") and dtype != jnp.bfloat16:
                continue  # wgmma takes 16-bit floats; float32 stays on the Triton kernel
            if impl == "prefill" and t <= max(len(q_lens), 16):
                continue  # the prefill kernel takes prefill-shaped steps
            # the prefill kernel over fp8 pools also with e4m3 queries (fp8_qk)
            for kernel in [impl] + (["prefill fp8 qk"] if impl == "prefill" and pools == "fp8" else []):
                try:
                    err, finite = check_attention(rng, dtype, group, head_dim, q_lens, ctx, t, sliding_window=window,
                                                  impl=kernel, page_size=page_size, soft_cap=cap, sinks=sinks, pools=pools)
                except Exception as e:  # noqa: BLE001 - a kernel that fails to build is a failed check, not a lost run
                    err, finite = float("nan"), False
                    print(f"check attention {kernel} {name} failed: {e!r:.1500}", flush=True)
                    traceback.print_exc()
                rows.append(dict(kernel=f"attention {kernel}", case=f"{name} p{page_size}", dtype=jnp.dtype(dtype).name,
                                 group=group, head_dim=head_dim, rel_err=err, all_written=finite))
    if not matmuls:
        return rows
    for m, k, n in [(1, 4096, 14336), (7, 576, 1536), (512, 1536, 576), (4096, 4096, 1024)] if not quick else [(1, 128, 64), (20, 64, 48)]:
        x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
        w = quantize_int8(jnp.asarray(rng.standard_normal((k, n)), jnp.float32))
        w8 = W8A8Weight(*w)
        for name, fn, weight in (("w8a16", matmul_pallas.w8a16_matmul, w),
                                 ("w8a8 K-major", matmul_pallas.w8a8_matmul, transpose_to_kmajor([w8])[0])):
            got = fn(x, weight)
            want = matmul_reference.matmul(x.astype(jnp.float32), weight)
            rows.append(dict(kernel=name, case=f"{m}x{k}x{n}", dtype="bfloat16", rel_err=rel_err(got, want),
                             all_written=bool(np.all(np.isfinite(np.asarray(got, np.float32))))))
    return rows


# ---------------------------------------------------------------- timings

def bench_copy(reps, trials, quick):
    n = (1 << 20) if quick else (1 << 30)  # 2 GiB of bf16 on the GPU
    xs = [jnp.full((n,), i, jnp.bfloat16) + jnp.arange(n, dtype=jnp.bfloat16) for i in range(2)]
    fn = jax.jit(lambda a, b: (a * 1.5, b * 1.5))
    t = time_call(fn, xs, 2, trials)
    return dict(kernel="copy", impl="xla a*1.5", seconds=t, bytes=4 * n, bw=4 * n / t)


def bench_decode_attention(rng, quick, reps, trials, batch=64, page_size=16):
    """Decode attention at `batch` rows of 4k context in pages of `page_size` tokens; the knob sweeps and
    JAX's bundled kernel at batch 64 with 16-token pages only."""
    sweep = batch == 64 and page_size == 16 and not quick
    ctx, num_heads, num_kv_heads, head_dim = (4096, 32, 8, 128) if not quick else (64, 8, 2, 64)
    batch = batch if not quick else 4
    pages_per_seq = ctx // page_size
    num_pages = batch * pages_per_seq + 1
    md = random_batch(rng, [1] * batch, [ctx] * batch, page_size=page_size, num_pages=num_pages)
    shape = (1, num_pages, page_size, num_kv_heads, head_dim)
    key_k, key_v = jax.random.split(jax.random.PRNGKey(int(rng.integers(1 << 30))))
    k = jax.random.normal(key_k, shape, jnp.bfloat16)  # on the device: host draws of 0.5 GB were slow
    v = jax.random.normal(key_v, shape, jnp.bfloat16)
    qs = [jnp.asarray(rng.standard_normal((batch, num_heads, head_dim)), jnp.bfloat16) for _ in range(reps)]
    layer = jnp.int32(0)
    bytes_moved = 2 * batch * ctx * num_kv_heads * head_dim * 2
    scale = head_dim ** -0.5

    def many(attn):
        return jax.jit(lambda qs, k, v, md: [attn(q, k, v, layer, md) for q in qs])

    rows = []
    variants = {"xla reference": lambda q, k, v, l, md: attention_reference.paged_attention(q, k, v, l, md, scale=scale)}
    # A sweep of the kernel's launch knobs (the default first); the best one found on the
    # H200 becomes the default in paged_attention_pallas.py.
    # The 2026-11-29 12:21 sweep (pages/step 4/8/16 x warps 4/8 x stages 2/3/4, split-K 2/4) left
    # the default within 1% of the best; at 14:17, launching the KV heads of a sequence next to
    # each other (grid order) changed nothing, and converting int8 pages by exponent bits made the
    # int8 case 37% slower (docs/BENCHMARKS.md). The runner-up configs stay as a check.
    # The fifth session's sweep (2 or 8 pages a step, 2 warps, 3-4 stages) found nothing 1% better;
    # since 2026-12-01 only its two best configs stay as the Triton peers of the Mosaic GPU kernel.
    configs = [dict()]
    if sweep:
        configs += [dict(num_stages=3), dict(num_warps=2)]
    for cfg in configs:
        variants[f"pallas {cfg or 'default'}"] = (
            lambda q, k, v, l, md, cfg=cfg: paged_attention_pallas.paged_attention(q, k, v, l, md, scale=scale, **cfg))
    # The Mosaic GPU kernel (paged_attention_mosaic.py): its default, then its knobs (num_items=0: one
    # program per block and KV head, no split of the context, no combine).
    mosaic_configs = [dict()] + ([] if not sweep else [
        dict(num_stages=3), dict(kv_per_step=128, num_stages=1), dict(num_items=0)])
    for cfg in mosaic_configs:
        variants[f"mosaic {cfg or 'default'}"] = (
            lambda q, k, v, l, md, cfg=cfg: paged_attention_mosaic.paged_attention(q, k, v, l, md, scale=scale, **cfg))
    int8_bytes = 2 * batch * ctx * num_kv_heads * (head_dim + 4)  # int8 values + a float32 scale per token and head
    if sweep or quick:  # the Triton kernel on int8 pages
        kq, vq = quantize_kv_pool(k), quantize_kv_pool(v)
        variants["pallas int8 KV default"] = (
            lambda q, k, v, l, md: paged_attention_pallas.paged_attention(q, kq, vq, l, md, scale=scale))
    want = None  # the XLA reference's output on the first query set: every variant is checked against it
    for name, attn in variants.items():
        nbytes = int8_bytes if "int8 KV" in name else bytes_moved
        try:
            t = time_call(many(attn), (qs, k, v, md), reps, trials)
            got = jax.jit(attn)(qs[0], k, v, layer, md)
            want = got if want is None else want
            rows.append(dict(kernel=f"decode attention B={batch} ctx={ctx} page={page_size}", impl=name, seconds=t, bytes=nbytes,
                             bw=nbytes / t, rel_err=rel_err(got, want)))
        except Exception as e:  # a config that fails to compile is reported, not fatal
            traceback.print_exc()
            rows.append(dict(kernel="decode attention", impl=name, error=repr(e)[:300]))
        print_table(rows[-1:])  # as it comes (see bench_gemv)
        sys.stdout.flush()
    if sweep:
        from jax.experimental.pallas.ops.gpu import paged_attention as bundled
        # The bundled kernel wants [kv_heads, pages, page_size, head_dim] pools; converted outside the timing.
        kp, vp = k[0].transpose(2, 0, 1, 3), v[0].transpose(2, 0, 1, 3)
        tables, lengths = md.page_table, md.context_lens
        for cfg in (dict(), dict(k_splits=4, pages_per_compute_block=4)):
            fn = jax.jit(lambda qs, kp, vp, cfg=cfg: [bundled.paged_attention(q, kp, vp, tables, lengths, **cfg) for q in qs])
            try:
                t = time_call(fn, (qs, kp, vp), reps, trials)
                rows.append(dict(kernel=f"decode attention B={batch} ctx={ctx}", impl=f"jax bundled paged_attention {cfg or 'default'}",
                                 seconds=t, bytes=bytes_moved, bw=bytes_moved / t))
            except Exception as e:
                rows.append(dict(kernel="decode attention", impl="jax bundled", error=repr(e)[:300]))
    return rows


def prefill_shapes(quick):
    """(name, q_lens, context_lens, tokens) of the prefill section: one fresh causal chunk of each size,
    a 2048-token chunk over 14k tokens of earlier context, and a mixed step (a chunk beside 255 decode
    rows of 1k context each)."""
    if quick:
        return [("chunk T=64", [64], [64], 64)]
    return [(f"chunk T={n}", [n], [n], n) for n in (2048, 4096, 16384)] + [
        ("chunk T=2048 over 14336", [2048], [16384], 2048),
        ("mixed: 1793-token chunk + 255 decode rows at 1k", [1793] + [1] * 255, [1793] + [1024] * 255, 2048),
        # the engine's order (decode rows first): a batch-16 growth run's step at 16k
        ("mixed: 15 decode rows at 16k + 2048-token chunk over 14336", [1] * 15 + [2048], [16384] * 16, 2064)]


def _prefill_flops(q_lens, ctx_lens, num_heads, head_dim, window=None):
    """Useful FLOPs of QK^T and PV: a new token at position p sees p + 1 positions, or min(p + 1, window)."""
    total = 0
    for n, c in zip(q_lens, ctx_lens):
        seen = np.arange(c - n, c) + 1
        total += 4 * int(np.minimum(seen, window or seen.max()).sum()) * num_heads * head_dim
    return total


def bench_prefill_attention(rng, quick, reps, trials, cases=None, only=None):
    """Prefill attention's rate (useful FLOPs over device time), Llama-3-8B heads (32 / 8, d = 128):
    the Triton kernel, the decode kernel's prefill blocks and the warp-specialized prefill kernel over
    bf16 pools; the two Mosaic GPU paths over fp8 pools (kv_cache_dtype="fp8"), the prefill kernel there also
    with e4m3 queries (fp8_qk); and, on the 4096-token
    chunk and the chunk over earlier context, the attention kinds (a 4096-token window alone; Gemma 2's
    soft-capping with that window; gpt-oss's sinks with a 128-token window). The prefill kernel also runs with
    its blocks launched in reverse (mixed steps: decode rows last). cases: only the cases whose name contains one of these strings; only: the variants so named."""
    num_heads, num_kv_heads, head_dim, page_size = (32, 8, 128, 16) if not quick else (8, 2, 64, 16)
    scale = head_dim ** -0.5
    sinks = jnp.asarray(rng.standard_normal(num_heads), jnp.float32)
    kinds = {"window 4096": dict(sliding_window=4096), "gemma2 cap 50 + window 4096": dict(sliding_window=4096, soft_cap=50.0),
             "gpt-oss sinks + window 128": dict(sliding_window=128, sinks=sinks)}
    rows = []
    for case, q_lens, ctx_lens, tokens in prefill_shapes(quick):
        if cases and not any(c in case for c in cases):
            continue
        num_pages = sum(-(-c // page_size) for c in ctx_lens) + 1
        md = random_batch(rng, q_lens, ctx_lens, page_size=page_size, num_pages=num_pages, num_tokens=tokens)
        shape = (1, num_pages, page_size, num_kv_heads, head_dim)
        key_k, key_v = jax.random.split(jax.random.PRNGKey(int(rng.integers(1 << 30))))
        k = jax.random.normal(key_k, shape, jnp.bfloat16)  # on the device: host draws of 0.5 GB were slow
        v = jax.random.normal(key_v, shape, jnp.bfloat16)
        k8, v8 = to_fp8_kv(k), to_fp8_kv(v)
        qs = [jnp.asarray(rng.standard_normal((tokens, num_heads, head_dim)), jnp.bfloat16) for _ in range(reps)]
        causal = _prefill_flops(q_lens, ctx_lens, num_heads, head_dim)
        # name -> (fn of q, FLOPs, the variant its error is measured against)
        variants = {"triton": (lambda q: paged_attention_pallas.paged_attention(q, k, v, jnp.int32(0), md, scale=scale), causal, None),
                    "mosaic prefill blocks": (lambda q: paged_attention_mosaic.paged_attention(q, k, v, jnp.int32(0), md, scale=scale),
                                              causal, "triton")}
        # the default (128 positions a step, 2 slots: 160 KB of shared memory at head_dim 128 over bf16 pools)
        # and 64 x 2 (96 KB); 128 x 3 (224 KB) and 64 x 4 lost to the default at every shape on an H100
        # (docs/BENCHMARKS.md, Kernels)
        for cfg in ([dict()] if quick else [dict(), dict(kv_per_step=64)]):
            label = " ".join(f"{key}={value}" for key, value in cfg.items()) or "default"  # no commas: --prefill-variants
            variants[f"prefill kernel {label}"] = (
                lambda q, cfg=cfg: paged_prefill_mosaic.paged_attention(q, k, v, jnp.int32(0), md, scale=scale, **cfg), causal, "triton")
        if tokens <= 4096:
            variants["xla reference"] = (lambda q: attention_reference.paged_attention(q, k, v, jnp.int32(0), md, scale=scale),
                                         causal, "triton")
        variants["mosaic prefill blocks fp8 pools"] = (
            lambda q: paged_attention_mosaic.paged_attention(q, k8, v8, jnp.int32(0), md, scale=scale), causal, None)
        variants["prefill kernel fp8 pools"] = (
            lambda q: paged_prefill_mosaic.paged_attention(q, k8, v8, jnp.int32(0), md, scale=scale), causal,
            "mosaic prefill blocks fp8 pools")
        # the same pools with Q K^T in e4m3 (EngineConfig.fp8_prefill_qk); its error against the 16-bit product's
        variants["prefill kernel fp8 pools fp8 QK"] = (
            lambda q: paged_prefill_mosaic.paged_attention(q, k8, v8, jnp.int32(0), md, scale=scale, fp8_qk=True), causal,
            "prefill kernel fp8 pools")
        if case.startswith("mixed"):
            variants["prefill kernel blocks in reverse"] = (
                lambda q: paged_prefill_mosaic.paged_attention(q, k, v, jnp.int32(0), md, scale=scale, longest_first=False),
                causal, "triton")
        if quick or case in ("chunk T=4096", "chunk T=2048 over 14336"):
            for kind, kw in kinds.items():
                flops = _prefill_flops(q_lens, ctx_lens, num_heads, head_dim, kw.get("sliding_window"))
                variants[f"mosaic prefill blocks {kind}"] = (
                    lambda q, kw=kw: paged_attention_mosaic.paged_attention(q, k, v, jnp.int32(0), md, scale=scale, **kw), flops, None)
                variants[f"prefill kernel {kind}"] = (
                    lambda q, kw=kw: paged_prefill_mosaic.paged_attention(q, k, v, jnp.int32(0), md, scale=scale, **kw), flops,
                    f"mosaic prefill blocks {kind}")
        outputs = {}
        for name, (attn, flops, versus) in variants.items():
            if only and name not in only:
                continue
            try:
                fn = jax.jit(lambda qs, attn=attn: [attn(q) for q in qs])
                t = time_call(fn, (qs,), reps, trials)
                outputs[name] = got = np.asarray(fn(qs)[0][:sum(q_lens)], np.float32)
                row = dict(kernel=f"prefill attention {case}", impl=name, seconds=t, flops=flops, rate=flops / t)
                if versus in outputs:
                    row[f"rel_err_vs_{versus}"] = rel_err(got, outputs[versus])
                rows.append(row)
            except Exception as e:
                traceback.print_exc()
                rows.append(dict(kernel=f"prefill attention {case}", impl=name, error=repr(e)[:300]))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "flops"}), flush=True)
    return rows


def _device_int8_weights(key, k, n, sets):
    """Random int8 weights made on the device (host-side normal draws of 4096x14336 matrices
    took most of a 2026-11-29 run's time limit)."""
    keys = jax.random.split(key, sets)
    make = jax.jit(lambda key: QuantizedWeight(jax.random.randint(key, (k, n), -127, 128, jnp.int8),
                                               jax.random.uniform(key, (n,), jnp.float32, 1e-3, 2e-3)))
    return [make(kk) for kk in keys]


def _device_bf16_weights(key, k, n, sets):
    make = jax.jit(lambda key: jax.random.normal(key, (k, n), jnp.bfloat16))
    return [make(kk) for kk in jax.random.split(key, sets)]


# W8A16 variants per row count: M=1 takes the CUDA-core GEMV path; M=8 is a batch-1 decode
# step padded to the engine's 8-token bucket, which takes the tensor-core path. Tried on the H200
# on 2026-11-29 and dropped (docs/BENCHMARKS.md): at M=8, TF32 dots and the GEMV path (both
# slower); at M=1, weight tiles loaded ahead in the loop carry (slower at every shape).
GEMV_VARIANTS = {
    # M=1 since the fifth session: no pad of x (row block = 1). A single kernel (split 1, narrow
    # tiles for enough programs) leaves no split-K sum kernel either, so the call is one launch.
    1: {"pallas default": {},
        "pallas bn128 split1": dict(block_n=128, num_splits=1), "pallas bn64 split1": dict(block_n=64, num_splits=1),
        "pallas bn32 split1": dict(block_n=32, num_splits=1), "pallas bn16 split1": dict(block_n=16, num_splits=1),
        "pallas bn64 split2": dict(block_n=64, num_splits=2), "pallas bn128 split2": dict(block_n=128, num_splits=2),
        "pallas bn32 split1 4 warps": dict(block_n=32, num_splits=1, num_warps=4)},
    8: {"pallas default (tensor cores)": {}},
}


# The K-major W8A16 kernel (w8a16_kmajor_matmul, weights [N, K] as the engine stores them on GPU; 1-2 rows).
KMAJOR_VARIANTS = {}

# Its tile sweep (a CUDA-core GEMV: no 16-row tile, no split-K sum by default).
KMAJOR_GEMV_VARIANTS = {
    "pallas kmajor gemv default": dict(),  # matmul_pallas._kmajor_gemv_tiles, from this sweep
    "pallas kmajor gemv bn16 bk256": dict(block_n=16, block_k=256, num_splits=1),
    "pallas kmajor gemv bn16 bk512": dict(block_n=16, block_k=512, num_splits=1),
    "pallas kmajor gemv bn8 bk512": dict(block_n=8, block_k=512, num_splits=1),
    "pallas kmajor gemv bn32 bk256": dict(block_n=32, block_k=256, num_splits=1),
    "pallas kmajor gemv bn16 bk512 8 warps": dict(block_n=16, block_k=512, num_splits=1, num_warps=8),
    "pallas kmajor gemv bn32 bk512 8 warps": dict(block_n=32, block_k=512, num_splits=1, num_warps=8),
    "pallas kmajor gemv bn64 bk256 8 warps": dict(block_n=64, block_k=256, num_splits=1, num_warps=8),
    "pallas kmajor gemv bn16 bk256 6 stages": dict(block_n=16, block_k=256, num_splits=1, num_stages=6),
    "pallas kmajor gemv bn16 bk512 2 stages": dict(block_n=16, block_k=512, num_splits=1, num_stages=2),
    "pallas kmajor gemv bn16 bk512 auto splits": dict(block_n=16, block_k=512),
}


# The Llama-3-8B layers (gate, down, lm_head, wq/wo, wk/wv) and the fused ones the engine runs
# (q/k/v, gate/up: models/layers.fuse_projections).
GEMV_SHAPES = [(4096, 14336), (14336, 4096), (4096, 128256), (4096, 4096), (4096, 1024), (4096, 6144), (4096, 28672)]


# JAX's bundled Mosaic GPU mixed-type matmul computes int8 LHS x bf16 RHS on wgmma tiles, so it is
# run transposed: y^T = W^T (int8 [N, K], the 64-row operand) @ x^T (bf16 [K, 16]; tokens padded to
# 16, its smallest tile), then scaled per output channel. W^T is made once, outside the timing.
MIXED_CONFIGS = {"tk128 s4": (128, 4), "tk256 s4": (256, 4), "tk128 s8": (128, 8)}  # tk256 s6 exceeds shared memory


def bundled_mixed_matmul(tile_k, steps):
    from jax.experimental.pallas.ops.gpu import hopper_mixed_type_matmul_mgpu as mixed

    cfg = mixed.TuningConfig(tile_m=64, tile_n=16, tile_k=tile_k, max_concurrent_steps=steps, epi_tile_n=16,
                             epi_tile_m=64, wg_dimension=mixed.MatmulDimension.M)

    def fn(x, w_t, scales):  # x [M <= 16, K]; w_t int8 [N, K]; scales [N]
        xt = jnp.pad(x, ((0, 16 - x.shape[0]), (0, 0))).T  # [K, 16]
        yt = mixed.mixed_matmul_kernel(w_t, xt, out_dtype=jnp.float32, config=cfg)  # [N, 16]
        return (yt[:, : x.shape[0]].T * scales).astype(x.dtype)

    return fn


def bench_gemv(rng, quick, reps, trials, gemv_shapes=None, gemv_rows="1,8", gemv_splits=None, gemv_filter=None):
    """W8A16 at decode shapes (K x N as `gemv_shapes`, default GEMV_SHAPES), M = each of gemv_rows;
    only the variants whose name matches the regular expression gemv_filter, if given."""
    rows = []
    key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
    shapes = [(128, 256)] if quick else GEMV_SHAPES
    if gemv_shapes:
        shapes = [tuple(int(d) for d in shape.split("x")) for shape in gemv_shapes.split(",")]
    for k, n in shapes:
        # enough weight sets that one call streams >= 256 MB (past the 50 MB L2), at most 16
        sets = 2 if quick else max(2, min(16, -(-(256 << 20) // (k * n))))
        key, kw, kb = jax.random.split(key, 3)
        wq, wb = _device_int8_weights(kw, k, n, sets), _device_bf16_weights(kb, k, n, sets)
        # The same int8 weights stored transposed, [N, K]: for XLA's dequantize-dot and the bundled Mosaic GPU kernel.
        wq_k = transpose_to_kmajor(wq, kinds=(QuantizedWeight,))
        for m in (int(r) for r in gemv_rows.split(",")):
            variants = GEMV_VARIANTS.get(m, {})
            if gemv_splits:  # a split-K sweep of the default tiles instead of the named variants
                variants = {"pallas default": {}} | {f"pallas split{n}": dict(num_splits=int(n)) for n in gemv_splits.split(",")}
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
            int8_bytes = k * n + 4 * n + 2 * m * (k + n)
            cases = [("xla bf16 weights", matmul_reference.matmul, wb, 2 * k * n + 2 * m * (k + n)),
                     ("xla int8 reference", matmul_reference.matmul, wq, int8_bytes),
                     ("xla int8 reference, K-major weights", matmul_reference.matmul, wq_k, int8_bytes)]
            cases += [(name, lambda x, w, cfg=cfg: matmul_pallas.w8a16_matmul(x, w, **cfg), wq, int8_bytes)
                      for name, cfg in variants.items()]
            cases += [(name, lambda x, w, cfg=cfg: matmul_pallas.w8a16_kmajor_matmul(x, w, **cfg), wq_k, int8_bytes)
                      for name, cfg in ({} if gemv_splits else KMAJOR_VARIANTS | (KMAJOR_GEMV_VARIANTS if m <= 2 else {})).items()]
            if not quick and jax.default_backend() == "gpu":
                for name, (tile_k, steps) in MIXED_CONFIGS.items():
                    mm = bundled_mixed_matmul(tile_k, steps)
                    cases.append((f"jax bundled mixed-type matmul (Mosaic GPU, W^T) {name}",
                                  lambda x, w, mm=mm: mm(x, w.values_t, w.scales), wq_k, int8_bytes))
            if gemv_filter:
                cases = [case for case in cases if re.search(gemv_filter, case[0])]
            want = np.asarray(matmul_reference.matmul(x, wq[0], jnp.float32))
            for name, fn, weights, nbytes in cases:
                row = dict(kernel=f"w8a16 M={m} {k}x{n}", impl=name)
                try:
                    if weights is not wb:  # every int8 variant computes the same sums
                        row["rel_err"] = rel_err(fn(x, weights[0]).astype(jnp.float32), want)
                    kernels = {}
                    t = time_call(jax.jit(lambda x, ws, fn=fn: [fn(x, w) for w in ws]), (x, weights), sets, trials, kernels)
                    row.update(seconds=t, bytes=nbytes, bw=nbytes / t)
                    if kernels and name.startswith("pallas"):  # the kernel alone, without padding and split-K sums
                        main = sum(v for kname, v in kernels.items() if kname.startswith("w8a16"))
                        row.update(kernel_only_seconds=main, kernel_only_bw=nbytes / main if main else None)
                except Exception as e:  # noqa: BLE001 - one failed variant must not lose the rest
                    row["error"] = repr(e)[:300]
                rows.append(row)
                print_table([row])  # as it comes: a run cut off by its time limit keeps what it measured
                sys.stdout.flush()
        del wq, wb, wq_k
    return rows


def bench_gemm(rng, quick, reps, trials, gemm_rows="4096"):
    """W8A8 (and bf16 / fp8 peers) at a 4096 x 14336 layer, M = each of gemm_rows (prefill chunks
    and, at 8 or 64 rows, decode steps)."""
    rows = []
    k, n = (4096, 14336) if not quick else (128, 256)
    ws = [quantize_int8(jnp.asarray(rng.standard_normal((k, n), np.float32), jnp.bfloat16)) for _ in range(2)]
    w_bf16 = [jnp.asarray(rng.standard_normal((k, n), np.float32), jnp.bfloat16) for _ in range(2)]
    w8 = [W8A8Weight(*w) for w in ws]
    w8_t = transpose_to_kmajor(w8)  # [N, K], K-major: Hopper's 8-bit wgmma wants both operands contiguous along K
    ws_t = transpose_to_kmajor(ws, kinds=(QuantizedWeight,))
    # The same weights in e4m3 (int8 range mapped onto e4m3's +-448), scales adjusted to match.
    w_f8 = [((w.values.astype(jnp.float32) * (448.0 / 127.0)).astype(jnp.float8_e4m3fn), w.scales * (127.0 / 448.0)) for w in w8]

    def fp8_dot(x, w):  # per-token e4m3 activations, f32 sums, both scales after
        values, scales = w
        xs = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1, keepdims=True) / 448.0
        xq = (x / xs).astype(jnp.float8_e4m3fn)
        return (jnp.dot(xq, values, preferred_element_type=jnp.float32) * xs * scales).astype(x.dtype)

    pallas = lambda cfg: (lambda x, w: matmul_pallas.w8a8_matmul(x, w, **cfg))
    for m in [int(r) for r in gemm_rows.split(",")] if not quick else [64]:
        xs = [jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16) for _ in range(2)]
        flops = 2 * m * k * n
        gemm = {
            "xla bf16 dot": (matmul_reference.matmul, w_bf16, BF16_RATE),
            "xla w8a8 reference, [in, out] weights": (matmul_reference.matmul, w8, INT8_RATE),
            "xla w8a8 reference, K-major weights": (matmul_reference.matmul, w8_t, INT8_RATE),
            "pallas w8a8 K-major (default tiles)": (pallas({}), w8_t, INT8_RATE),
            # weight-only int8 (bf16 activations, so the bf16 rate is its ceiling) in both layouts: the
            # engine stores it K-major on GPU since 2026-11-29, measured then at decode sizes only
            "xla int8 weight-only, [in, out] weights": (matmul_reference.matmul, ws, BF16_RATE),
            "xla int8 weight-only, K-major weights": (matmul_reference.matmul, ws_t, BF16_RATE),
        }
        if m >= 1024 and not quick:  # the K-major tile sweep of 2026-11-29
            for cfg in (dict(block_n=128, num_warps=8), dict(block_n=256, num_warps=8), dict(block_m=256, num_warps=8),
                        dict(block_k=64, num_stages=4), dict(num_stages=4), dict(block_n=64)):
                gemm[f"pallas w8a8 K-major {cfg}"] = (pallas(cfg), w8_t, INT8_RATE)
            gemm["xla fp8 e4m3 dot (per-token x, scaled after)"] = (fp8_dot, w_f8, FP8_RATE)
        elif not quick:  # decode-sized steps: narrower tiles for more programs
            for cfg in (dict(block_n=64), dict(block_n=32), dict(block_n=64, num_stages=4)):
                gemm[f"pallas w8a8 K-major {cfg}"] = (pallas(cfg), w8_t, INT8_RATE)
        # Each variant against XLA on the same numbers: W8A8's exact int32 sums, or weight-only int8's.
        want_w8a8 = np.asarray(matmul_reference.matmul(xs[0], w8[0], jnp.float32))
        want_w8a16 = np.asarray(matmul_reference.matmul(xs[0], ws[0], jnp.float32))
        for name, (fn, weights, ceiling) in gemm.items():
            try:
                want = None if weights is w_bf16 else want_w8a16 if weights is ws or weights is ws_t else want_w8a8
                err = None if want is None else rel_err(jax.jit(fn)(xs[0], weights[0]).astype(jnp.float32), want)
                t = time_call(jax.jit(lambda xs, ws, fn=fn: [fn(x, w) for x, w in zip(xs, ws)]), (xs, weights), 2, trials)
                rows.append(dict(kernel=f"gemm M={m} {k}x{n}", impl=name, seconds=t, flops=flops, rate=flops / t,
                                 ceiling=ceiling, rel_err=err))
            except Exception as e:  # noqa: BLE001 - one failed variant must not lose the rest
                rows.append(dict(kernel=f"gemm M={m}", impl=name, error=repr(e)[:300]))
            print_table(rows[-1:])
            sys.stdout.flush()
    return rows


def bench_large_pool(rng, quick, reps, trials, pool=(32, 17922, 256, 1024), impls=("mosaic", "triton")):
    """Decode attention on an engine-sized pool (page offsets past 2^31 elements at the default size): each
    kernel against the XLA reference at the first, middle and last layer, and its time (host clock, 10 calls
    back to back). The kernel checks above use pools sized to the test."""
    layers, pages, batch, context = (2, 40, 3, 50) if quick else pool
    page_size, kv_heads, heads, head_dim = (16, 2, 8, 64) if quick else (16, 8, 32, 128)
    shape = (layers, pages, page_size, kv_heads, head_dim)  # [layers, pages, page_size, kv_heads, head_dim]
    make = jax.jit(lambda key: jax.random.normal(key, shape, jnp.bfloat16))
    k_cache, v_cache = make(jax.random.PRNGKey(1)), make(jax.random.PRNGKey(2))
    md = jax.tree.map(jnp.asarray, random_batch(rng, [1] * batch, [context] * batch, page_size=page_size, num_pages=pages))
    q = jax.random.normal(jax.random.PRNGKey(3), (batch, heads, head_dim), jnp.bfloat16)  # [batch, heads, head_dim]
    scale, kv_bytes = head_dim ** -0.5, batch * context * 2 * kv_heads * head_dim * 2
    rows = []
    for layer in sorted({0, layers // 2, layers - 1}):
        want = np.asarray(reference_attention(q, k_cache, v_cache, layer, md, scale=scale), np.float32)
        for name in impls:
            fn = jax.jit(ATTENTION_KERNELS[name], static_argnames=("scale",))
            row = dict(kernel=f"decode attention, pool {layers}x{pages} pages, B={batch} ctx={context} layer {layer}", impl=name)
            try:
                got = np.asarray(fn(q, k_cache, v_cache, layer, md, scale=scale), np.float32)
                t = back_to_back_seconds(lambda: fn(q, k_cache, v_cache, layer, md, scale=scale), 1 if quick else 10)
                row.update(rel_err=rel_err(got, want), seconds=t, bytes=kv_bytes, bw=kv_bytes / t)
            except Exception as e:  # noqa: BLE001 - one failed kernel must not lose the other
                row["error"] = repr(e)[:300]
            rows.append(row)
            print_table(rows[-1:])
    return rows


def back_to_back_seconds(call, n):
    """Seconds per call of n calls queued back to back, one wait at the end (after a first call)."""
    jax.block_until_ready(call())
    t0 = time.perf_counter()
    for _ in range(n):
        out = call()
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / n


def print_table(rows):
    for r in rows:
        if "error" in r:
            print(f"{r['kernel']:<38} {r['impl']:<58} ERROR {r['error'][:150]}")
        elif "bw" in r:
            err = f"  rel_err {r['rel_err']:.1e}" if r.get("rel_err") is not None else ""
            if r.get("kernel_only_bw"):
                err += f"  kernel alone {r['kernel_only_seconds'] * 1e6:.1f} us ({100 * r['kernel_only_bw'] / COPY_BW:.0f}%)"
            if "rate" in r:  # a matmul's row (the fp8 section): its FLOP rate too
                err = f"  {r['rate'] / 1e12:6.1f} TFLOP/s {100 * r['rate'] / r['ceiling']:5.1f}% of {r['ceiling'] / 1e12:.0f}" + (
                    f"  rel_err {r['rel_err']:.1e}" if r.get("rel_err") is not None else "")
            print(f"{r['kernel']:<38} {r['impl']:<58} {r['seconds'] * 1e6:9.1f} us {r['bw'] / 1e12:6.2f} TB/s {100 * r['bw'] / COPY_BW:5.1f}% of copy{err}")
        else:
            ceiling = r.get("ceiling", BF16_RATE)
            err = f"  rel_err {r['rel_err']:.1e}" if r.get("rel_err") is not None else ""
            print(f"{r['kernel']:<38} {r['impl']:<58} {r['seconds'] * 1e6:9.1f} us {r['rate'] / 1e12:6.1f} T/s  {100 * r['rate'] / ceiling:5.1f}% of {ceiling / 1e12:.0f}{err}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=".", help="folder for kernels.json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    parser.add_argument("--skip-checks", action="store_true")
    parser.add_argument("--check-impls", default="triton,mosaic,prefill", help="attention kernels to check (of triton, mosaic, prefill)")
    parser.add_argument("--skip-matmul-checks", action="store_true")
    parser.add_argument("--reps", type=int, default=4)
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--sections", default="decode,prefill,gemv,gemm",
                        help="comma-separated subset of decode,prefill,gemv,gemm,large_pool,fp8")
    parser.add_argument("--prefill-cases", default=None,
                        help="prefill section: only cases whose name contains one of these comma-separated strings")
    parser.add_argument("--prefill-variants", default=None, help="prefill section: only these comma-separated variants")
    parser.add_argument("--decode-batches", default="64", help="decode section: batch sizes at 4k context, e.g. 64,8")
    parser.add_argument("--page-sizes", default="16", help="attention checks and decode timings: KV page sizes, e.g. 16,32")
    parser.add_argument("--gemv-shapes", default=None, help="gemv section: K x N list, e.g. 4096x14336,4096x28672")
    parser.add_argument("--gemv-rows", default="1,8", help="gemv section: row counts (the [in, out] kernel has named variants for 1 and 8)")
    parser.add_argument("--gemv-filter", default=None, help="gemv section: only variants matching this regular expression")
    parser.add_argument("--gemv-splits", default=None, help="gemv section: sweep these split-K counts, e.g. 1,2,4,8")
    parser.add_argument("--gemm-rows", default="4096", help="gemm section: row counts, e.g. 4096,512,64,8")
    parser.add_argument("--fp8-rows", default=fp8_matmul.DEFAULT_ROWS,
                        help="fp8 section: row counts of the fp8 W8A8 / weight-only / bf16 matmuls at the Llama-3-8B shapes")
    parser.add_argument("--pool", type=int, nargs=4, default=[32, 17922, 256, 1024], metavar=("LAYERS", "PAGES", "BATCH", "CONTEXT"),
                        help="large_pool section: pool of LAYERS x PAGES pages of 16 tokens (the defaults: the engine's "
                             "Llama-3-8B pool on an H200, 37.6 GB of K and V), BATCH sequences of CONTEXT tokens")
    args = parser.parse_args(argv)
    rng = np.random.default_rng(int(time.time()))
    page_sizes = tuple(int(p) for p in args.page_sizes.split(","))
    result = harness.result_header()
    os.makedirs(args.out, exist_ok=True)

    def save():  # after every section, so a run cut short still leaves its numbers
        with open(os.path.join(args.out, "kernels.json"), "w") as f:
            json.dump(result, f, indent=1)

    if not args.skip_checks:
        checks = run_checks(rng, args.quick, tuple(filter(None, args.check_impls.split(","))), not args.skip_matmul_checks,
                            page_sizes)
        result["checks"] = checks
        for c in checks:
            print(f"check {c['kernel']:<9} {c['case']:<20} {c['dtype']:<8} g={c.get('group', '-')} d={c.get('head_dim', '-')} "
                  f"rel_err={c['rel_err']:.2e} written={c['all_written']}")
        save()
    timings = [bench_copy(args.reps, args.trials, args.quick)]
    gemv = functools.partial(bench_gemv, gemv_shapes=args.gemv_shapes, gemv_rows=args.gemv_rows, gemv_splits=args.gemv_splits,
                             gemv_filter=args.gemv_filter)
    gemm = functools.partial(bench_gemm, gemm_rows=args.gemm_rows)
    def decode(rng, quick, reps, trials):
        return [row for p in page_sizes for b in args.decode_batches.split(",")
                for row in bench_decode_attention(rng, quick, reps, trials, int(b), p)]

    large_pool = functools.partial(bench_large_pool, pool=args.pool,  # decode steps: no prefill kernel
                                     impls=tuple(i for i in args.check_impls.split(",") if i and i != "prefill"))
    fp8 = functools.partial(fp8_matmul.bench_fp8, time_call=time_call, rel_err=rel_err, rates=(BF16_RATE, FP8_RATE),
                            fp8_rows=args.fp8_rows)
    prefill = functools.partial(bench_prefill_attention, cases=args.prefill_cases and args.prefill_cases.split(","),
                                only=args.prefill_variants and args.prefill_variants.split(","))
    sections = dict(decode=decode, prefill=prefill, gemv=gemv, gemm=gemm, large_pool=large_pool, fp8=fp8)
    for bench in (sections[name] for name in args.sections.split(",")):
        section = bench(rng, args.quick, args.reps, args.trials)
        print_table(section)
        timings += section
        result["timings"] = timings
        save()
    print("\n=== summary", result["date"], result["device"], "jax", result["jax"], result["git_commit"])
    print_table(timings)


if __name__ == "__main__":
    main()
