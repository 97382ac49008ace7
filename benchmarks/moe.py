"""MoE benchmark: random-weight Mixtral-8x7B- and DeepSeek-V3-shaped models (fewer layers).

One run measures, for each model, three sections (written to DIR/moe.json after each):
  * steps: the full jitted step (forward + LM head) for decode at batch 1 and 64 (each sequence
    at a 512-token context) and prefill of one 2048-token sequence, with every layer unrolled
    (layer_loop="unroll": `unstack_layers`, the GPU default, for both models, DeepSeek's dense
    first layer included), per expert implementation (Kernels.moe_impl, models/moe.py):
      dense       every expert on every token (the baseline);
      ragged_dot  tokens sorted by expert + jax.lax.ragged_dot (XLA);
      pallas      tokens sorted by expert + the Pallas grouped matmul (grouped_matmul_pallas.py);
      gathered    the chosen experts' weights gathered per (token, expert) pair (decode only).
    The logits are compared with dense's (max |difference|), so a wrong kernel shows.
  * expert_ffn: one MoE layer's routed experts alone at 1, 64 and 2048 tokens, same
    implementations, plus `mosaic_gpu`: the sorted path through JAX's bundled Mosaic GPU kernel
    jax.experimental.pallas.ops.gpu.ragged_dot_mgpu (bf16 out; recorded as an error if it fails).
  * grouped_matmul: the grouped matmul alone on a 2048-token prefill's 2048*k sorted rows, for the
    w_gate/w_up shape [experts, hidden, mlp] and the w_down shape [experts, mlp, hidden]: ragged_dot,
    Pallas (default tiles and a few others), Mosaic GPU, and as a peer one dense XLA GEMM of the
    same M, K, N (what cuBLAS reaches on these FLOPs without groups). TFLOP/s against the H200's
    645 TFLOP/s bf16 ceiling (docs/BENCHMARKS.md). Sampled rows are checked against x @ w[group].
The Mosaic GPU rows run last, after both models (on fresh random expert weights of the same
shapes), so that a crash there loses nothing else. Every case fails soft: an error (out of memory,
a compile failure) is recorded and the run goes on.
Layers are cut so one H200 holds the weights: Mixtral 8 of 32 layers, DeepSeek-V3 1 dense + 2 MoE
layers of 3 + 58.

  python benchmarks/moe.py --out DIR           # H200 (about 2-3 minutes)
  python benchmarks/moe.py --quick --out DIR   # tiny dims, float32, CPU smoke test (Pallas interpreted)
"""
from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jlight.core.config import ModelConfig
from jlight.core.parallel_ops import ParallelOps
from jlight.models import get_model_family
from jlight.models.moe import expert_ffn, grouped_expert_ffn
from jlight.pallas_kernels import grouped_matmul_pallas
from jlight.core.batch_metadata import BatchMetadata
from jlight.pallas_kernels.dispatch import get_kernels
from harness import result_header
from model_configs import make_config

PAGE_SIZE = 16
BF16_TFLOPS = 645.0  # measured ceiling of this H200 kind (docs/BENCHMARKS.md, kernels)
STEP_IMPLS = ("dense", "ragged_dot", "pallas", "gathered")  # gathered: decode only
# Pallas tiles tried besides the defaults: (block_m, block_n, block_k, num_warps, num_stages).
PALLAS_VARIANTS = ((64, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3))
MGPU_TILES = dict(block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)  # block_m by rows per group


def model_configs(quick: bool) -> dict[str, ModelConfig]:
    """The two shapes of benchmarks/model_configs.py, cut so one H200 holds the weights: Mixtral-8x7B
    8 of 32 layers (~2.9 GB per layer in bf16); DeepSeek-V3 1 dense + 2 MoE layers of 3 + 58 (~22.5 GB
    of routed experts per MoE layer). quick: tiny dims of the same families."""
    if quick:
        return {"mixtral-8x7b-shaped": make_config("tiny-mixtral"), "deepseek-v3-shaped": make_config("tiny-deepseek-v3")}
    return {"mixtral-8x7b-shaped": make_config("mixtral-8x7b", num_layers=8),
            "deepseek-v3-shaped": make_config("deepseek-v3", num_layers=3, num_dense_layers=1)}


