"""The int8 KV cache in the Pallas paged-attention kernels (Triton, and Mosaic GPU for pages of 32 and
64 tokens): check each against the XLA reference on the same int8 pools, then time them against the
bf16 cache.

  python benchmarks/kv_int8_attention.py --out DIR          # GPU: checks, then timings
  python benchmarks/kv_int8_attention.py --impls triton,mosaic --page-sizes 16,32 --out DIR
  python benchmarks/kv_int8_attention.py --quick --out DIR  # CPU smoke run (interpret mode, tiny sizes)

Decode attention (B=64 rows, 4096 tokens of context each, 32 query / 8 KV heads, head_dim 128,
page 16 or 32) reads the whole K/V of every row once, so it is bound by memory: bf16 pools move
2 x 64 x 4096 x 8 x 128 x 2 B = 1.07 GB, int8 pools 2 x 64 x 4096 x 8 x (128 + 4) B = 0.55 GB
(values plus one float32 scale per token and head). The question is how much of that 1.94x
fewer bytes turns into time. The prefill chunk is bound by compute and shows what the int8 ->
bf16 conversion costs there.

Timing as in benchmarks/kernel_bench.py: `reps` input sets per jitted call (no host dispatch between
launches), device time from CUPTI on a GPU (host clock elsewhere), median of `trials` calls.
"""
import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from kernel_batches import random_batch, random_int8_pool  # noqa: E402

from harness import result_header  # noqa: E402
from kernel_bench import attention_cases, rel_err, time_call  # noqa: E402  (benchmarks/kernel_bench.py: CUPTI device timing)

from jlight.pallas_kernels import attention_reference, paged_attention_mosaic, paged_attention_pallas  # noqa: E402

COPY_BW = 3.70e12


KERNELS = {"triton": paged_attention_pallas.paged_attention, "mosaic": paged_attention_mosaic.paged_attention}


def runs(impl: str, page_size: int, dtype=jnp.bfloat16) -> bool:
    """Whether `impl` takes int8 pools of this page size and queries of this dtype."""
    if impl == "mosaic":
        return page_size in paged_attention_mosaic.INT8_PAGE_SIZES and dtype != jnp.float32
    return True


