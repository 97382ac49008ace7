"""Paged decode attention on engine-sized K/V pools: each GPU kernel against the XLA reference.

Why: the kernels' GPU checks (kernels.py) use pools sized to the test, a few hundred MB. The engine's pools
fill the device (31,210 pages of the Llama-3-8B shape on an H200: 32 GB each for K and V, 16e9 elements),
so page offsets pass 2^31 elements, and at 256 sequences x 1k tokens the Mosaic GPU kernel's time
(170 us a layer for 1.07 GB of K/V, docs/BENCHMARKS.md, 2026-12-02) was beyond what the HBM can deliver.
This script checks outputs at such sizes and times each implementation.

  python benchmarks/attention_large_pool_check.py --pages 17922 --batch 256 --context 1024
  python benchmarks/attention_large_pool_check.py --pages 64 --batch 4 --context 100 --layers 2 --impls reference  # CPU smoke run
"""
import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from kernel_batches import random_batch, reference_attention  # noqa: E402

from jlight.pallas_kernels import paged_attention_mosaic, paged_attention_pallas  # noqa: E402

IMPLS = {"mosaic": paged_attention_mosaic.paged_attention, "triton": paged_attention_pallas.paged_attention,
         "reference": reference_attention}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=17922, help="pages in the pool (per layer)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--impls", default="mosaic,triton")
    a = ap.parse_args()
    page_size, kv_heads, heads, head_dim = 16, 8, 32, 128
    shape = (a.layers, a.pages, page_size, kv_heads, head_dim)  # [layers, pages, page_size, kv_heads, head_dim]
    make = jax.jit(lambda key: jax.random.normal(key, shape, jnp.bfloat16), static_argnums=())
    k_cache, v_cache = make(jax.random.PRNGKey(1)), make(jax.random.PRNGKey(2))
    rng = np.random.default_rng(0)
    md = random_batch(rng, [1] * a.batch, [a.context] * a.batch, page_size=page_size, num_pages=a.pages)
    md = jax.tree.map(jnp.asarray, md)
    q = jax.random.normal(jax.random.PRNGKey(3), (a.batch, heads, head_dim), jnp.bfloat16)
    scale = head_dim ** -0.5
    kv_bytes = a.batch * a.context * 2 * kv_heads * head_dim * 2
    print(f"pool {a.layers}x{a.pages} pages ({2 * k_cache.nbytes / 1e9:.1f} GB K+V, {k_cache.size:.3g} elements each); "
          f"{a.batch} sequences x {a.context} tokens: {kv_bytes / 1e6:.0f} MB of K/V a layer", flush=True)
    for layer in sorted({0, a.layers // 2, a.layers - 1}):
        want = np.asarray(reference_attention(q, k_cache, v_cache, layer, md, scale=scale), np.float32)
        for name in a.impls.split(","):
            fn = jax.jit(IMPLS[name], static_argnames=("scale",))
            got = np.asarray(fn(q, k_cache, v_cache, layer, md, scale=scale), np.float32)
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            jax.block_until_ready(fn(q, k_cache, v_cache, layer, md, scale=scale))
            t0 = time.perf_counter()
            for _ in range(10):
                out = fn(q, k_cache, v_cache, layer, md, scale=scale)
            jax.block_until_ready(out)
            us = (time.perf_counter() - t0) / 10 * 1e6
            print(f"layer {layer:2d} {name:9s} rel err {err:.2e} {'OK' if err < 1e-2 else 'WRONG'}; "
                  f"{us:8.1f} us ({kv_bytes / us / 1e6:.2f} TB/s)", flush=True)


if __name__ == "__main__":
    main()