def random_params(config: ModelConfig, dtype):
    """Random weights made directly in `dtype`, one leaf at a time (no float32 copy of the model)."""
    shapes = get_model_family(config).param_shapes(config)
    flat, treedef = jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.PRNGKey(0), len(flat))
    out = []
    for key, (path, shape) in zip(keys, flat):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            out.append(jnp.ones(shape, dtype))
        else:
            scale = 1.0 / np.sqrt(shape[-2] if len(shape) >= 2 else shape[-1])
            out.append(jax.jit(lambda k, s=shape, sc=scale: jax.random.normal(k, s, dtype) * jnp.asarray(sc, dtype))(key))
    return jax.tree_util.tree_unflatten(treedef, out)


def batch_metadata(batch: int, q_len: int, context: int) -> BatchMetadata:
    """`batch` sequences, each running its last `q_len` tokens of `context`, on its own pages."""
    pages_per_seq = -(-context // PAGE_SIZE)
    page_table = 1 + np.arange(batch * pages_per_seq, dtype=np.int32).reshape(batch, pages_per_seq)  # [B, pages]
    positions = np.tile(np.arange(context - q_len, context, dtype=np.int32), batch)  # [T]
    token_seq = np.repeat(np.arange(batch, dtype=np.int32), q_len)  # [T]
    slots = page_table[token_seq, positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE  # [T]
    return BatchMetadata(
        positions=jnp.asarray(positions), slot_mapping=jnp.asarray(slots), token_seq=jnp.asarray(token_seq),
        page_table=jnp.asarray(page_table), context_lens=jnp.full((batch,), context, jnp.int32),
        query_start=jnp.asarray(np.arange(batch + 1, dtype=np.int32) * q_len),
        logits_indices=jnp.asarray(np.arange(1, batch + 1, dtype=np.int32) * q_len - 1))


def timed(fn, *args, iters: int):
    """(median seconds per call after one warm-up/compile call, the warm-up call's output)."""
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times)), out


