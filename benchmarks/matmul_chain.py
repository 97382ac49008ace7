"""How long a decode layer's four matmuls take back to back, with nothing between them.

  python benchmarks/matmul_chain.py --out DIR                       # GPU: every variant
  python benchmarks/matmul_chain.py --variants xla-int8,mosaic-i8-pdl --layers 16
  python benchmarks/matmul_chain.py --quick                         # CPU smoke run (interpret mode)

The question (docs/BENCHMARKS.md, thirteenth session): in a batch-1 decode step the int8 matmuls of a
Llama-3-8B layer take ~64 us for 218 MB and the bf16 ones ~109 us for 436 MB. Fitting t = 4 o +
bytes / R to both gives R ~4.8 TB/s (the HBM's peak) and o ~4.5 us per matmul: a fixed cost per
kernel (ramp-up, tail, the gap to the next) that both dtypes pay, and that weighs twice as much in
int8. This script measures that cost directly, on a chain of `--layers` distinct layers' weights
(q/k/v, wo, gate/up, down; enough bytes that nothing stays in the 50 MB L2), 8 token rows each:
- the device's wall time per layer, back to back (`--reps` chains queued, one wait at the end);
- CUPTI's sum of the kernels' own times per layer (so wall minus CUPTI is the gaps between them);
- the host's time to launch one chain (a launch slower than the device would bound the wall time).
Variants: XLA's bf16 dot, XLA's int8 dequantize-dot (the engine's path), the Mosaic GPU W8A16
kernel (pallas_kernels/w8a16_mosaic.py) in both activation modes, each with and without programmatic
dependent launch (pdl: a kernel starts its weight copies before the kernel before it has ended), and
a layer's four matmuls as the phases of one kernel (pallas_kernels/w8a16_mosaic_phases.py), with and
without grid barriers between them. `--concat` streams the same bytes through one matmul per K, with
no kernel boundaries at all. Every variant's output is checked against XLA's float32 product on the
same weights.
"""
import argparse
import datetime
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(__file__))
from kernels import rel_err  # noqa: E402

from jlight.pallas_kernels import matmul_reference, w8a16_mosaic, w8a16_mosaic_phases  # noqa: E402
from jlight.pallas_kernels.quantization import QuantizedWeightT  # noqa: E402

LAYER_SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # K x N: q/k/v, wo, gate/up, down
QUICK_SHAPES = [(256, 128), (128, 256)]
VARIANTS = {
    "xla-bf16": None,
    "xla-int8": None,
    "mosaic-i8": dict(int8_activations=True),
    "mosaic-i8-pdl": dict(int8_activations=True, pdl=True),
    "mosaic-bf16-c2": dict(ctas_per_sm=2),
    "mosaic-bf16-c2-pdl": dict(ctas_per_sm=2, pdl=True),
    # a layer's matmuls as the phases of one kernel (pallas_kernels/w8a16_mosaic_phases.py), with and
    # without the grid-wide barrier between phases that a dependent chain would need
    "mosaic-i8-layer": dict(layer=True, barrier=True),
    "mosaic-i8-layer-nobarrier": dict(layer=True, barrier=False),
    "mosaic-i8-layer-s2": dict(layer=True, barrier=True, split_factor=2),  # units half as long
    # deeper weight prefetch (default 4 slots of 16 KiB): a program that reaches a barrier early has
    # that many of the next phase's weight tiles in flight, so the HBM keeps streaming while it waits
    "mosaic-i8-layer-st8": dict(layer=True, barrier=True, num_stages=8),
    "mosaic-i8-layer-st10": dict(layer=True, barrier=True, num_stages=10),
    "mosaic-i8-layer-st10-s2": dict(layer=True, barrier=True, num_stages=10, split_factor=2),
    "mosaic-i8-layer-st10-nobarrier": dict(layer=True, barrier=False, num_stages=10),
}


def make_layers(key, shapes, num_layers, bf16: bool, concat: bool = False):
    """num_layers lists of weights, one per shape: [in, out] bf16 arrays or K-major int8 weights.
    concat: one list instead, a weight per distinct K holding every layer's weights of that K side by
    side along `out` (one kernel then streams them all: no per-matmul ramp-up or tail)."""
    if concat:
        widths = {}
        for k, n in shapes:
            widths[k] = widths.get(k, 0) + n * num_layers
        shapes, num_layers = list(widths.items()), 1

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def one(key, k, n):
        kv, ks = jax.random.split(key)
        if bf16:
            return jax.random.normal(kv, (k, n), jnp.bfloat16) * 0.02
        return QuantizedWeightT(jax.random.randint(kv, (n, k), -127, 128, jnp.int8),
                                jax.random.uniform(ks, (n,), jnp.float32, 1e-3, 2e-3))

    layers = []
    for _ in range(num_layers):
        ws = []
        for k, n in shapes:
            key, sub = jax.random.split(key)
            ws.append(one(sub, k, n))
        layers.append(ws)
    return layers, shapes


def matmul_fn(variant: str, interpret: bool):
    """fn(list of x, list of weights) -> list of products: one layer's matmuls."""
    cfg = VARIANTS[variant]
    if cfg is None:
        return lambda xs, ws: [matmul_reference.matmul(x, w) for x, w in zip(xs, ws)]
    cfg = dict(cfg, **(dict(tile_k=128, num_sms=2) if interpret else {}))
    if cfg.pop("layer", False):
        return lambda xs, ws: w8a16_mosaic_phases.w8a16_mosaic_phases(xs, ws, interpret=interpret or None, **cfg)
    return lambda xs, ws: [w8a16_mosaic.w8a16_mosaic_matmul(x, w, interpret=interpret or None, **cfg)
                           for x, w in zip(xs, ws)]


