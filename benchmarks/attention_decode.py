"""Decode attention alone, at the engine's step shapes, across batch and context (Llama-3-8B heads:
32 query heads, 8 KV heads, head_dim 128, pages of 16 tokens): the Mosaic GPU kernel with its work
items (flash-decoding) against the same kernel with one program per (row, KV head), the Triton
kernel, the transposed fp8 decode kernel (paged_decode_mosaic.py), and the K/V bytes over the copy rate.

  python benchmarks/attention_decode.py --out DIR        # GPU
  python benchmarks/attention_decode.py --quick          # CPU smoke run (interpret mode, tiny sizes)

A batch-b step is what the engine runs: max(8, b) tokens and rows (the smallest bucket pads batch 1
to 8), the padding rows empty. Device time per call from CUPTI (kernels.time_call: every kernel of
the call, the combine included), `reps` input sets per call so nothing stays in L2.

With --engine-pool-gib G the default kernel also runs on a pool of the engine's layout and size
([layers, pages, page_size, kv_heads, head_dim], K + V = G GiB, the middle layer read), its pages
laid out per row in order or scattered over the whole layer: the same bytes read as on the small
pool, so a difference is the pool's span (address translation, DRAM pages), not the kernel's work.
"""
import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from kernel_batches import random_batch  # noqa: E402
from kernel_bench import time_call  # noqa: E402

from jlight.pallas_kernels import attention_reference, paged_attention_mosaic, paged_attention_pallas, paged_decode_mosaic  # noqa: E402
from jlight.core.quantization import to_fp8_kv  # noqa: E402

SHAPES = ((1, 8192), (1, 32768), (1, 131072), (16, 4096), (16, 16384), (64, 4096), (256, 1024))


def copy_rate(reps, trials, n=1 << 30):
    xs = [jnp.full((n,), i, jnp.bfloat16) for i in range(reps)]
    fn = jax.jit(lambda xs: [jnp.copy(x) for x in xs])
    return 2 * 2 * n / time_call(fn, (xs,), reps, trials)