def error_text(e: Exception) -> str:
    lines = [l for l in str(e).splitlines() if l.strip()]
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def mosaic_gpu_ragged_dot(rows_per_group: float):
    """JAX's bundled Mosaic GPU ragged dot as a ragged_dot-contract callable, or raise if it is missing."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    params = inspect.signature(ragged_dot_mgpu.ragged_dot).parameters
    tiles = dict(MGPU_TILES, block_m=64 if rows_per_group <= 96 else 128)
    tiles = {k: v for k, v in tiles.items() if k in params}

    def ragged_dot(x, w, group_sizes, preferred_element_type=None):
        y = ragged_dot_mgpu.ragged_dot(x, w.astype(x.dtype), group_sizes=group_sizes, **tiles)  # x's dtype out
        return y.astype(preferred_element_type or x.dtype)

    return ragged_dot, tiles


def random_expert_layer(config: ModelConfig, dtype) -> dict:
    """Random routed-expert weights of one MoE layer (experts_gate/up/down without the layer axis)."""
    shapes = get_model_family(config).param_shapes(config)["layers"]
    keys = jax.random.split(jax.random.PRNGKey(1), 3)
    out = {}
    for key, name in zip(keys, ("experts_gate", "experts_up", "experts_down")):
        shape = shapes[name][1:]
        scale = 1.0 / np.sqrt(shape[-2])
        out[name] = jax.jit(lambda k, s=shape, sc=scale: jax.random.normal(k, s, dtype) * jnp.asarray(sc, dtype))(key)
    return out


def random_routing(key, tokens: int, num_experts: int, top_k: int):
    """Uniform random distinct top-k experts per token: (ids [T, k], weights [T, k])."""
    scores = jax.random.uniform(key, (tokens, num_experts))
    weights, ids = jax.lax.top_k(scores, top_k)
    return ids.astype(jnp.int32), weights


class Recorder:
    """Collects rows per section and rewrites DIR/moe.json after each section."""

    def __init__(self, path: str, meta: dict):
        self.path, self.result = path, dict(meta, steps=[], expert_ffn=[], grouped_matmul=[])

    def add(self, section: str, row: dict):
        self.result.setdefault(section, []).append(row)

    def run_case(self, section: str, row: dict, label: str, measure):
        """One measurement: measure() -> (fields for the row, text for the log line). Records the
        row (with the error instead, if it failed: the run goes on) and prints one line."""
        try:
            fields, text = measure()
            row.update(fields)
            print(f"{label} {text}", flush=True)
        except Exception as e:  # noqa: BLE001 - an out-of-memory or a compile failure is a result too
            row.update(error=error_text(e))
            print(f"{label} FAILED {row['error']}", flush=True)
        self.add(section, row)

    def save(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.result, f, indent=1)
        os.replace(tmp, self.path)


def timed_step(fn, params, caches, tokens, md, iters: int):
    """Like timed, for a step that takes and returns the K/V pools (donated, as in the engine, so
    no step copies the pools). caches: a one-element list holding (k_cache, v_cache), updated."""
    logits, *kv = jax.block_until_ready(fn(params, *caches[0], tokens, md))
    caches[0] = tuple(kv)
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        _, *kv = jax.block_until_ready(fn(params, *caches[0], tokens, md))
        times.append(time.perf_counter() - t)
        caches[0] = tuple(kv)
    return float(np.median(times)), logits


def bench_steps(rec: Recorder, name, config, params, iters, prefill_len, context):
    family = get_model_family(config)
    max_ctx = max(context, prefill_len)
    num_pages = 1 + 64 * (-(-max_ctx // PAGE_SIZE))
    k_shape, v_shape = family.kv_cache_shapes(config, num_pages, PAGE_SIZE)
    dtype = params["final_norm"].dtype
    new_caches = lambda: (jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype))
    caches = [new_caches()]
    for kind, batch, q_len in (("decode", 1, 1), ("decode", 64, 1), ("prefill", 1, prefill_len)):
        ctx = prefill_len if kind == "prefill" else context
        md = batch_metadata(batch, q_len, ctx)
        tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, batch * q_len), jnp.int32)
        dense_logits = None
        for impl in STEP_IMPLS:
            if impl == "gathered" and kind != "decode":
                continue
            kernels = get_kernels("auto", "auto", moe_impl=impl)

            def step(params, k_cache, v_cache, tokens, md, kernels=kernels):
                hidden, k_cache, v_cache = family.forward(params, config, tokens, k_cache, v_cache, md, kernels, ParallelOps())
                return family.compute_logits(params, config, hidden[md.logits_indices], kernels, ParallelOps()), k_cache, v_cache

            row = dict(model=name, impl=impl, kind=kind, batch=batch, tokens=batch * q_len, context=ctx,
                       layer_loop="unroll" if isinstance(params["layers"], list) else "scan")
            try:
                if any(c.is_deleted() for c in caches[0]):  # donated into a call that failed
                    caches[0] = new_caches()
                seconds, logits = timed_step(jax.jit(step, donate_argnums=(1, 2)), params, caches, tokens, md, iters)
                logits = np.asarray(logits, np.float32)
                row.update(ms=seconds * 1e3, tokens_per_s=batch * q_len / seconds, finite=bool(np.isfinite(logits).all()))
                if impl == "dense":
                    dense_logits = logits
                elif dense_logits is not None:
                    row.update(max_abs_logit_diff_vs_dense=float(np.max(np.abs(logits - dense_logits))),
                               logit_scale=float(np.max(np.abs(dense_logits))))
                diff = f"  |dlogit| vs dense {row['max_abs_logit_diff_vs_dense']:.3g}" if "max_abs_logit_diff_vs_dense" in row else ""
                print(f"{name:20s} step {impl:11s} {kind:7s} batch={batch:3d} tokens={batch * q_len:5d} "
                      f"{seconds * 1e3:9.2f} ms {batch * q_len / seconds:10.1f} tok/s{diff}", flush=True)
            except Exception as e:  # noqa: BLE001 - record (OOM, compile failure) and go on
                row.update(error=error_text(e))
                print(f"{name:20s} step {impl:11s} {kind:7s} batch={batch:3d} FAILED {row['error']}", flush=True)
            rec.add("steps", row)
    del caches
    rec.save()


def expert_ffn_inputs(config, layer, tokens: int, seed: int):
    """Random tokens and routing for one MoE layer: (x, ids, weights, experts touched, the expert
    weight bytes any implementation must read)."""
    wg = layer["experts_gate"]
    num_experts, embed, mlp = wg.shape
    key = jax.random.PRNGKey(seed)
    x = jax.random.normal(key, (tokens, embed), wg.dtype)  # [T, embed]
    ids, weights = random_routing(jax.random.fold_in(key, 1), tokens, num_experts, config.extra["num_experts_per_tok"])
    touched = len(np.unique(np.asarray(ids)))
    return x, ids, weights, touched, touched * 3 * embed * mlp * wg.dtype.itemsize


def jitted_expert_ffn(impl):
    """impl: an expert_ffn implementation name, or a grouped matmul callable (ragged_dot's contract)."""
    if callable(impl):
        return jax.jit(lambda *a: grouped_expert_ffn(*a, jax.nn.silu, grouped_matmul=impl))
    grouped = get_kernels(moe_impl="pallas").grouped_matmul  # what "pallas" (and "auto" on GPU) run
    return jax.jit(lambda *a: expert_ffn(*a, jax.nn.silu, impl, grouped))


def bench_expert_ffn(rec: Recorder, name, config, layer, iters, token_counts, mgpu=None):
    """One MoE layer's routed experts alone, on random routing. mgpu given: only the Mosaic GPU case."""
    wg, wu, wd = layer["experts_gate"], layer["experts_up"], layer["experts_down"]
    for tokens in token_counts:
        x, ids, weights, touched, weight_bytes = expert_ffn_inputs(config, layer, tokens, seed=tokens)
        impls = ["mosaic_gpu"] if mgpu is not None else [i for i in STEP_IMPLS if i != "gathered" or tokens <= 64]
        for impl in impls:
            row = dict(model=name, impl=impl, tokens=tokens, experts_touched=touched)

            def measure(impl=impl, row=row):
                if impl == "mosaic_gpu":
                    if isinstance(mgpu, Exception):
                        raise mgpu
                    fn = jitted_expert_ffn(mgpu[0])
                    row.update(tiles=mgpu[1])
                else:
                    fn = jitted_expert_ffn(impl)
                seconds, _ = timed(fn, x, ids, weights, wg, wu, wd, iters=iters)
                return (dict(ms=seconds * 1e3, needed_weight_gb_per_s=weight_bytes / seconds / 1e9),
                        f"experts touched={touched:3d} {seconds * 1e3:9.3f} ms  needed-weights rate "
                        f"{weight_bytes / seconds / 1e9:8.1f} GB/s")

            rec.run_case("expert_ffn", row, f"{name:20s} expert FFN {impl:11s} tokens={tokens:5d}", measure)
    rec.save()


# Decode-shape tiles for the Pallas grouped matmul (block_n, block_k); block_m stays the default
# (16 rows at decode). The 2026-11-29 14:02 UTC run had the defaults (64, 64) read the needed expert
# weights at 0.94 TB/s at batch 1 on DeepSeek (8 of 256 experts) and lose to dense at batch 64 on Mixtral.
DECODE_TILES = [(bn, bk) for bn in (16, 32, 64, 128) for bk in (64, 128, 256)]


def bench_decode_tiles(rec: Recorder, name, config, layer, iters, quick):
    """One MoE layer's routed experts at decode sizes (1 and 64 tokens): the Pallas grouped matmul
    with each of DECODE_TILES against dense and gathered; every output compared with dense's."""
    wg, wu, wd = layer["experts_gate"], layer["experts_up"], layer["experts_down"]
    tiles = [(16, 16)] if quick else DECODE_TILES
    for tokens in (1, 64):
        x, ids, weights, touched, weight_bytes = expert_ffn_inputs(config, layer, tokens, seed=100 + tokens)
        cases = [("dense", "dense"), ("gathered", "gathered"), ("pallas default", "pallas")]
        cases += [(f"pallas bn{bn} bk{bk}", functools.partial(grouped_matmul_pallas.grouped_matmul, block_n=bn, block_k=bk))
                  for bn, bk in tiles]
        dense = []  # the first case's output, which every case is compared with

        def measure(impl):
            seconds, out = timed(jitted_expert_ffn(impl), x, ids, weights, wg, wu, wd, iters=iters)
            out = np.asarray(out, np.float32)
            dense[:] = dense or [out]
            diff = float(np.abs(out - dense[0]).max())
            return (dict(ms=seconds * 1e3, needed_weight_gb_per_s=weight_bytes / seconds / 1e9, max_abs_diff_vs_dense=diff),
                    f"{seconds * 1e3:8.3f} ms  needed-weights {weight_bytes / seconds / 1e9:7.1f} GB/s  max|diff| vs dense {diff:.3g}")

        for label, impl in cases:
            row = dict(model=name, impl=label, tokens=tokens, experts_touched=touched)
            rec.run_case("decode_tiles", row, f"{name:20s} decode tiles {label:22s} tokens={tokens:3d}",
                         lambda impl=impl: measure(impl))
    rec.save()


def _sampled_rows_error(out, x, w, group_sizes, key, samples: int = 64):
    """max |out - x @ w[group]| over `samples` random rows, relative to the reference's max."""
    m = x.shape[0]
    rows = jax.random.randint(key, (samples,), 0, m)
    group = jnp.searchsorted(jnp.cumsum(group_sizes), rows, side="right")

    @jax.jit
    def reference(x_rows, group):  # one row at a time: no [samples, K, N] gather of weights
        return jax.lax.map(lambda a: jnp.dot(a[0], w[a[1]], preferred_element_type=jnp.float32), (x_rows, group))

    want = reference(x[rows], group)
    got = out[rows].astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))


