"""Does an L2 prefetch during small kernels speed up the matmul after them? (pallas_kernels/l2_prefetch.py)

  python benchmarks/l2_prefetch.py --out DIR     # GPU
  python benchmarks/l2_prefetch.py --quick       # CPU smoke run: the sequences without the prefetch kernel

Each repetition of a sequence: read a 256 MB buffer (which leaves none of the weights in the 50 MB L2),
then [the prefetch kernel], then `--small-kernels` chained small elementwise kernels standing in for a
decode layer's RoPE, K/V writes and attention (about 1.5 us each on the H200), then the matmul of 8 rows
by the weight (XLA's dequantize-dot for int8, its dot for bf16). Rows:
- "cold": no prefetch; the matmul reads its weights from HBM;
- "prefetch": the kernel prefetches the weights (up to --max-mb) right after the buffer read;
- "hot": no buffer read: the previous repetition's matmul left the weights in L2, as far as they fit.
Reported: the matmul's device time (CUPTI, the kernels named in MATMUL_KERNEL_MARKS), the
sequence's device time (CUPTI's sum) and its wall time (host clock over `reps` repetitions in one call,
the buffer read included, so compare differences between rows).
"""
import argparse
import datetime
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(__file__))
from kernels import time_call  # noqa: E402

from jlight.pallas_kernels import l2_prefetch, matmul_reference  # noqa: E402
from jlight.pallas_kernels.quantization import QuantizedWeightT  # noqa: E402

# Names of the matmul's kernels: XLA's fusions ("gemm_fusion_dot..."), cuBLAS's ("nvjet...", "...xmma_gemm...").
MATMUL_KERNEL_MARKS = ("dot", "gemm", "nvjet", "xmma", "cutlass")
# name -> (K, N, dtype): the batch-1 decode layers the prefetch is meant for (K-major int8 as the engine stores them)
SHAPES = {"wo int8": (4096, 4096, "int8"), "qkv int8": (4096, 6144, "int8"), "gate/up int8": (4096, 28672, "int8"),
          "wo bf16": (4096, 4096, "bf16")}


def make_weight(key, k, n, kind):
    if kind == "bf16":
        return jax.random.normal(key, (k, n), jnp.bfloat16)
    return QuantizedWeightT(jax.random.randint(key, (n, k), -127, 128, jnp.int8), jnp.full((n,), 1e-3, jnp.float32))


def sequence(mode, reps, small_kernels, max_bytes):
    """A jitted fn(x, w, flush, s) running the row's sequence `reps` times, each repetition after the
    last (it reads the previous matmul's output), so XLA can neither merge nor reorder them."""
    def fn(x, w, flush, s):
        outs, prev = [], jnp.float32(0)
        for _ in range(reps):
            # "hot": the previous repetition's matmul left the weights in L2 (as far as they fit)
            dep = prev if mode == "hot" else jnp.sum(flush + prev) * 0  # the sum reads the 256 MB buffer
            xd = x + dep.astype(x.dtype)  # the prefetch, the small kernels and the matmul come after it
            if mode == "prefetch":
                xd = l2_prefetch.prefetch(xd, [w], max_bytes=max_bytes, force=True)
            t = s + dep
            for _ in range(small_kernels):  # separate kernels: a barrier between each
                t = lax.optimization_barrier(jnp.sin(t) * 1.0001)
            y = matmul_reference.matmul(xd + (t[0, 0] * 0).astype(xd.dtype), w)
            outs.append(y)
            prev = y[0, 0].astype(jnp.float32) * 0
        return outs
    return jax.jit(fn)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of: {', '.join(SHAPES)}")
    ap.add_argument("--small-kernels", type=int, default=6)
    ap.add_argument("--max-mb", type=float, default=40.0, help="prefetch budget, MiB")
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: small shapes, no prefetch row")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    modes = ("cold", "prefetch", "hot") if gpu else ("cold", "hot")  # the prefetch kernel needs a GPU
    shapes = {"tiny int8": (256, 512, "int8")} if a.quick else {n: SHAPES[n] for n in a.shapes.split(",")}
    key = jax.random.PRNGKey(0)
    flush = jnp.ones(((4 if a.quick else 256) << 20) // 4, jnp.float32)
    s = jnp.ones((8, 4096), jnp.float32)
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=str(jax.devices()[0].device_kind),
                  jax=jax.__version__, command=" ".join(sys.argv), rows=[])
    for name, (k, n, kind) in shapes.items():
        key, kw, kx = jax.random.split(key, 3)
        w, x = make_weight(kw, k, n, kind), jax.random.normal(kx, (8, k), jnp.bfloat16)
        for mode in modes:
            fn = sequence(mode, a.reps, a.small_kernels, int(a.max_mb * 2 ** 20))
            by_kernel = {}
            device_s = time_call(fn, (x, w, flush, s), a.reps, a.trials, by_kernel)
            walls = []
            for _ in range(a.trials):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(x, w, flush, s))
                walls.append((time.perf_counter() - t0) / a.reps)
            matmul_us = sum(v for kname, v in by_kernel.items() if any(m in kname for m in MATMUL_KERNEL_MARKS)) * 1e6
            row = dict(shape=name, mode=mode, matmul_us=matmul_us if by_kernel else None, sequence_device_us=device_s * 1e6,
                       sequence_wall_us=statistics.median(walls) * 1e6,
                       kernels={kname[:60]: v * 1e6 for kname, v in by_kernel.items()})
            result["rows"].append(row)
            mm = f"matmul {row['matmul_us']:7.2f} us" if row["matmul_us"] is not None else "matmul (no CUPTI)"
            print(f"{name:14s} {mode:9s} {mm}  sequence: device {row['sequence_device_us']:8.2f} us, "
                  f"wall {row['sequence_wall_us']:8.2f} us", flush=True)
            if a.out:
                os.makedirs(a.out, exist_ok=True)
                with open(os.path.join(a.out, "l2_prefetch.json"), "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