def bench(batch, ctx, variants, reps, trials, page_size=16, heads=(32, 8, 128), quick=False):
    num_heads, num_kv_heads, head_dim = heads
    rng = np.random.default_rng(batch * 7 + ctx)
    tokens = max(8, batch)
    md = random_batch(rng, [1] * batch + [0] * (tokens - batch), [ctx] * batch + [0] * (tokens - batch),
                      page_size=page_size, num_pages=batch * (-(-ctx // page_size)) + 1, num_tokens=tokens)
    num_pages = batch * (-(-ctx // page_size)) + 1
    shape = (1, num_pages, page_size, num_kv_heads, head_dim)
    kk, kv = jax.random.split(jax.random.PRNGKey(batch + ctx))
    pools = {"bf16": (jax.random.normal(kk, shape, jnp.bfloat16), jax.random.normal(kv, shape, jnp.bfloat16))}
    pools["fp8"] = tuple(jax.jit(to_fp8_kv)(p) for p in pools["bf16"])
    qs = [jnp.asarray(rng.standard_normal((tokens, num_heads, head_dim)), jnp.bfloat16) for _ in range(reps)]
    scale, layer = head_dim ** -0.5, jnp.int32(0)
    kv_bytes = 2 * batch * ctx * num_kv_heads * head_dim
    rows, want = [], None
    for name, (pool, attn) in variants.items():
        k, v = pools[pool]
        fn = jax.jit(lambda qs, k, v, md, attn=attn: [attn(q, k, v, layer, md, scale=scale) for q in qs])
        try:
            t = time_call(fn, (qs, k, v, md), reps, trials)
            got = np.asarray(fn(qs, k, v, md)[0], np.float32)[:batch]  # the first input set's output
            want = got if want is None else want
            nbytes = kv_bytes * (1 if pool == "fp8" else 2)
            rows.append(dict(batch=batch, context=ctx, impl=name, us=round(t * 1e6, 2), kv_bytes=nbytes,
                             tb_s=round(nbytes / t / 1e12, 3), max_abs_diff_vs_first=float(np.max(np.abs(got - want)))))
        except Exception as e:  # noqa: BLE001 - a variant that fails is reported, not fatal
            rows.append(dict(batch=batch, context=ctx, impl=name, error=repr(e)[:400]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


def engine_pool_bench(batch, ctx, attn, reps, trials, pool_gib, layers=32, page_size=16, heads=(32, 8, 128)):
    """The kernel on a small pool, then on an engine-sized [layers, pages, ...] pool with each row's pages
    in order and scattered: rows of (layout, us, TB/s) for the same reads."""
    num_heads, num_kv_heads, head_dim = heads
    rng = np.random.default_rng(batch * 7 + ctx)
    tokens, per_row = max(8, batch), -(-ctx // page_size)
    need = batch * per_row
    md = random_batch(rng, [1] * batch + [0] * (tokens - batch), [ctx] * batch + [0] * (tokens - batch),
                      page_size=page_size, num_pages=need + 1, num_tokens=tokens)
    page_bytes = page_size * num_kv_heads * head_dim * 2
    pool_pages = int(pool_gib * (1 << 30) / (2 * layers * page_bytes))
    if pool_pages <= need:
        return [dict(batch=batch, context=ctx, error=f"--engine-pool-gib {pool_gib} holds fewer pages than {need}")]
    table = np.asarray(md.page_table)
    in_order, scattered = np.zeros(need + 1, np.int64), np.zeros(need + 1, np.int64)
    for b in range(batch):
        in_order[table[b, :per_row]] = 1 + b * per_row + np.arange(per_row)
    scattered[1:] = 1 + rng.choice(pool_pages - 1, need, replace=False)
    qs = [jnp.asarray(rng.standard_normal((tokens, num_heads, head_dim)), jnp.bfloat16) for _ in range(reps)]
    scale, kv_bytes = head_dim ** -0.5, 2 * 2 * batch * ctx * num_kv_heads * head_dim
    kk, kv = jax.random.split(jax.random.PRNGKey(batch + ctx))
    small_shape = (1, need + 1, page_size, num_kv_heads, head_dim)
    small = (jax.random.normal(kk, small_shape, jnp.bfloat16), jax.random.normal(kv, small_shape, jnp.bfloat16))
    put = jax.jit(lambda pool, pages, ids, layer: pool.at[layer, ids].set(pages[0, 1:]), donate_argnums=0)
    rows, want = [], None
    layouts = (("small pool, 1 layer", None), ("engine pool, pages in order", in_order),
               ("engine pool, pages scattered", scattered))
    for name, new_id in layouts:
        if new_id is None:
            (k, v), md_l, layer = small, md, jnp.int32(0)
        else:  # the small pool's pages copied to their new places in a zeroed engine pool
            layer = jnp.int32(layers // 2)
            shape = (layers, pool_pages, page_size, num_kv_heads, head_dim)
            ids = jnp.asarray(new_id[1:].astype(np.int32))
            k, v = (put(jnp.zeros(shape, jnp.bfloat16), p, ids, layer) for p in small)
            md_l = md._replace(page_table=jnp.asarray(new_id[table].astype(np.int32)))
        fn = jax.jit(lambda qs, k, v, md, layer: [attn(q, k, v, layer, md, scale=scale) for q in qs])
        try:
            t = time_call(fn, (qs, k, v, md_l, layer), reps, trials)
            got = np.asarray(fn(qs, k, v, md_l, layer)[0], np.float32)[:batch]
            want = got if want is None else want
            rows.append(dict(batch=batch, context=ctx, impl="mosaic work items", layout=name,
                             pool_gib=round(2 * k.nbytes / (1 << 30), 2), us=round(t * 1e6, 2),
                             tb_s=round(kv_bytes / t / 1e12, 3), max_abs_diff_vs_small=float(np.max(np.abs(got - want)))))
        except Exception as e:  # noqa: BLE001 - a layout that fails is reported, not fatal
            rows.append(dict(batch=batch, context=ctx, layout=name, error=repr(e)[:400]))
        print(json.dumps(rows[-1]), flush=True)
        del k, v
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--variants", default=None, help="comma-separated subset of the variant names")
    ap.add_argument("--engine-pool-gib", type=float, default=None,
                    help="also run the default kernel on an engine-layout pool of this many GiB (K + V), pages in "
                         "order and scattered")
    ap.add_argument("--shapes", default=None, help="batch x context list, e.g. 16x16384,256x1024 (default: SHAPES)")
    a = ap.parse_args(argv)
    mosaic, triton = paged_attention_mosaic.paged_attention, paged_attention_pallas.paged_attention
    transposed = paged_decode_mosaic.paged_attention
    variants = {
        "mosaic work items": ("bf16", mosaic),
        "mosaic one program per row": ("bf16", lambda *x, **k: mosaic(*x, num_items=0, **k)),
        "mosaic work items 3 stages": ("bf16", lambda *x, **k: mosaic(*x, num_stages=3, **k)),
        "triton": ("bf16", triton),
        "mosaic fp8 work items": ("fp8", mosaic),
        "mosaic fp8 work items 4 stages": ("fp8", lambda *x, **k: mosaic(*x, num_stages=4, **k)),
        "mosaic fp8 one program per row": ("fp8", lambda *x, **k: mosaic(*x, num_items=0, **k)),
        "mosaic fp8 work items 128 a step": ("fp8", lambda *x, **k: mosaic(*x, kv_per_step=128, **k)),
        "mosaic fp8 work items 3 stages": ("fp8", lambda *x, **k: mosaic(*x, num_stages=3, **k)),
        "transposed fp8 work items": ("fp8", transposed),
        "transposed fp8 one program per row": ("fp8", lambda *x, **k: transposed(*x, num_items=0, **k)),
        "transposed fp8 work items 64 a step": ("fp8", lambda *x, **k: transposed(*x, kv_per_step=64, **k)),
        "transposed fp8 work items 3 stages": ("fp8", lambda *x, **k: transposed(*x, num_stages=3, **k)),
    }
    if a.variants:
        variants = {k: v for k, v in variants.items() if k in a.variants.split(",")}
    if a.quick:
        variants["xla reference"] = ("bf16", attention_reference.paged_attention)
        shapes, heads, a.reps, a.trials = ((3, 100),), (8, 2, 64), 1, 1
    else:
        shapes, heads = SHAPES, (32, 8, 128)
    if a.shapes:
        shapes = tuple(tuple(int(n) for n in s.split("x")) for s in a.shapes.split(","))
    rate = copy_rate(a.reps, a.trials, n=(1 << 16) if a.quick else (1 << 30))
    print(json.dumps(dict(copy_rate_tb_s=round(rate / 1e12, 3))), flush=True)
    rows = []
    for batch, ctx in shapes:
        rows += bench(batch, ctx, variants, a.reps, a.trials, heads=heads, quick=a.quick)
        if a.engine_pool_gib:
            rows += engine_pool_bench(batch, ctx, mosaic, a.reps, a.trials, a.engine_pool_gib,
                                      layers=4 if a.quick else 32, heads=heads)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "attention_decode.json"), "w") as f:
            json.dump(dict(copy_rate_tb_s=rate / 1e12, device=jax.devices()[0].device_kind, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