def bench_grouped_matmul(rec: Recorder, name, config, layer, iters, prefill_len, quick, mgpu=None):
    """The grouped matmul alone on a prefill's sorted rows (M = prefill_len * top_k).
    mgpu given: only the Mosaic GPU case."""
    top_k = config.extra["num_experts_per_tok"]
    for label, w in (("w_gate/w_up", layer["experts_gate"]), ("w_down", layer["experts_down"])):
        num_groups, k, n = w.shape
        m = prefill_len * top_k
        key = jax.random.PRNGKey(m + k)
        x = jax.random.normal(key, (m, k), w.dtype)  # rows already "sorted": only the group sizes matter
        ids, _ = random_routing(jax.random.fold_in(key, 1), prefill_len, num_groups, top_k)
        group_sizes = jnp.bincount(ids.reshape(-1), length=num_groups).astype(jnp.int32)
        flops = 2 * m * k * n
        defaults = grouped_matmul_pallas.default_tiles(m, k, n, num_groups)
        variants = [("pallas", {})]
        for bm, bn, bk, nw, ns in PALLAS_VARIANTS:
            tiles = dict(block_m=bm, block_n=min(bn, n), block_k=min(bk, k), num_warps=nw, num_stages=ns)
            if quick or tiles == defaults or n % tiles["block_n"] or k % tiles["block_k"]:
                continue
            variants.append((f"pallas bm{bm} bn{bn} bk{bk} w{nw} s{ns}", tiles))
        cases = [("ragged_dot", lambda x, w, gs: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32), {})]
        cases += [(label_, functools.partial(grouped_matmul_pallas.grouped_matmul, preferred_element_type=jnp.float32, **t),
                   t or defaults) for label_, t in variants]
        cases += [("xla_dense_gemm_same_mkn", lambda x, w, gs: jnp.dot(x, w[0], preferred_element_type=jnp.float32), {})]
        if mgpu is not None:
            cases = [("mosaic_gpu", None, {})]
        for impl, f, tiles in cases:
            row = dict(model=name, matrix=label, impl=impl, m=m, k=k, n=n, groups=num_groups,
                       nonempty_groups=int(jnp.sum(group_sizes > 0)), gflop=flops / 1e9)
            if tiles:
                row.update(tiles=tiles)

            def measure(impl=impl, f=f, row=row):
                if impl == "mosaic_gpu":
                    if isinstance(mgpu, Exception):
                        raise mgpu
                    f = lambda x, w, gs: mgpu[0](x, w, gs, preferred_element_type=jnp.float32)
                    row.update(tiles=mgpu[1], note="bf16 output (the kernel writes x's dtype)")
                seconds, out = timed(jax.jit(f), x, w, group_sizes, iters=iters)
                tflops = flops / seconds / 1e12
                fields = dict(ms=seconds * 1e3, tflops=tflops, fraction_of_bf16_ceiling=tflops / BF16_TFLOPS)
                if impl != "xla_dense_gemm_same_mkn":
                    fields.update(sampled_rows_rel_error=_sampled_rows_error(out, x, w, group_sizes, jax.random.fold_in(key, 2)))
                err = f"  sampled-row rel err {fields['sampled_rows_rel_error']:.2g}" if "sampled_rows_rel_error" in fields else ""
                return fields, (f"M={m} K={k} N={n} {seconds * 1e3:8.3f} ms {tflops:7.1f} TFLOP/s "
                                f"({100 * tflops / BF16_TFLOPS:4.1f}% of {BF16_TFLOPS:.0f}){err}")

            rec.run_case("grouped_matmul", row, f"{name:20s} grouped matmul {label:11s} {impl:32s}", measure)
    if mgpu is not None:
        rec.save()
        return
    # Rows past sum(group_sizes) must be zeros (on the GPU the output buffer is not pre-zeroed).
    w = layer["experts_down"]
    num_groups, k, _ = w.shape
    sizes = jnp.zeros((num_groups,), jnp.int32).at[: min(3, num_groups)].set(jnp.array([100, 0, 37][:num_groups], jnp.int32))
    x = jax.random.normal(jax.random.PRNGKey(5), (200, k), w.dtype)
    row = dict(model=name, matrix="w_down", impl="pallas tail check", m=200, rows_with_groups=137)

    def tail_check():
        out = np.asarray(jax.jit(lambda x, w, gs: grouped_matmul_pallas.grouped_matmul(
            x, w, gs, preferred_element_type=jnp.float32))(x, w, sizes))
        fields = dict(tail_rows_all_zero=bool((out[137:] == 0).all()), finite=bool(np.isfinite(out).all()),
                      sampled_rows_rel_error=_sampled_rows_error(jnp.asarray(out[:137]), x[:137], w, sizes, jax.random.PRNGKey(6)))
        return fields, (f"rows past sum(group_sizes) all zero: {fields['tail_rows_all_zero']}, "
                        f"sampled-row rel err {fields['sampled_rows_rel_error']:.2g}")

    rec.run_case("grouped_matmul", row, f"{name:20s} grouped matmul tail check:", tail_check)
    rec.save()


