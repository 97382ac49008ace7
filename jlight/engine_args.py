"""The engine options every engine-backed command shares (`jlight generate`, `chat`, `serve`, `batch`):
argparse flags, and the EngineConfig keyword arguments they give."""
from __future__ import annotations

import argparse
import json


def add_engine_arguments(p: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """Options every engine-backed command shares."""
    if model_positional:
        p.add_argument("model", nargs="?", default=None, help="HF directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    else:
        p.add_argument("--model", "-m", default=None, help="HF directory, .gguf file or hub id (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--quantization", default=None, choices=["int8", "w8a8", "fp8", "mxfp4"],
                   help="int8: weight-only (faster decode at small batches, slower prefill on GPU); w8a8: int8 activations too "
                        "(faster prefill); fp8: e4m3 weights with a scale per output channel, e4m3 activations per token in "
                        "steps of >= --fp8-w8a8-min-rows tokens (docs/BENCHMARKS.md has the figures and quality). HF FP8 "
                        "checkpoints (compressed-tensors, fp8) load as fp8 without this flag; mxfp4: an MXFP4 checkpoint's "
                        "experts (gpt-oss) kept as stored, 4 bits a weight (without it they load expanded)")
    p.add_argument("--fp8-w8a8-min-rows", type=int, default=None,
                   help="fp8 weights: steps of at least this many tokens multiply fp8 x fp8, smaller ones upcast the "
                        "weights (0: always fp8 x fp8; default 64)")
    p.add_argument("--gguf-weights", default=None, choices=["auto", "dequantize"],
                   help="a GGUF file's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K weights on the CPU: auto keeps them as stored and multiplies them "
                        "in float32 in jlight's CPU kernel (built once with the C++ compiler); dequantize: float weights")
    p.add_argument("--mesh", default=None, help='device mesh, e.g. "tp=2" or "dp=2,tp=4"')
    p.add_argument("--disaggregated", default=None,
                   help='prefill and decode on separate devices in one process, e.g. "prefill=4,decode=4": a prefill '
                        "engine on the first 4 devices and a decode engine on the next 4 (tensor parallel in each)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, help="shorthand for --mesh tp=N")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--page-size", type=int, default=None)
    p.add_argument("--num-pages", type=int, default=None)
    p.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                   help="of the device memory left after the weights, for KV pages (default 0.8)")
    p.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vLLM's knob instead: the engine's whole share of the device memory JAX manages "
                        "(weights included); the KV pool gets the rest of that share")
    p.add_argument("--kv-cache-dtype", default=None, choices=["auto", "fp8", "int8"],
                   help="auto: the model's dtype; fp8: e4m3 K/V (2x the pages of bf16); int8: int8 K/V with a scale per "
                        "token and head (about 2x the pages)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--kv-offloading-size", type=float, default=None,
                   help="GiB of host memory for KV pages the prefix cache evicts (vLLM's flag): copied there instead of "
                        "dropped, and back on a later prefix hit (default: off)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="keep every page of every layer (vLLM's flag); default: a model with sliding-window layers "
                        "beside full-attention ones gives back the pages a window no longer sees")
    p.add_argument("--attention-impl", default=None, choices=["auto", "reference", "pallas", "mosaic", "triton"])
    p.add_argument("--matmul-impl", default=None, choices=["auto", "reference", "pallas"])
    p.add_argument("--speculative-config", default=None, type=_json_object,
                   help='speculative decoding as JSON, vLLM\'s names: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4, "prompt_lookup_min": 1}\'; methods ngram, draft_model, eagle, eagle3 '
                        '(with "model": PATH) and deepseek_mtp')
    p.add_argument("--moe-impl", default=None, choices=["auto", "pallas", "ragged_dot", "gathered", "dense"],
                   help="how MoE experts run (auto: the Pallas grouped matmul on GPU; gathered or ragged_dot elsewhere)")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}); write e.g. '{{\"method\": \"ngram\"}}'") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object such as '{{\"method\": \"ngram\"}}', got {text!r}")
    return value


def engine_options(args: argparse.Namespace, **defaults) -> dict:
    """EngineConfig keyword arguments from parsed options (only those the user set, over `defaults`)."""
    opts = dict(defaults)
    for name in ("dtype", "quantization", "mesh", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "page_size",
                 "num_pages", "kv_cache_memory_fraction", "gpu_memory_utilization", "kv_cache_dtype", "kv_offloading_size",
                 "disaggregated", "attention_impl", "matmul_impl", "moe_impl", "speculative_config", "fp8_w8a8_min_rows",
                 "gguf_weights"):
        value = getattr(args, name, None)
        if value is not None:
            opts[name] = value
    tp = getattr(args, "tensor_parallel_size", None)
    if tp is not None:
        if opts.get("mesh"):
            raise ValueError("give either --mesh or --tensor-parallel-size, not both")
        opts["mesh"] = f"tp={tp}"
    if getattr(args, "no_prefix_caching", False):
        opts["enable_prefix_caching"] = False
    if getattr(args, "disable_hybrid_kv_cache_manager", False):
        opts["disable_hybrid_kv_cache_manager"] = True
    return opts