def chain(fn, xs, layers, shapes):
    """Every layer's matmuls in order; each reads its own fixed input (no data dependency, so nothing
    but the matmuls runs; on one stream the kernels still run one after another)."""
    return [y for ws in layers for y in fn([xs[k] for k, _ in shapes], ws)]


def measure(variant, fn, xs, layers, shapes, reps, trials):
    run = jax.jit(lambda xs, layers: chain(fn, xs, layers, shapes))
    jax.block_until_ready(run(xs, layers))  # compile
    host = []
    for _ in range(trials):  # the host's launch time of one chain (the device may still be busy)
        jax.block_until_ready(run(xs, layers))
        t0 = time.perf_counter()
        out = run(xs, layers)
        host.append(time.perf_counter() - t0)
        jax.block_until_ready(out)
    walls = []
    for _ in range(trials):  # back to back: reps chains queued, one wait
        jax.block_until_ready(run(xs, layers))
        t0 = time.perf_counter()
        outs = [run(xs, layers) for _ in range(reps)]
        jax.block_until_ready(outs)
        walls.append((time.perf_counter() - t0) / reps)
    row = dict(variant=variant, wall_ms=statistics.median(walls) * 1e3, host_ms=statistics.median(host) * 1e3)
    if jax.default_backend() == "gpu":
        from jax.experimental.mosaic.gpu import profiler

        _, per_call = profiler.measure(run, aggregate=False, iterations=trials)(xs, layers)
        median_call = sorted(per_call, key=lambda ks: sum(ms for _, ms in ks))[len(per_call) // 2]
        row.update(cupti_ms=sum(ms for _, ms in median_call), kernels=len(median_call))
        by_name = {}
        for name, ms in median_call:
            by_name[name[:80]] = by_name.get(name[:80], 0.0) + ms
        row["by_kernel_ms"] = dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:8])
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--layers", type=int, default=16, help="distinct layers' weights in the chain (16: 3.5 GB int8)")
    ap.add_argument("--rows", type=int, default=8, help="token rows (the engine's batch-1 decode bucket is 8)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--concat", action="store_true",
                    help="each distinct K's weights of all layers as one matmul: the streaming rate without kernel boundaries")
    ap.add_argument("--quick", action="store_true", help="tiny shapes in interpret mode, for a CPU smoke run")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    shapes = QUICK_SHAPES if a.quick else LAYER_SHAPES
    num_layers = 2 if a.quick else a.layers
    reps, trials = (2, 2) if a.quick else (a.reps, a.trials)
    key = jax.random.PRNGKey(0)
    xs = {k: jax.random.normal(jax.random.fold_in(key, k), (a.rows, k), jnp.bfloat16) for k, _ in shapes}
    int8_layers, chain_shapes = make_layers(jax.random.fold_in(key, 1), shapes, num_layers, bf16=False, concat=a.concat)
    layer_bytes = {"int8": sum(k * n + 4 * n for k, n in shapes), "bf16": sum(2 * k * n for k, n in shapes)}
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=str(jax.devices()[0].device_kind),
                  jax=jax.__version__, command=" ".join(sys.argv), layers=num_layers, rows=a.rows, concat=a.concat,
                  layer_bytes=layer_bytes, results=[])
    bf16_layers = None
    for variant in variants:
        if variant == "xla-bf16":
            bf16_layers = bf16_layers or make_layers(jax.random.fold_in(key, 2), shapes, num_layers, bf16=True,
                                                     concat=a.concat)[0]
            layers, nbytes = bf16_layers, layer_bytes["bf16"]
        else:
            layers, nbytes = int8_layers, layer_bytes["int8"]
        fn = matmul_fn(variant, a.quick)
        try:
            # checked on the first layer against XLA's float32 product on the same weights
            got = jax.jit(fn)([xs[k] for k, _ in chain_shapes], layers[0])
            errs = [rel_err(y.astype(jnp.float32), matmul_reference.matmul(xs[k].astype(jnp.float32), w))
                    for y, (k, _), w in zip(got, chain_shapes, layers[0])]
            row = measure(variant, fn, xs, layers, chain_shapes, reps, trials)
            row["max_rel_err"] = max(errs)
            per_layer_us = row["wall_ms"] * 1e3 / num_layers  # with --concat: the same bytes in 2 kernels
            row.update(wall_us_per_layer=per_layer_us, read_tb_s=nbytes / (per_layer_us * 1e-6) / 1e12)
            if "cupti_ms" in row:
                row["cupti_us_per_layer"] = row["cupti_ms"] * 1e3 / num_layers
            print(f"{variant:20s} {per_layer_us:7.1f} us/layer back to back ({row['read_tb_s']:.2f} TB/s), "
                  f"CUPTI {row.get('cupti_us_per_layer', float('nan')):7.1f} us/layer in {row.get('kernels', '?')} kernels, "
                  f"host {row['host_ms']:.2f} ms per chain, max rel err {row['max_rel_err']:.1e}", flush=True)
        except Exception as e:  # noqa: BLE001 - one failed variant must not lose the rest
            row = dict(variant=variant, error=f"{type(e).__name__}: {e}"[:400])
            print(f"{variant:20s} FAILED {row['error']}", flush=True)
        result["results"].append(row)
        if a.out:
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "matmul_chain.json"), "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