def summary(result: dict) -> str:
    """Compact markdown tables of moe.json (the end of the printed output)."""
    cell = lambda r, key, fmt: (fmt.format(r[key]) if key in r else "ERR " + r.get("error", "?")[:40])
    lines = ["| model | step | " + " | ".join(STEP_IMPLS) + " |", "|---|---|" + "---|" * len(STEP_IMPLS)]
    steps = result["steps"]
    for model in dict.fromkeys(r["model"] for r in steps):
        for kind, batch in dict.fromkeys((r["kind"], r["batch"]) for r in steps if r["model"] == model):
            rows = {r["impl"]: r for r in steps if (r["model"], r["kind"], r["batch"]) == (model, kind, batch)}
            cells = [cell(rows[i], "ms", "{:.2f} ms") if i in rows else "-" for i in STEP_IMPLS]
            lines.append(f"| {model} | {kind} b={batch} | " + " | ".join(cells) + " |")
    ffn_impls = STEP_IMPLS + ("mosaic_gpu",)
    lines += ["", "| model | expert FFN tokens | " + " | ".join(ffn_impls) + " |", "|---|---|" + "---|" * len(ffn_impls)]
    ffn = result["expert_ffn"]
    for model, tokens in dict.fromkeys((r["model"], r["tokens"]) for r in ffn):
        rows = {r["impl"]: r for r in ffn if (r["model"], r["tokens"]) == (model, tokens)}
        lines.append(f"| {model} | {tokens} | " + " | ".join(
            cell(rows[i], "ms", "{:.3f} ms") if i in rows else "-" for i in ffn_impls) + " |")
    lines += ["", "| model | matrix | impl | ms | TFLOP/s | % of 645 |", "|---|---|---|---|---|---|"]
    for r in result["grouped_matmul"]:
        if "tail_rows_all_zero" in r:
            lines.append(f"| {r['model']} | {r['matrix']} | {r['impl']}: rows past the groups all zero = "
                         f"{r['tail_rows_all_zero']}, sampled-row rel err {r['sampled_rows_rel_error']:.2g} | | | |")
        elif "tflops" in r:
            lines.append(f"| {r['model']} | {r['matrix']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.1f} | "
                         f"{100 * r['fraction_of_bf16_ceiling']:.1f} |")
        elif "error" in r:
            lines.append(f"| {r['model']} | {r['matrix']} | {r['impl']} | ERR {r['error'][:60]} | | |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for moe.json")
    ap.add_argument("--quick", "--tiny", action="store_true", help="tiny dims, float32 (CPU smoke test of the script)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 5, quick 1)")
    ap.add_argument("--models", default="mixtral,deepseek", help="comma list: mixtral, deepseek")
    ap.add_argument("--sections", default="steps,expert_ffn,grouped_matmul,mosaic_gpu",
                    help="comma list of sections to run (mosaic_gpu: the Mosaic GPU rows of expert_ffn/grouped_matmul; "
                         "decode_tiles, not in the default: Pallas decode-shape tile sweep)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    iters = args.iters or (1 if args.quick else 5)
    sections = set(args.sections.split(","))
    prefill_len, context = (64, 32) if args.quick else (2048, 512)
    dtype = jnp.float32 if args.quick else jnp.bfloat16
    meta = dict(result_header(), device=str(jax.devices()[0].device_kind), quick=args.quick, dtype=str(jnp.dtype(dtype)),
                iters=iters, bf16_tflops_ceiling=BF16_TFLOPS,
                note=("random weights; Mixtral-8x7B shapes with 8 of 32 layers; DeepSeek-V3 shapes with 1 dense + 2 MoE "
                      "of 3 + 58 layers; every layer unrolled (unstack_layers); decode at context 512; steps include "
                      "the LM head; expert_ffn and grouped_matmul use the first MoE layer's weights and uniform random routing"))
    rec = Recorder(os.path.join(args.out, "moe.json"), meta)
    wanted = args.models.split(",")
    configs = {name: c for name, c in model_configs(args.quick).items() if any(name.startswith(w) for w in wanted)}
    for name, config in configs.items():
        family = get_model_family(config)
        t = time.perf_counter()
        params = random_params(config, dtype)
        jax.block_until_ready(params)
        num_params = sum(a.size for a in jax.tree.leaves(params))
        params = family.unstack_layers(params, donate=True)  # layer_loop="unroll", the GPU default
        jax.block_until_ready(params)
        print(f"{name}: {config.num_layers} layers, {num_params / 1e9:.2f}B params, unrolled "
              f"(made in {time.perf_counter() - t:.1f} s)", flush=True)
        layer = params["layers"][0]  # the first MoE layer
        if "steps" in sections:
            bench_steps(rec, name, config, params, iters, prefill_len, context)
        if "expert_ffn" in sections:
            bench_expert_ffn(rec, name, config, layer, iters, sorted({1, 64, prefill_len}))
        if "grouped_matmul" in sections:
            bench_grouped_matmul(rec, name, config, layer, iters, prefill_len, args.quick)
        del params, layer
    # JAX's Mosaic GPU ragged dot last, on fresh random expert weights: if it takes the process
    # down, everything above is already in moe.json.
    if "decode_tiles" in sections:  # one random MoE layer per model (no steps): cheap to make
        for name, config in configs.items():
            layer = random_expert_layer(config, dtype)
            bench_decode_tiles(rec, name, config, layer, iters, args.quick)
            del layer
    if "mosaic_gpu" in sections:
        for name, config in configs.items():
            layer = random_expert_layer(config, dtype)
            num_experts = layer["experts_gate"].shape[0]
            top_k = config.extra["num_experts_per_tok"]
            try:
                mgpu = mosaic_gpu_ragged_dot(prefill_len * top_k / num_experts)
            except Exception as e:  # noqa: BLE001 - not importable: recorded in every Mosaic GPU row
                print(f"mosaic_gpu ragged_dot unavailable: {error_text(e)}", flush=True)
                mgpu = e
            if "expert_ffn" in sections:
                bench_expert_ffn(rec, name, config, layer, iters, sorted({1, 64, prefill_len}), mgpu)
            if "grouped_matmul" in sections:
                bench_grouped_matmul(rec, name, config, layer, iters, prefill_len, args.quick, mgpu)
            del layer
    rec.save()
    print(summary(rec.result))
    print(f"wrote {rec.path}")


if __name__ == "__main__":
    main()
