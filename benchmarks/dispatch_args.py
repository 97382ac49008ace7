"""Host time of one jitted call against how many arrays it takes (GPU), to explain why an int8 decode
step (about 330 parameter arrays: values and scales per weight) takes the host twice as long to
dispatch as a bf16 one (about 200).

A stand-in for the engine's unrolled step: L layers, each an RMSNorm and two small matmuls (so the device
time stays far below the host time), with the weights laid out four ways:
  bf16            per layer: norm weight, W1, W2 (3 arrays a layer)
  int8            per layer: norm weight, W1 values + scales, W2 values + scales (5 a layer)
  int8-stacked    per layer: W1 and W2 values; the norms and scales of all layers stacked (2 a layer + 3)
  bf16-stacked    per layer: W1, W2; the norms stacked (2 a layer + 1)
For each: the host time of the call (median of 200; the device is idle when the call starts, as in
decode_latency.py's call_on_device_inputs_ms), and, on a GPU, its kernels' device time (CUPTI) and count.

  python benchmarks/dispatch_args.py --layers 32,64 --out DIR
"""
import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp

D = 512


def rms(h, w):
    return h * jax.lax.rsqrt(jnp.mean(h.astype(jnp.float32) ** 2, axis=-1, keepdims=True)).astype(h.dtype) * w


def make(layout: str, L: int, key):
    ks = jax.random.split(key, 4)
    w = lambda k, shape: jax.random.normal(k, shape, jnp.float32) * 0.05
    norms = jnp.ones((L, D), jnp.bfloat16)
    W1 = w(ks[0], (L, D, 4 * D)); W2 = w(ks[1], (L, 4 * D, D))
    if layout.startswith("bf16"):
        W1, W2 = W1.astype(jnp.bfloat16), W2.astype(jnp.bfloat16)
        layers = [dict(w1=W1[i], w2=W2[i]) for i in range(L)]
        if layout == "bf16":
            for i in range(L):
                layers[i]["norm"] = norms[i]
            return dict(layers=layers)
        return dict(layers=layers, norms=norms)
    q = lambda W: (jnp.round(W / (jnp.abs(W).max(axis=1, keepdims=True) / 127)).astype(jnp.int8),
                   (jnp.abs(W).max(axis=1) / 127).astype(jnp.float32))
    (v1, s1), (v2, s2) = q(W1), q(W2)
    if layout == "int8":
        return dict(layers=[dict(norm=norms[i], v1=v1[i], s1=s1[i], v2=v2[i], s2=s2[i]) for i in range(L)])
    return dict(layers=[dict(v1=v1[i], v2=v2[i]) for i in range(L)], norms=norms, s1=s1, s2=s2)


def step(params, state, x):
    h = x
    for i, p in enumerate(params["layers"]):
        norm = p["norm"] if "norm" in p else params["norms"][i]
        a = rms(h, norm)
        if "w1" in p:
            # the scales multiply after the dot, as in the engine's dequantize-dot
            y = jax.nn.silu(a @ p["w1"])
            h = h + y @ p["w2"]
        else:
            s1 = p["s1"] if "s1" in p else params["s1"][i]
            s2 = p["s2"] if "s2" in p else params["s2"][i]
            # the scales multiply after the dot, as in the engine's dequantize-dot
            y = jax.nn.silu(((a @ p["v1"].astype(jnp.bfloat16)).astype(jnp.float32) * s1).astype(jnp.bfloat16))
            h = h + ((y @ p["v2"].astype(jnp.bfloat16)).astype(jnp.float32) * s2).astype(jnp.bfloat16)
    return state + 1, h


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", default="32,64")
    ap.add_argument("--layouts", default="bf16,int8,int8-stacked,bf16-stacked")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    gpu = jax.default_backend() == "gpu"
    rows = []
    for L in map(int, a.layers.split(",")):
        for layout in a.layouts.split(","):
            params = make(layout, L, jax.random.PRNGKey(0))
            n_arrays = len(jax.tree.leaves(params))
            f = jax.jit(step, donate_argnums=(1,))
            state, x = jnp.zeros((1 << 20,), jnp.float32), jnp.ones((8, D), jnp.bfloat16)
            state, out = jax.block_until_ready(f(params, state, x))
            times = []
            for _ in range(200):
                t0 = time.perf_counter()
                state, out = f(params, state, x)
                times.append(time.perf_counter() - t0)
                jax.block_until_ready(out)
            row = dict(layers=L, layout=layout, arrays=n_arrays, host_call_ms=1e3 * statistics.median(times))
            if gpu:
                from jax.experimental.mosaic.gpu import profiler
                _, kernels = profiler.measure(jax.jit(step), aggregate=False)(params, state, x)
                row.update(device_ms=sum(ms for _, ms in kernels), kernels=len(kernels))
            rows.append(row)
            print(f"L={L:3d} {layout:13s} {n_arrays:4d} arrays: host call {row['host_call_ms']:.3f} ms" +
                  (f", device {row['device_ms']:.3f} ms in {row['kernels']} kernels" if gpu else ""), flush=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "dispatch_args.json"), "w") as f:
            json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
