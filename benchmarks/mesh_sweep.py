"""Time one model on several meshes: decode latency at batch 1, decode throughput at batch 64,
and time to first token (one prefill step) of a 2048-token prompt.

  python benchmarks/mesh_sweep.py --model-config llama3-8b --meshes tp=1 tp=2 "dp=2,tp=4" --out DIR
  python benchmarks/mesh_sweep.py --model-config tiny --meshes tp=1,tp=2 --quick   # CPU smoke run

`--meshes tp=1,tp=2` is read as two meshes (a repeated axis starts a new mesh); quote
"dp=2,tp=4" for one mesh with two axes. A mesh smaller than the machine uses the first
devices. Weights are random (init_params, bfloat16 unless --dtype) and created directly in
their sharding; only timings matter. Each figure is the median of --trials jitted steps after
a warm-up, timed on the host after block_until_ready. Writes mesh_sweep.json (and
mesh_sweep.png when matplotlib is installed) to --out. With dp > 1 each replica runs the
batch, so the throughput column counts dp x batch tokens per step.
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from jlight.config import ModelConfig
from jlight.models import llama
from jlight.pallas_kernels.batch_metadata import BatchMetadata
from jlight.pallas_kernels.dispatch import get_kernels
from jlight.sharding.mesh import make_mesh, parse_mesh_spec
from jlight.sharding.plan import ShardingPlan
from jlight.sharding.rules import named_shardings, param_specs
from model_configs import NAMED_CONFIGS

PAGE_SIZE = 16


def split_meshes(args: list[str]) -> list[str]:
    """["tp=1,tp=2", "dp=2,tp=4"] -> ["tp=1", "tp=2", "dp=2,tp=4"]: a repeated axis starts a new mesh."""
    meshes = []
    for arg in args:
        current: list[str] = []
        for part in (p.strip() for p in arg.replace(";", ",").split(",") if p.strip()):
            axis = part.split("=")[0].strip()
            if any(c.split("=")[0].strip() == axis for c in current):
                meshes.append(",".join(current))
                current = []
            current.append(part)
        if current:
            meshes.append(",".join(current))
    for m in meshes:
        parse_mesh_spec(m)  # fail early with the spec's own message
    return meshes


def decode_batch(batch: int, context: int, max_pages: int) -> BatchMetadata:
    """One decode token per sequence at position context - 1; sequence b owns pages b*max_pages+1..."""
    pages = 1 + np.arange(batch * max_pages, dtype=np.int32).reshape(batch, max_pages)  # [B, max_pages]; page 0 scratch
    pos = np.full(batch, context - 1, np.int32)
    return BatchMetadata(
        positions=jnp.asarray(pos), slot_mapping=jnp.asarray(pages[:, (context - 1) // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE),
        token_seq=jnp.arange(batch, dtype=jnp.int32), page_table=jnp.asarray(pages),
        context_lens=jnp.full(batch, context, jnp.int32), query_start=jnp.arange(batch + 1, dtype=jnp.int32),
        logits_indices=jnp.arange(batch, dtype=jnp.int32),
    )


def prefill_batch(prompt: int, max_pages: int) -> BatchMetadata:
    """One fresh sequence of `prompt` tokens on pages 1..max_pages."""
    pages = 1 + np.arange(max_pages, dtype=np.int32)[None]  # [1, max_pages]
    pos = np.arange(prompt, dtype=np.int32)
    return BatchMetadata(
        positions=jnp.asarray(pos), slot_mapping=jnp.asarray(pages[0, pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE),
        token_seq=jnp.zeros(prompt, jnp.int32), page_table=jnp.asarray(pages),
        context_lens=jnp.asarray([prompt], jnp.int32), query_start=jnp.asarray([0, prompt], jnp.int32),
        logits_indices=jnp.asarray([prompt - 1], jnp.int32),
    )


def run_mesh(spec: str, config: ModelConfig, dtype, a) -> dict:
    sizes = parse_mesh_spec(spec)
    count = math.prod(sizes.values())
    if count > jax.device_count():
        raise ValueError(f"mesh {spec!r} needs {count} devices; this machine has {jax.device_count()}")
    mesh = make_mesh(spec, jax.devices()[:count]) if count > 1 else None
    plan = ShardingPlan(mesh, config, llama.param_axes(config))
    # Random weights created straight in their shardings, already in the plan's layout
    # (KV heads replicated, vocab padded), so no host copy of the whole model is made.
    layout = dataclasses.replace(plan.config, vocab_size=plan.padded_vocab)
    init = lambda key: llama.init_params(layout, key, dtype)  # noqa: E731
    if mesh is not None:
        init = jax.jit(init, out_shardings=named_shardings(mesh, param_specs(llama.param_axes(config))))
    params = init(jax.random.PRNGKey(0))
    kernels = get_kernels(a.attention_impl, a.matmul_impl)

    def model_fn(p, k, v, tokens, md):
        hidden, k, v = llama.forward(p, plan.config, tokens, k, v, md, kernels)
        return llama.compute_logits(p, plan.config, hidden[md.logits_indices], kernels), k, v

    step = jax.jit(plan.wrap(model_fn, collective_matmul=a.collective_matmul, int8_all_reduce=a.int8_all_reduce),
                   donate_argnums=(1, 2))
    max_pages = max(math.ceil(a.context / PAGE_SIZE), math.ceil(a.prompt_len / PAGE_SIZE))
    num_pages = 1 + max(a.batch, 1) * max_pages
    k_shape, v_shape = llama.kv_cache_shapes(plan.config, num_pages, PAGE_SIZE)
    k_sh, v_sh = plan.kv_cache_shardings(k_shape, v_shape)
    k_shape, v_shape = plan.kv_cache_global_shapes(k_shape, v_shape)  # (dp, ...) when dp > 1
    zeros = lambda shape, sh: jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sh)()  # noqa: E731
    k, v = zeros(k_shape, k_sh), zeros(v_shape, v_sh)

    result = {"mesh": spec, "devices": count}
    for name, batch, md in (
        ("decode_b1_ms", 1, decode_batch(1, a.context, max_pages)),
        (f"decode_b{a.batch}_ms", a.batch, decode_batch(a.batch, a.context, max_pages)),
        (f"ttft_{a.prompt_len}_ms", a.prompt_len, prefill_batch(a.prompt_len, max_pages)),
    ):
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, batch), jnp.int32)
        if plan.dp > 1:  # every replica runs the same-sized batch (so throughput counts dp x batch)
            tokens, md = jax.tree.map(lambda x: jnp.stack([x] * plan.dp), (tokens, md))
        # The step donates the caches; feed its outputs back so each call has live buffers.
        times = []
        for _ in range(a.trials + 1):  # the first call compiles and is dropped
            start = time.perf_counter()
            _, k, v = step(params, k, v, tokens, md)
            jax.block_until_ready(k)
            times.append(time.perf_counter() - start)
        result[name] = 1e3 * statistics.median(times[1:])
    result[f"decode_b{a.batch}_tok_s"] = plan.dp * a.batch / (result[f"decode_b{a.batch}_ms"] / 1e3)
    return result


def plot(results: list[dict], keys: list[str], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3.5))
    for ax, key in zip(axes, keys):
        ax.bar([r["mesh"] for r in results], [r[key] for r in results])
        ax.set_title(key)
    fig.tight_layout()
    fig.savefig(path)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-config", default="tiny", choices=sorted(NAMED_CONFIGS))
    ap.add_argument("--meshes", nargs="+", default=["tp=1"])
    ap.add_argument("--out", default=".")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="KV length of the decode steps")
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--collective-matmul", type=int, default=1)
    ap.add_argument("--int8-all-reduce", type=int, default=0)
    ap.add_argument("--attention-impl", default="auto")
    ap.add_argument("--matmul-impl", default="auto")
    ap.add_argument("--quick", action="store_true", help="CPU smoke sizes: batch 8, context 64, prompt 256, 3 trials")
    a = ap.parse_args()
    if a.quick:
        a.batch, a.context, a.prompt_len, a.trials = 8, 64, 256, 3
    config = ModelConfig(architecture="LlamaForCausalLM", max_position_embeddings=max(8192, a.prompt_len),
                         rms_norm_eps=1e-5, **NAMED_CONFIGS[a.model_config])
    meshes = split_meshes(a.meshes)
    dtype = jnp.dtype(a.dtype)
    results = []
    for spec in meshes:
        results.append(run_mesh(spec, config, dtype, a))
        print(f"done {spec}", flush=True)
    keys = ["decode_b1_ms", f"decode_b{a.batch}_ms", f"decode_b{a.batch}_tok_s", f"ttft_{a.prompt_len}_ms"]
    print(f"\nmodel {a.model_config} ({a.dtype}), {jax.devices()[0].device_kind} x{jax.device_count()}, "
          f"context {a.context}, collective_matmul={a.collective_matmul}, int8_all_reduce={a.int8_all_reduce}")
    print(f"{'mesh':<14}" + "".join(f"{k:>20}" for k in keys))
    for r in results:
        print(f"{r['mesh']:<14}" + "".join(f"{r[k]:>20.2f}" for k in keys))
    os.makedirs(a.out, exist_ok=True)
    record = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "jax": jax.__version__,
              "device": jax.devices()[0].device_kind, "device_count": jax.device_count(),
              "args": vars(a), "results": results}
    with open(os.path.join(a.out, "mesh_sweep.json"), "w") as f:
        json.dump(record, f, indent=1)
    if not plot(results, keys, os.path.join(a.out, "mesh_sweep.png")):
        print("(matplotlib not installed: no PNG written)")


if __name__ == "__main__":
    main()
