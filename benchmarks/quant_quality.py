"""Quality of jlight's quantization, measured: SmolLM2-135M-Instruct teacher-forced over a fixed text.

Each configuration runs the text through the engine (the path `jlight.LLM` runs: quantized
weights through the engine's matmuls, the int8 KV cache through write_kv and paged attention
reading int8 pages) and records, at every position, the top-1 next token and the logprob of
the true next token (the engine's prompt_logprobs). Reported against the bfloat16 model:

  top-1 agreement: fraction of positions whose argmax equals the bfloat16 model's argmax;
  perplexity:      exp(mean NLL of the true next token), and its change relative to bfloat16.

The text (benchmarks/data/quant_quality_text.txt, written for this benchmark) is cut into
segments of --segment-len tokens; each segment is one request, prefilled in chunks of
--max-num-batched-tokens, so later chunks attend to K/V that earlier chunks left in the cache.

    python benchmarks/quant_quality.py                  # the whole text, the table in Markdown
    python benchmarks/quant_quality.py --max-tokens 1024 --json out.json
    python benchmarks/quant_quality.py --configs "int8 weights (W8A16)" "int8 weights, lm_head bf16"
    python benchmarks/quant_quality.py --kv-rounding   # each KV cache format's error on the cached K/V

The "lm_head bf16" rows quantize the weights here, with quantize_params(..., keep=("lm_head",)),
and hand the engine those params with quantization=None (the engine has no option for `keep`);
the matmuls that run are the same ones.

The "GPTQ" rows keep that int8 format (int8 values, one float32 scale per output channel, the
same scales as round-to-nearest) but choose the int8 values with GPTQ (jlight/quantization/gptq.py's
defaults: act-order, layer by layer with the earlier weights already quantized, 1% dampening),
calibrated on benchmarks/data/calibration_text.txt (2168 tokens written for calibration, none of
them from the evaluation text) in segments of CALIBRATION_SEGMENT_LEN tokens. The engine gets the
params as for the "lm_head bf16" rows. The engine's loading path has no GPTQ option.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import sys
import time

TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "quant_quality_text.txt")
CALIBRATION_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "calibration_text.txt")
CALIBRATION_SEGMENT_LEN = 512

# (name, engine options); the first is the baseline the others are compared with.
CONFIGS = [
    ("bfloat16", dict(dtype="bfloat16")),
    ("float32 (for scale)", dict(dtype="float32")),
    ("int8 weights (W8A16)", dict(dtype="bfloat16", quantization="int8")),
    ("w8a8", dict(dtype="bfloat16", quantization="w8a8")),
    ("int8 weights, lm_head bf16", dict(dtype="bfloat16", quantization="int8", keep=("lm_head",))),
    ("w8a8, lm_head bf16", dict(dtype="bfloat16", quantization="w8a8", keep=("lm_head",))),
    ("w8a8, SmoothQuant", dict(dtype="bfloat16", quantization="w8a8", smooth=True, keep=())),
    ("w8a8, SmoothQuant, lm_head bf16", dict(dtype="bfloat16", quantization="w8a8", smooth=True, keep=("lm_head",))),
    ("int8 weights, GPTQ", dict(dtype="bfloat16", quantization="int8", gptq=True, keep=())),
    ("int8 weights, GPTQ, lm_head bf16", dict(dtype="bfloat16", quantization="int8", gptq=True, keep=("lm_head",))),
    # fp8 (e4m3) weights: teacher-forced steps are prefill chunks of >= 64 rows, so W8A8-FP8 (activations
    # e4m3 per token) unless fp8_w8a8_min_rows sends them to the weight-only path (what decode steps run).
    ("fp8 weights (W8A8-FP8), lm_head fp8", dict(dtype="bfloat16", quantization="fp8", keep=())),
    ("fp8 weights, weight-only, lm_head fp8", dict(dtype="bfloat16", quantization="fp8", keep=(), fp8_w8a8_min_rows=1 << 30)),
    ("fp8 weights (W8A8-FP8), lm_head bf16", dict(dtype="bfloat16", quantization="fp8", keep=("lm_head",))),
    ("fp8 weights, weight-only, lm_head bf16",
     dict(dtype="bfloat16", quantization="fp8", keep=("lm_head",), fp8_w8a8_min_rows=1 << 30)),
    ("int8 KV cache", dict(dtype="bfloat16", kv_cache_dtype="int8")),
    ("int8 weights + int8 KV cache", dict(dtype="bfloat16", quantization="int8", kv_cache_dtype="int8")),
]


@dataclasses.dataclass
class Run:
    name: str
    options: dict
    top1: list[int]  # argmax next token at each position
    logprobs: list[float]  # logprob of the true next token at each position
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))


def text_token_ids(tokenizer, path: str = TEXT_PATH) -> list[int]:
    with open(path, encoding="utf-8") as f:
        return tokenizer.encode(f.read())


def segments_of(ids: list[int], segment_len: int, max_tokens: int | None = None) -> list[list[int]]:
    ids = ids[:max_tokens] if max_tokens else ids
    segs = [ids[i:i + segment_len] for i in range(0, len(ids), segment_len)]
    return [s for s in segs if len(s) >= 2]


def teacher_forced(engine, segments: list[list[int]]) -> tuple[list[int], list[float]]:
    """Top-1 ids and true-token logprobs over every segment (positions 1.. of each), in order."""
    from jlight import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1)
    for i, seg in enumerate(segments):
        engine.add_request(f"seg-{i}", None, params, prompt_token_ids=seg)
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    top1, logprobs = [], []
    for i, seg in enumerate(segments):
        plp = outs[f"seg-{i}"].prompt_logprobs
        assert len(plp) == len(seg), (len(plp), len(seg))
        for pos in range(1, len(seg)):
            d = plp[pos]  # {top-1 id: logprob, true id: logprob}; the top-1 entry comes first
            top1.append(next(iter(d)))
            logprobs.append(d[seg[pos]])
    return top1, logprobs


def measure(segments: list[list[int]], configs=CONFIGS, *, model=None, max_num_batched_tokens: int = 512,
            page_size: int = 16, log=print) -> list[Run]:
    """Run each configuration over the segments (one engine each; a model loaded once per dtype).

    An option keep=(names...) quantizes here with quantize_params(params, quantization, keep=keep)
    and gives the engine the quantized params with quantization=None; with gptq=True as well,
    with gptq_params (GPTQ, calibrated on the calibration text).
    """
    from jlight.engine.engine_config import EngineConfig
    from jlight.engine.llm_engine import LLMEngine
    from jlight.loading import load_model
    from jlight.quantization.rtn import quantize_params

    max_len = max(len(s) for s in segments) + 8
    loaded_by_dtype, gptq_cache, smooth_cache, runs = {}, {}, {}, []
    for name, opts in configs:
        dtype = opts.get("dtype", "auto")
        if dtype not in loaded_by_dtype:
            loaded_by_dtype[dtype] = load_model(model, dtype=dtype)
        engine_opts, loaded = dict(opts), loaded_by_dtype[dtype]
        t0 = time.perf_counter()
        if engine_opts.pop("smooth", False):  # SmoothQuant on the calibration text, then round to nearest
            keep, mode = engine_opts.pop("keep"), engine_opts.pop("quantization")
            loaded = dataclasses.replace(loaded, params=quantize_params(smoothed_params(loaded, cache=smooth_cache.setdefault(dtype, {})),
                                                                        mode, keep=keep))
        elif engine_opts.pop("gptq", False):
            keep, mode = engine_opts.pop("keep"), engine_opts.pop("quantization")
            assert mode == "int8", "GPTQ here is weight-only int8"
            loaded = dataclasses.replace(loaded, params=gptq_params(loaded, keep, cache=gptq_cache.setdefault(dtype, {}), log=log))
        elif "keep" in engine_opts:
            keep, mode = engine_opts.pop("keep"), engine_opts.pop("quantization")
            loaded = dataclasses.replace(loaded, params=quantize_params(loaded.params, mode, keep=keep))
        cfg = EngineConfig(model=model, max_num_seqs=max(1, min(len(segments), 8)), max_num_batched_tokens=max_num_batched_tokens,
                           max_model_len=max_len, page_size=page_size, layer_loop="scan", warmup=False, **engine_opts)
        engine = LLMEngine(cfg, loaded=loaded)
        top1, logprobs = teacher_forced(engine, segments)
        runs.append(Run(name, opts, top1, logprobs, time.perf_counter() - t0))
        log(f"{name}: {len(top1)} positions, perplexity {runs[-1].perplexity:.4f}, {runs[-1].seconds:.1f} s")
        del engine
    return runs


def calibration_segments(tokenizer, path: str = CALIBRATION_PATH, segment_len: int = CALIBRATION_SEGMENT_LEN) -> list[list[int]]:
    return segments_of(text_token_ids(tokenizer, path), segment_len)


def smoothed_params(loaded, alpha: float = 0.5, cache=None) -> dict:
    """loaded.params after SmoothQuant (jlight/quantization/smoothquant.py) on the calibration text."""
    from jlight.quantization.smoothquant import smooth_params

    cache = {} if cache is None else cache
    if alpha not in cache:
        cache[alpha] = smooth_params(loaded.params, loaded.config, calibration_segments(loaded.tokenizer), alpha=alpha)
    return cache[alpha]


def gptq_params(loaded, keep=(), cache=None, log=print) -> dict:
    """loaded.params with GPTQ int8 weights (keep: names left unquantized), calibrated on the
    calibration text. Layers come before the lm_head in GPTQ's order, so keep=("lm_head",) is
    the full result with the lm_head put back: one GPTQ run serves both rows (cache)."""
    from jlight.quantization.gptq import gptq_quantize_params

    keep = tuple(keep)
    cache = {} if cache is None else cache
    if set(keep) <= {"lm_head"}:
        if "full" not in cache:
            t0 = time.perf_counter()
            cache["full"] = gptq_quantize_params(loaded.params, loaded.config, calibration_segments(loaded.tokenizer))
            log(f"GPTQ: {time.perf_counter() - t0:.1f} s")
        return dict(cache["full"], lm_head=loaded.params["lm_head"]) if keep else cache["full"]
    return gptq_quantize_params(loaded.params, loaded.config, calibration_segments(loaded.tokenizer), keep=keep)


def compare(runs: list[Run]) -> list[dict]:
    """One row per run, against the first (the baseline)."""
    base = runs[0]
    rows = []
    for r in runs:
        agree = sum(a == b for a, b in zip(r.top1, base.top1)) / len(base.top1)
        rows.append(dict(name=r.name, options=r.options, positions=len(r.top1), top1_agreement=agree,
                         perplexity=r.perplexity, perplexity_change=r.perplexity / base.perplexity - 1.0,
                         seconds=round(r.seconds, 1)))
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| configuration | top-1 agreement with bf16 | perplexity | vs bf16 |", "|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {100 * r['top1_agreement']:.2f}% | {r['perplexity']:.4f} | {100 * r['perplexity_change']:+.2f}% |")
    return "\n".join(lines)


def kv_rounding_errors(ids: list[int], model_dir: str, gguf_name: str) -> dict:
    """How far each KV cache format moves the cached K and V: transformers' float32 SmolLM2 (the same GGUF)
    over `ids`, its K/V of every layer stored in each of jlight's formats (jlight.core.quantization) and read
    back; the mean over layers and K/V of ||stored - x|| / ||x||. "fp8, per-head amax scale" divides each
    (layer, KV head) by amax / 448 first: what a calibrated fp8 scale could at best gain."""
    import jax.numpy as jnp
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from jlight.core.quantization import dequantize_kv_pool, quantize_kv_pool, to_fp8_kv

    hf = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=gguf_name, dtype=torch.float32).eval()
    with torch.no_grad():
        cache = hf(torch.tensor([ids]), use_cache=True).past_key_values
    pairs = [(layer.keys, layer.values) for layer in cache.layers]
    formats = {
        "bfloat16": lambda x: x.astype(jnp.bfloat16).astype(jnp.float32),
        "int8, per token and head (kv_cache_dtype='int8')": lambda x: dequantize_kv_pool(quantize_kv_pool(x)),
        "fp8 e4m3, scale 1 (kv_cache_dtype='fp8')": lambda x: to_fp8_kv(x).astype(jnp.float32),
        "fp8 e4m3, per-head amax scale": lambda x: (lambda s: to_fp8_kv(x / s).astype(jnp.float32) * s)(
            jnp.max(jnp.abs(x), axis=(0, 1, 3), keepdims=True) / 448),
    }
    errors = {name: [] for name in formats}
    for k, v in pairs:
        for t in (k, v):
            x = jnp.asarray(t.numpy()[0].transpose(1, 0, 2)[None])  # [1, T, kv_heads, head_dim]: one page of T tokens
            for name, fmt in formats.items():
                errors[name].append(float(jnp.linalg.norm(fmt(x) - x) / jnp.linalg.norm(x)))
    return {name: float(np.mean(e)) for name, e in errors.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct (GGUF, fetched into $JLIGHT_CACHE)")
    p.add_argument("--segment-len", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=None, help="use only the text's first N tokens")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--configs", nargs="+", default=None, metavar="NAME",
                   help="run only these configurations (bfloat16, the baseline, always runs): " + "; ".join(n for n, _ in CONFIGS[1:]))
    p.add_argument("--kv-rounding", action="store_true",
                   help="instead: each KV cache format's relative error on the text's first --segment-len tokens' K/V")
    args = p.parse_args(argv)
    if args.kv_rounding:
        from jlight.loading import default_model, load_model

        path = default_model.default_gguf_path() if args.model is None else args.model
        ids = segments_of(text_token_ids(load_model(args.model, dtype="float32").tokenizer), args.segment_len)[0]
        for name, err in kv_rounding_errors(ids, os.path.dirname(path), os.path.basename(path)).items():
            print(f"{name}: mean relative error of the cached K/V {err:.4f}")
        return 0
    configs = CONFIGS
    if args.configs:
        unknown = [n for n in args.configs if n not in dict(CONFIGS)]
        if unknown:
            p.error(f"unknown --configs {unknown}; choose from {[n for n, _ in CONFIGS]}")
        configs = [c for c in CONFIGS if c[0] == CONFIGS[0][0] or c[0] in args.configs]

    from jlight.loading import load_model

    tokenizer = load_model(args.model, dtype="float32").tokenizer
    segments = segments_of(text_token_ids(tokenizer), args.segment_len, args.max_tokens)
    print(f"text: {sum(map(len, segments))} tokens in {len(segments)} segments of <= {args.segment_len}", file=sys.stderr)
    t0 = time.perf_counter()
    rows = compare(measure(segments, configs, model=args.model, max_num_batched_tokens=args.max_num_batched_tokens,
                           log=lambda s: print(s, file=sys.stderr)))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import result_header

    meta = dict(result_header(argv), machine=platform.machine(), tokens=sum(map(len, segments)), segments=len(segments),
                total_seconds=round(time.perf_counter() - t0, 1))
    print(json.dumps(meta))
    print(markdown(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
