"""The Mosaic GPU W8A16 kernel (pallas_kernels/w8a16_mosaic.py) at the decode shapes of Llama-3-8B,
against XLA's dequantize-dot on the same K-major int8 weights and XLA's bf16 dot.

  python benchmarks/w8a16_mosaic.py --out DIR                          # GPU: defaults and the sweep
  python benchmarks/w8a16_mosaic.py --rows 8,16,64 --variants default --out DIR
  python benchmarks/w8a16_mosaic.py --rows 128,512 --variants none     # XLA's bf16 and int8 dots only
  python benchmarks/w8a16_mosaic.py --rows 512,2048 --variants none --xla-layouts  # prefill sizes, both layouts
  python benchmarks/w8a16_mosaic.py --quick --out DIR                  # CPU smoke run (interpret mode)

Each row: the output checked against a float32 reference (relative error), then the device time of
one matmul (CUPTI, benchmarks/kernels.py's time_call: `sets` weight sets per jitted call, enough to
stream >= 256 MB past the 50 MB L2), the weight read rate and its share of the 3.70 TB/s copy rate.
"kernel alone" leaves out the XLA sum of split-K partials.
At prefill sizes the matmuls are compute-bound: each line also gives TFLOP/s (the bf16 ceiling: 645).
"""
import argparse
import datetime
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from kernels import COPY_BW, rel_err, time_call  # noqa: E402

from jlight.pallas_kernels import matmul_reference, w8a16_mosaic  # noqa: E402
from jlight.pallas_kernels.quantization import QuantizedWeight, QuantizedWeightT  # noqa: E402

# K x N of the engine's batch-1 decode matmuls: fused q/k/v, wo, fused gate/up, down, lm_head.
SHAPES = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)]
VARIANTS = {
    # x's two-term int8 split (w8a16_mosaic.split_int8), int8 wgmma with both operands in shared memory
    "i8 tk256 s4": dict(int8_activations=True),
    "i8 tk256 s6": dict(int8_activations=True, num_stages=6),
    "i8 tk128 s8": dict(int8_activations=True, tile_k=128, num_stages=8),
    "i8 tk512 s3": dict(int8_activations=True, tile_k=512, num_stages=3),
    "i8 tk256 s4 c2": dict(int8_activations=True, ctas_per_sm=2),
    "i8 tk128 s4 c2": dict(int8_activations=True, tile_k=128, ctas_per_sm=2),
    # bf16 activations: the int8 tile converted in registers, the wgmma's register operand
    "default": {},
    "tk256 s4 c2": dict(ctas_per_sm=2),
    "tk128 s4 c2": dict(tile_k=128, ctas_per_sm=2),
}


def random_weight(key, n, k):
    kv, ks = jax.random.split(key)
    return jax.jit(lambda kv, ks: QuantizedWeightT(jax.random.randint(kv, (n, k), -127, 128, jnp.int8),
                                                   jax.random.uniform(ks, (n,), jnp.float32, 1e-3, 2e-3)))(kv, ks)


def bench_shape(key, k, n, m, variants, trials, quick, xla_layouts=False):
    sets = 2 if quick else max(2, min(16, -(-(256 << 20) // (k * n))))
    keys = jax.random.split(key, sets + 2)
    weights = [random_weight(kk, n, k) for kk in keys[:sets]]
    bf16 = [jax.jit(lambda kk: jax.random.normal(kk, (k, n), jnp.bfloat16))(keys[sets])] * sets
    x = jax.random.normal(keys[-1], (m, k), jnp.bfloat16)
    want = np.asarray(matmul_reference.matmul(x.astype(jnp.float32), weights[0]))
    int8_bytes = n * k + 4 * n + 2 * m * (k + n)
    in_out = [QuantizedWeight(jnp.swapaxes(w.values_t, 0, 1), w.scales) for w in weights] if xla_layouts else []
    cases = [("xla bf16", matmul_reference.matmul, bf16, 2 * k * n + 2 * m * (k + n)),
             ("xla int8 dequantize-dot", matmul_reference.matmul, weights, int8_bytes)]
    if xla_layouts:  # XLA's fusion on the [in, out] layout
        cases.append(("xla int8 [in, out]", matmul_reference.matmul, in_out, int8_bytes))
    cases += [(f"mosaic {name}", lambda x, w, cfg=cfg: w8a16_mosaic.w8a16_mosaic_matmul(x, w, **cfg), weights, int8_bytes)
              for name, cfg in variants.items()]
    rows = []
    for name, fn, ws, nbytes in cases:
        row = dict(shape=f"{m}x{k}x{n}", impl=name)
        try:
            if ws is weights or ws is in_out:
                row["rel_err"] = rel_err(fn(x, ws[0]).astype(jnp.float32), want)
            by_kernel = {}
            t = time_call(jax.jit(lambda x, ws, fn=fn: [fn(x, w) for w in ws]), (x, ws), sets, trials, by_kernel)
            row.update(us=t * 1e6, tb_s=nbytes / t / 1e12, pct_copy=100 * nbytes / t / COPY_BW, tflop_s=2 * m * k * n / t / 1e12)
            alone = sum(v for kname, v in by_kernel.items() if "w8a16" in kname or "mosaic" in kname)
            if name.startswith("mosaic") and alone:
                row["kernel_alone_us"] = alone * 1e6
                row["kernels"] = {kname[:60]: v * 1e6 for kname, v in by_kernel.items()}
        except Exception as e:  # noqa: BLE001 - one failed variant must not lose the rest
            row["error"] = f"{type(e).__name__}: {e}"[:400]
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _line(row):
    if "error" in row:
        return f"{row['shape']:>16s} {row['impl']:28s} FAILED {row['error']}"
    err = f"err {row['rel_err']:.1e}" if "rel_err" in row else ""
    alone = f"(kernel alone {row['kernel_alone_us']:.1f})" if "kernel_alone_us" in row else ""
    return f"{row['shape']:>16s} {row['impl']:28s} {row['us']:8.1f} us {row['tb_s']:5.2f} TB/s {row['pct_copy']:4.0f}% {row['tflop_s']:5.0f} TFLOP/s {err} {alone}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="8", help="token rows M, comma-separated (multiples of 8)")
    ap.add_argument("--shapes", default=None, help="KxN,... (default: the Llama-3-8B decode layers)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, of: {', '.join(VARIANTS)}; 'none': XLA's bf16 and int8 dots only")
    ap.add_argument("--xla-layouts", action="store_true", help="also XLA's int8 dequantize-dot on [in, out] weights")
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, for a CPU smoke run")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    variants = {} if a.variants == "none" else {name: VARIANTS[name] for name in a.variants.split(",")}
    shapes = [(256, 128), (512, 192)] if a.quick else SHAPES
    if a.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in a.shapes.split(",")]
    if a.quick:
        variants = {name: dict(cfg, tile_k=min(cfg.get("tile_k", 256), 256), num_sms=2) for name, cfg in variants.items()}
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), device=str(jax.devices()[0].device_kind),
                  jax=jax.__version__, command=" ".join(sys.argv), rows=[])
    key = jax.random.PRNGKey(0)
    for m in (int(r) for r in a.rows.split(",")):
        for k, n in shapes:
            key, sub = jax.random.split(key)
            result["rows"] += bench_shape(sub, k, n, m, variants, 3 if a.quick else a.trials, a.quick, a.xla_layouts)
            if a.out:
                os.makedirs(a.out, exist_ok=True)
                with open(os.path.join(a.out, "w8a16_mosaic.json"), "w") as f:
                    json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
