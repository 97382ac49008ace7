"""How many 32k-token sequences fit at once, by the engine's own pool sizing (startup.pages_for_memory).
No device and no weights: shapes only.

  --model qwen3-next (the default): a Qwen3-Next-80B-A3B-shaped hybrid model (gated DeltaNet in three layers
  of four) against the same model with attention in every layer: the KV page bytes of the family's
  kv_cache_shapes, after the recurrent-state pools of state_pool.bytes_for.
  --model gemma3-12b: a Gemma-3-12B-shaped model (5 local layers with a 1024-token window : 1 global) with
  the windowed pool (kv_groups.py: the pages of one group's layers each, a window group holding only the
  pages its window sees) against the pool that keeps every page (disable_hybrid_kv_cache_manager).

  python benchmarks/hybrid_memory.py [--model qwen3-next|gemma3-12b] [--cache-gib 64] [--context 32768] [--page-size 16]

The budget is the memory the engine's caches get (what is left after the weights at its
gpu_memory_utilization); prints one JSON object per model.
"""
from __future__ import annotations

import argparse
import json

import jax.numpy as jnp

from jlight.core.config import ModelConfig
from jlight.core.quantization import kv_pool_bytes
from jlight.engine import kv_groups, state_pool
from jlight.engine.startup import pages_for_memory
from jlight.models import get_model_family

# transformers' Qwen3NextConfig defaults, the Qwen3-Next-80B-A3B shape.
QWEN3_NEXT_80B = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
    intermediate_size=5632, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
    linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    num_experts_per_tok=10, num_experts=512, norm_topk_prob=True, max_position_embeddings=262144,
    full_attention_interval=4, partial_rotary_factor=0.25, rope_theta=10000000.0)

# Gemma-3-12B's text model (google/gemma-3-12b-it's text_config; MaxText's gemma3-12b.yml has the same shape):
# 48 layers, every sixth global, 16 heads, 8 KV heads of 256, a 1024-token window on the local layers.
GEMMA3_12B = dict(
    architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", vocab_size=262208, hidden_size=3840,
    intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
    sliding_window=1024, sliding_window_pattern=6, query_pre_attn_scalar=256, rope_theta=1000000.0,
    rope_local_base_freq=10000.0, rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=131072)


def windowed_sequences(config: ModelConfig, budget_bytes: int, context: int, page_size: int, by_kind: bool,
                       chunk: int = 1, dtype=jnp.bfloat16) -> dict:
    """The most sequences of `context` tokens whose pages fit `budget_bytes`: the engine's layout
    (kv_groups.layout_for), its page bytes (kv_groups.pool_shapes) and the page ids a sequence holds in
    every group while computing `chunk` tokens a step (kv_groups.pages_per_sequence)."""
    family = get_model_family(config)
    layout = kv_groups.layout_for(family, config, by_kind)
    k_shape, v_shape = kv_groups.pool_shapes(family, config, 1, page_size, layout)
    bytes_per_page = sum(kv_pool_bytes(s, "auto", dtype) for s in (k_shape, v_shape))
    pages = pages_for_memory({"bytes_limit": budget_bytes, "bytes_in_use": 0}, bytes_per_page, 1.0, None) - 1  # page 0
    per_seq = kv_groups.pages_per_sequence(layout.windows, page_size, context, chunk)
    return dict(kv_groups=layout.num_groups, layers_a_page=k_shape[0], page_bytes=bytes_per_page, pages=pages,
                pages_per_sequence=per_seq, bytes_per_sequence=per_seq * bytes_per_page, concurrent_sequences=pages // per_seq)


def gemma_rows(args, budget: int) -> list[dict]:
    config = ModelConfig.from_hf_dict(GEMMA3_12B)
    rows = []
    for name, by_kind, chunk in (("windowed pool, every sequence decoding", True, 1),
                                 (f"windowed pool, every sequence in a {args.chunk}-token prefill chunk", True, args.chunk),
                                 ("every page kept (disable_hybrid_kv_cache_manager)", False, 1)):
        row = dict(model="gemma3-12b shape", pool=name, cache_gib=args.cache_gib, context=args.context,
                   page_size=args.page_size, **windowed_sequences(config, budget, args.context, args.page_size, by_kind, chunk))
        rows.append(row)
        print(json.dumps(row))
    return rows


def concurrent_sequences(config: ModelConfig, budget_bytes: int, context: int, page_size: int, prefix_caching: bool,
                         dtype=jnp.bfloat16) -> dict:
    """The most sequences of `context` tokens whose pages and state slots fit `budget_bytes`, the engine's way:
    max_num_seqs = N gives the StatePool's slots (N + 1, and N snapshot slots with prefix caching), the rest
    of the budget pages."""
    family = get_model_family(config)
    k_shape, v_shape = family.kv_cache_shapes(config, 1, page_size)
    bytes_per_page = sum(kv_pool_bytes(s, "auto", dtype) for s in (k_shape, v_shape))
    state_fn = getattr(family, "state_shapes", None)
    slots = lambda n: state_pool.StatePool(n, n if prefix_caching else 0).total_slots
    state_bytes = lambda n: state_pool.bytes_for(state_fn, config, slots(n)) if state_fn else 0
    pages_per_seq = -(-context // page_size)
    stats = {"bytes_limit": budget_bytes, "bytes_in_use": 0}
    fits = lambda n: pages_for_memory(stats, bytes_per_page, 1.0, None, state_bytes(n)) - 1 >= n * pages_per_seq
    lo, hi = 0, budget_bytes // (pages_per_seq * bytes_per_page) + 1  # page 0 is scratch
    while lo < hi:  # the largest n that fits
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    slot = state_bytes(1) // slots(1)
    return dict(attention_layers=k_shape[0], kv_bytes_per_token=bytes_per_page // page_size,
                state_bytes_per_sequence=slot, bytes_per_sequence=pages_per_seq * bytes_per_page + slot,
                concurrent_sequences=lo)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache-gib", type=float, default=64.0)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--model", choices=("qwen3-next", "gemma3-12b"), default="qwen3-next")
    ap.add_argument("--chunk", type=int, default=2048, help="gemma3-12b: the prefill chunk of the worst case (the GPU's "
                    "default max_num_batched_tokens)")
    args = ap.parse_args(argv)
    budget = int(args.cache_gib * 2 ** 30)
    if args.model == "gemma3-12b":
        return gemma_rows(args, budget)
    hybrid = ModelConfig.from_hf_dict(QWEN3_NEXT_80B)
    full = ModelConfig.from_hf_dict(dict(QWEN3_NEXT_80B, layer_types=["full_attention"] * 48))
    rows = []
    for name, config in (("qwen3-next-80b-a3b (hybrid)", hybrid), ("same shape, attention in all 48 layers", full)):
        row = dict(model=name, cache_gib=args.cache_gib, context=args.context, page_size=args.page_size,
                   **concurrent_sequences(config, budget, args.context, args.page_size, prefix_caching=False))
        row["concurrent_sequences_with_prefix_caching"] = concurrent_sequences(
            config, budget, args.context, args.page_size, prefix_caching=True)["concurrent_sequences"]
        rows.append(row)
        print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()