def check(rng, dtype, group, head_dim, q_lens, ctx_lens, num_tokens, sliding_window=None, impl="triton", page_size=16):
    num_kv_heads, num_layers = 2, 2
    num_pages = sum(-(-c // page_size) for c in ctx_lens) + 8
    md = random_batch(rng, q_lens, ctx_lens, page_size=page_size, num_pages=num_pages, num_tokens=num_tokens)
    shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
    (kq, k), (vq, v) = random_int8_pool(rng, shape), random_int8_pool(rng, shape)
    q = jnp.asarray(rng.standard_normal((num_tokens, num_kv_heads * group, head_dim)), dtype)
    layer, kw = jnp.int32(1), dict(scale=head_dim ** -0.5, sliding_window=sliding_window)
    want = attention_reference.paged_attention(q.astype(jnp.float32), kq, vq, layer, md, **kw)
    got = KERNELS[impl](q, kq, vq, layer, md, **kw)
    exact = attention_reference.paged_attention(q.astype(jnp.float32), k, v, layer, md, **kw)
    n = int(md.query_start[-1])
    return dict(rel_err_vs_int8_reference=rel_err(got[:n], want[:n]), int8_vs_unquantized=rel_err(want[:n], exact[:n]),
                all_written=bool(np.all(np.isfinite(np.asarray(got[:n], np.float32)))))


def run_checks(rng, quick, impls, page_sizes):
    """The same case grid as benchmarks/kernel_bench.py's checks, on int8 pools, for each kernel and page size."""
    return [dict(impl=impl, page_size=ps, case=name, dtype=jnp.dtype(dtype).name, group=group, head_dim=head_dim,
                 **check(rng, dtype, group, head_dim, q_lens, ctx, t, sliding_window=window, impl=impl, page_size=ps))
            for impl in impls for ps in page_sizes
            for name, dtype, group, head_dim, q_lens, ctx, t, window in attention_cases(quick) if runs(impl, ps, dtype)]


def bench_decode(rng, quick, reps, trials, impl="triton", page_size=16, sweep=False):
    batch, ctx, num_heads, num_kv_heads, head_dim = (64, 4096, 32, 8, 128) if not quick else (4, 64, 8, 2, 64)
    num_pages = batch * (ctx // page_size) + 1
    md = random_batch(rng, [1] * batch, [ctx] * batch, page_size=page_size, num_pages=num_pages)
    shape = (1, num_pages, page_size, num_kv_heads, head_dim)
    kq, k32 = random_int8_pool(rng, shape)
    vq, v32 = random_int8_pool(rng, shape)
    k, v = k32.astype(jnp.bfloat16), v32.astype(jnp.bfloat16)
    del k32, v32
    qs = [jnp.asarray(rng.standard_normal((batch, num_heads, head_dim)), jnp.bfloat16) for _ in range(reps)]
    scale, layer = head_dim ** -0.5, jnp.int32(0)
    tokens = batch * ctx * num_kv_heads
    caches = {"bf16 KV": ((k, v), 2 * tokens * head_dim * 2), "int8 KV": ((kq, vq), 2 * tokens * (head_dim + 4))}
    if impl == "triton":
        swept = [dict(pages_per_step=pps, num_warps=w, num_stages=st) for pps in (4, 8) for w in (4, 8) for st in (2, 3)]
        swept += [dict(num_splits=2)]
    else:  # int8 slots are half the bytes, so more of them fit in shared memory
        swept = [dict(num_stages=st) for st in (3, 4)] + [dict(kv_per_step=128)]
    configs = [dict()] + (swept if sweep and not quick else [])
    rows = []
    for cache_name, ((kc, vc), nbytes) in caches.items():
        for cfg in configs:
            fn = jax.jit(lambda qs, kc, vc, md, cfg=cfg: [KERNELS[impl](q, kc, vc, layer, md, scale=scale, **cfg) for q in qs])
            label = f"{impl} page {page_size} {cfg or 'default'}"
            try:
                t = time_call(fn, (qs, kc, vc, md), reps, trials)
                rows.append(dict(kernel=f"decode attention B={batch} ctx={ctx}", cache=cache_name, impl=label,
                                 seconds=t, bytes=nbytes, bw=nbytes / t, pct_copy=100 * nbytes / t / COPY_BW))
            except Exception as e:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
                rows.append(dict(kernel="decode attention", cache=cache_name, impl=label, error=repr(e)[:300]))
    return rows


def bench_prefill(rng, quick, reps, trials, impl="triton", page_size=16):
    tokens, num_heads, num_kv_heads, head_dim = (4096, 32, 8, 128) if not quick else (64, 8, 2, 64)
    num_pages = tokens // page_size + 1
    md = random_batch(rng, [tokens], [tokens], page_size=page_size, num_pages=num_pages)
    shape = (1, num_pages, page_size, num_kv_heads, head_dim)
    (kq, k32), (vq, v32) = random_int8_pool(rng, shape), random_int8_pool(rng, shape)
    caches = {"bf16 KV": (k32.astype(jnp.bfloat16), v32.astype(jnp.bfloat16)), "int8 KV": (kq, vq)}
    qs = [jnp.asarray(rng.standard_normal((tokens, num_heads, head_dim)), jnp.bfloat16) for _ in range(max(1, reps // 2))]
    flops = 2 * 2 * num_heads * head_dim * tokens * (tokens + 1) / 2
    rows = []
    for cache_name, (kc, vc) in caches.items():
        fn = jax.jit(lambda qs, kc, vc, md: [KERNELS[impl](q, kc, vc, jnp.int32(0), md, scale=head_dim ** -0.5) for q in qs])
        try:
            t = time_call(fn, (qs, kc, vc, md), len(qs), trials)
            rows.append(dict(kernel=f"prefill attention {tokens}-token chunk", cache=cache_name, impl=f"{impl} page {page_size}",
                             seconds=t, flops=flops, tflops=flops / t / 1e12))
        except Exception as e:  # noqa: BLE001
            rows.append(dict(kernel="prefill attention", cache=cache_name, error=repr(e)[:300]))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--impls", default="triton", help="comma-separated: triton, mosaic")
    ap.add_argument("--page-sizes", default="16", help="comma-separated KV page sizes")
    ap.add_argument("--sweep", action="store_true", help="also time each kernel's other launch settings")
    a = ap.parse_args()
    impls, page_sizes = a.impls.split(","), [int(p) for p in a.page_sizes.split(",")]
    rng = np.random.default_rng(0)
    result = dict(result_header(), args=vars(a))
    checks = run_checks(rng, a.quick, impls, page_sizes)
    bad = [c for c in checks if not c["all_written"] or c["rel_err_vs_int8_reference"] > (3e-2 if c["dtype"] == "bfloat16" else 1e-3)]
    result["checks"], result["checks_failed"] = checks, len(bad)
    print(f"checks: {len(checks) - len(bad)}/{len(checks)} passed; worst rel err vs int8 reference "
          f"{max(c['rel_err_vs_int8_reference'] for c in checks):.2e}; int8 vs unquantized attention "
          f"{min(c['int8_vs_unquantized'] for c in checks):.1e}..{max(c['int8_vs_unquantized'] for c in checks):.1e}", flush=True)
    for c in bad:
        print("FAILED", c, flush=True)
    reps, trials = (2, 3) if a.quick else (a.reps, a.trials)
    result["timings"] = []
    for impl, ps in ((i, p) for i in impls for p in page_sizes if runs(i, p)):
        result["timings"] += bench_decode(rng, a.quick, reps, trials, impl, ps, a.sweep)
        result["timings"] += bench_prefill(rng, a.quick, reps, trials, impl, ps)
    for r in result["timings"]:
        if "error" in r:
            print(f"{r['kernel']:<40} {r['cache']:<8} {r.get('impl', '')}: ERROR {r['error']}", flush=True)
        elif "bw" in r:
            print(f"{r['kernel']:<40} {r['cache']:<8} {r['impl']:<55} {r['seconds'] * 1e6:9.1f} us  {r['bw'] / 1e12:5.2f} TB/s  "
                  f"{r['pct_copy']:5.1f}% of copy", flush=True)
        else:
            print(f"{r['kernel']:<40} {r['cache']:<8} {r['impl']:<55} {r['seconds'] * 1e6:9.1f} us  {r['tflops']:6.1f} TFLOP/s", flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "kv_int8_attention.json"), "w") as f:
            json.dump(result, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
