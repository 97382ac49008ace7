"""MoE / MLA benchmark: random-weight Mixtral-8x7B- and DeepSeek-V3-shaped models (fewer layers).

Measures, for each model and for each way of computing the routed experts,
  * decode step latency at batch 1 and 64 (each sequence at a 512-token context),
  * prefill of one 2048-token sequence,
  * the expert FFN of one layer alone at 1, 64 and 2048 tokens,
where the expert implementations are
  * grouped: tokens sorted by expert, jax.lax.ragged_dot (jlight's default, models/moe.py);
  * grouped_triton (GPU only): the same with JAX's Pallas-Triton ragged_dot lowering;
  * dense: every expert on every token (the baseline).
Layers are cut so one H200 holds the weights (stated in the output): Mixtral 8 of 32 layers,
DeepSeek-V3 1 dense + 2 MoE layers of 3 + 58. Prints a table and writes DIR/moe.json.

  python benchmarks/moe.py --out DIR          # H200-sized (about 45 GB of bf16 weights per model)
  python benchmarks/moe.py --tiny --out DIR   # tiny dims, runs on CPU in about a minute
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jlight.config import ModelConfig
from jlight.models import get_model_family
from jlight.models.moe import dense_expert_ffn, grouped_expert_ffn
from jlight.pallas_kernels.batch_metadata import BatchMetadata
from jlight.pallas_kernels.dispatch import get_kernels
from jlight.sharding import ops as parallel_ops

PAGE_SIZE = 16


def model_configs(tiny: bool) -> dict[str, ModelConfig]:
    if tiny:
        mixtral = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
        ds = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                  n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=32, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=4, topk_group=2)
    else:
        # Mixtral-8x7B: 32 layers in the real model; 8 here (~12 GB/layer of experts in bf16).
        mixtral = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                       num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2)
        # DeepSeek-V3: 3 dense + 58 MoE layers in the real model; 1 dense + 2 MoE here (~22.5 GB per MoE layer).
        ds = dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=3,
                  num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256, num_experts_per_tok=8,
                  moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=1, n_group=8, topk_group=4)
    mixtral.update(architectures=["MixtralForCausalLM"], model_type="mixtral", max_position_embeddings=32768,
                   rope_theta=1e6, rms_norm_eps=1e-5)
    ds.update(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", max_position_embeddings=163840,
              num_key_value_heads=ds["num_attention_heads"], rms_norm_eps=1e-6, routed_scaling_factor=2.5,
              norm_topk_prob=True, topk_method="noaux_tc",
              rope_scaling=dict(type="yarn", factor=40, original_max_position_embeddings=4096, beta_fast=32,
                                beta_slow=1, mscale=1.0, mscale_all_dim=1.0))
    return {"mixtral-8x7b-shaped": ModelConfig.from_hf_dict(mixtral), "deepseek-v3-shaped": ModelConfig.from_hf_dict(ds)}


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


class _DenseExperts(parallel_ops.ParallelOps):
    def expert_ffn(self, x, topk_ids, topk_weights, w_gate, w_up, w_down, act, matmul):
        return dense_expert_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, act)


_TRITON_FLAG = "jax_ragged_dot_use_gpu_pallas_triton_lowering"


@contextlib.contextmanager
def expert_impl(name: str):
    """Trace under the given expert FFN implementation."""
    ops = _DenseExperts() if name == "dense" else parallel_ops.ParallelOps()
    old = getattr(jax.config, _TRITON_FLAG, None)
    if old is not None:
        jax.config.update(_TRITON_FLAG, name == "grouped_triton")
    try:
        with parallel_ops.use(ops):
            yield
    finally:
        if old is not None:
            jax.config.update(_TRITON_FLAG, old)


def triton_lowering_works() -> bool:
    """JAX 0.11.2 has the flag but not the module behind it: try a tiny ragged_dot under it."""
    if not hasattr(jax.config, _TRITON_FLAG):
        return False
    try:
        with expert_impl("grouped_triton"):
            x = jnp.ones((16, 64), jnp.bfloat16)
            w = jnp.ones((2, 64, 64), jnp.bfloat16)
            jax.block_until_ready(jax.jit(jax.lax.ragged_dot)(x, w, jnp.array([8, 8], jnp.int32)))
        return True
    except Exception as e:  # noqa: BLE001 - any failure means: measure without it
        print(f"grouped_triton skipped: {type(e).__name__}: {e}")
        return False


def timed(fn, *args, iters: int) -> float:
    """Median seconds per call after one warm-up (compile) call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def bench_model(name, config, params, impls, iters, prefill_len, context):
    family = get_model_family(config)
    kernels = get_kernels("auto", "auto")
    batches = [("decode", 1, 1), ("decode", 64, 1), ("prefill", 1, prefill_len)]
    max_ctx = max(context, prefill_len)
    num_pages = 1 + 64 * (-(-max_ctx // PAGE_SIZE))
    k_shape, v_shape = family.kv_cache_shapes(config, num_pages, PAGE_SIZE)
    dtype = params["final_norm"].dtype
    k_cache, v_cache = jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype)
    rows = []
    for impl in impls:
        for kind, batch, q_len in batches:
            ctx = prefill_len if kind == "prefill" else context
            md = batch_metadata(batch, q_len, ctx)
            tokens = jnp.asarray(np.random.default_rng(0).integers(0, config.vocab_size, batch * q_len), jnp.int32)

            def step(params, k_cache, v_cache, tokens, md):
                hidden, k_cache, v_cache = family.forward(params, config, tokens, k_cache, v_cache, md, kernels)
                return family.compute_logits(params, config, hidden[md.logits_indices], kernels), k_cache, v_cache

            with expert_impl(impl):
                fn = jax.jit(step)
                try:
                    seconds = timed(fn, params, k_cache, v_cache, tokens, md, iters=iters)
                except jax.errors.JaxRuntimeError as e:  # e.g. out of memory: record it, measure the rest
                    print(f"{name:22s} {impl:15s} {kind:8s} batch={batch:3d} FAILED: {str(e).splitlines()[0][:120]}", flush=True)
                    rows.append(dict(model=name, impl=impl, kind=kind, batch=batch, tokens=batch * q_len, context=ctx,
                                     error=str(e).splitlines()[0]))
                    continue
            rows.append(dict(model=name, impl=impl, kind=kind, batch=batch, tokens=batch * q_len, context=ctx,
                             ms=seconds * 1e3, tokens_per_s=batch * q_len / seconds))
            print(f"{name:22s} {impl:15s} {kind:8s} batch={batch:3d} tokens={batch * q_len:5d} ctx={ctx:5d} "
                  f"{seconds * 1e3:9.2f} ms  {batch * q_len / seconds:10.1f} tok/s", flush=True)
    return rows


def bench_expert_ffn(name, config, params, impls, iters, token_counts):
    """One MoE layer's routed experts alone, on random routing."""
    lp = jax.tree.map(lambda a: a[0], params["layers"])
    wg, wu, wd = lp["experts_gate"], lp["experts_up"], lp["experts_down"]
    num_experts, embed, mlp = wg.shape
    top_k = config.extra["num_experts_per_tok"]
    rows = []
    for tokens in token_counts:
        key = jax.random.PRNGKey(tokens)
        x = jax.random.normal(key, (tokens, embed), wg.dtype)  # [T, embed]
        scores = jax.random.uniform(jax.random.fold_in(key, 1), (tokens, num_experts))
        weights, ids = jax.lax.top_k(scores, top_k)  # [T, k] distinct random experts per token
        touched = len(np.unique(np.asarray(ids)))
        weight_bytes = touched * 3 * embed * mlp * wg.dtype.itemsize  # bytes any implementation must read
        for impl in impls:
            f = dense_expert_ffn if impl == "dense" else grouped_expert_ffn
            with expert_impl(impl):
                fn = jax.jit(lambda *a, f=f: f(*a, jax.nn.silu))
                try:
                    seconds = timed(fn, x, ids, weights, wg, wu, wd, iters=iters)
                except jax.errors.JaxRuntimeError as e:
                    print(f"{name:22s} expert FFN {impl:15s} tokens={tokens:5d} FAILED: {str(e).splitlines()[0][:120]}", flush=True)
                    rows.append(dict(model=name, impl=impl, tokens=tokens, error=str(e).splitlines()[0]))
                    continue
            rows.append(dict(model=name, impl=impl, tokens=tokens, experts_touched=touched, ms=seconds * 1e3,
                             needed_weight_gb_per_s=weight_bytes / seconds / 1e9))
            print(f"{name:22s} expert FFN {impl:15s} tokens={tokens:5d} experts touched={touched:3d} "
                  f"{seconds * 1e3:9.3f} ms  needed-weights rate {weight_bytes / seconds / 1e9:8.1f} GB/s", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for moe.json")
    ap.add_argument("--tiny", action="store_true", help="tiny dims (CPU check of the script)")
    ap.add_argument("--iters", type=int, default=None, help="timed calls per measurement (default 5, tiny 2)")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    iters = args.iters or (2 if args.tiny else 5)
    on_gpu = jax.default_backend() == "gpu"
    impls = ["grouped"] + (["grouped_triton"] if on_gpu and triton_lowering_works() else []) + ["dense"]
    prefill_len, context = (64, 32) if args.tiny else (2048, 512)
    dtype = jnp.float32 if args.tiny else jnp.bfloat16
    result = dict(date=datetime.datetime.now(datetime.timezone.utc).isoformat(), backend=jax.default_backend(),
                  device=str(jax.devices()[0].device_kind), jax=jax.__version__, tiny=args.tiny, dtype=str(jnp.dtype(dtype)),
                  note=("random weights; Mixtral-8x7B shapes with 8 of 32 layers; DeepSeek-V3 shapes with 1 dense + 2 MoE "
                        "of 3 + 58 layers; decode at context 512; steps include the LM head"),
                  steps=[], expert_ffn=[])
    for name, config in model_configs(args.tiny).items():
        t = time.perf_counter()
        params = random_params(config, dtype)
        jax.block_until_ready(params)
        print(f"{name}: {config.num_layers} layers, {sum(a.size for a in jax.tree.leaves(params)) / 1e9:.2f}B params "
              f"(made in {time.perf_counter() - t:.1f} s)", flush=True)
        result["steps"] += bench_model(name, config, params, impls, iters, prefill_len, context)
        result["expert_ffn"] += bench_expert_ffn(name, config, params, impls, iters, sorted({1, 64, prefill_len}))
        del params
    path = os.path.join(args.out, "moe.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
