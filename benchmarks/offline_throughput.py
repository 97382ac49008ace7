"""Offline throughput: N requests with random input/output lengths through the full engine.

Default workload (nano-vllm's): 256 requests, 100-1024 tokens in, 100-1024 out, ignore_eos.
Prints output tokens/s, the host step-time breakdown, and batch-1 decode latency against the
HBM roofline (weight bytes / copy bandwidth measured in the same run).

  python benchmarks/offline_throughput.py                          # SmolLM2 (default model)
  python benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 --out DIR
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from jlight.engine.engine_config import EngineConfig  # noqa: E402
from jlight.engine.llm_engine import LLMEngine  # noqa: E402
from jlight.engine.sampling_params import SamplingParams  # noqa: E402
from step_trace import StepTrace, format_summary  # noqa: E402


def _median_seconds(f, x, reps: int = 10) -> float:
    f(x).block_until_ready()  # compiled
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def copy_bandwidth_bytes_per_s(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy rate, counting bytes read plus written (median of 10)."""
    return 2 * nbytes / _median_seconds(jax.jit(lambda a: a + 1.0), jnp.ones((nbytes // 4,), jnp.float32))


def matmul_flops_per_s(n: int = 8192) -> float:
    """bf16 matmul rate of the default device (median of 10 n x n x n products)."""
    return 2.0 * n ** 3 / _median_seconds(jax.jit(lambda a: a @ a), jnp.ones((n, n), jnp.bfloat16))


def weight_bytes(params) -> int:
    """Bytes a decode step must read: every weight except the embedding table (only rows are gathered)."""
    return sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(params)
               if jax.tree_util.keystr(path) != "['embed']")


def build_engine(a) -> LLMEngine:
    opts = dict(dtype=a.dtype, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                quantization=a.quantization, attention_impl=a.attention_impl, matmul_impl=a.matmul_impl,
                max_model_len=a.max_model_len, num_pages=a.num_pages, layer_loop=a.layer_loop, kv_cache_dtype=a.kv_cache_dtype,
                page_size=a.page_size,
                mesh=a.mesh, min_token_bucket=a.min_token_bucket)
    if a.model_config:
        from model_configs import random_loaded_model

        loaded = random_loaded_model(a.model_config, jnp.dtype(a.dtype), max_position_embeddings=a.max_model_len or 4096)
        return LLMEngine(EngineConfig(model=None, **{**opts, "dtype": "auto"}), loaded=loaded)
    return LLMEngine(EngineConfig(model=a.model, **opts))


def decode_latency(engine: LLMEngine, prompt_len: int, n_tokens: int) -> float:
    """Seconds per token of one request decoding alone (steady state, full engine step)."""
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, engine.model_config.vocab_size, prompt_len).tolist()
    engine.add_request("latency", None, SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True), prompt_token_ids=prompt)
    stamps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps.extend([time.perf_counter()] * len(out.outputs[0].token_ids_delta))
    steady = stamps[len(stamps) // 4:]  # skip the prefill and the first few steps
    return (steady[-1] - steady[0]) / (len(steady) - 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--model-config", default=None, help="random weights of a named shape instead (e.g. llama3-8b)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--num-requests", type=int, default=256, help="0 = only the batch-1 latency")
    ap.add_argument("--input-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--output-len", type=int, nargs=2, default=[100, 1024])
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "unroll"])
    ap.add_argument("--mesh", default=None, help='one engine replica over a mesh, e.g. "tp=2" (no dp)')
    ap.add_argument("--attention-impl", default="auto")
    ap.add_argument("--matmul-impl", default="auto")
    ap.add_argument("--latency-tokens", type=int, default=128, help="tokens for the batch-1 decode latency (0 = skip)")
    ap.add_argument("--min-token-bucket", type=int, default=None,
                    help="smallest compiled step (EngineConfig.min_token_bucket); e.g. 1024 for a prefill-only run with few compiles")
    ap.add_argument("--mosaic-w8a16-rows", type=int, default=None,
                    help="K-major int8 steps of up to this many rows on the Mosaic GPU W8A16 kernel "
                         "(matmul_pallas.MOSAIC_W8A16_MAX_ROWS; w8a16_mosaic.py)")
    ap.add_argument("--mosaic-w8a16-min-rows", type=int, default=None, help="and of at least this many (MOSAIC_W8A16_MIN_ROWS)")
    ap.add_argument("--mosaic-w8a16-bf16", action="store_true", help="that kernel with bf16 activations (not its int8 terms)")
    ap.add_argument("--mosaic-w8a16-ctas-per-sm", type=int, default=1,
                    help="its programs per SM (at 8 rows bf16 activations needed 2; w8a16_mosaic.py)")
    ap.add_argument("--step-trace", action="store_true",
                    help="time every step and compare it with its own roofline, by kind and batch size (step_trace.py)")
    ap.add_argument("--out", default=None, help="directory for the JSON result")
    a = ap.parse_args()
    if a.mosaic_w8a16_rows is not None:  # read when the steps are traced
        from jlight.pallas_kernels import matmul_pallas

        matmul_pallas.MOSAIC_W8A16_MAX_ROWS = a.mosaic_w8a16_rows
        if a.mosaic_w8a16_min_rows is not None:
            matmul_pallas.MOSAIC_W8A16_MIN_ROWS = a.mosaic_w8a16_min_rows
        matmul_pallas.MOSAIC_W8A16_OPTIONS = dict(int8_activations=not a.mosaic_w8a16_bf16, ctas_per_sm=a.mosaic_w8a16_ctas_per_sm)

    t0 = time.perf_counter()
    engine = build_engine(a)
    load_s = time.perf_counter() - t0
    print(f"engine ready in {load_s:.1f} s (compile {engine.warmup_seconds:.1f} s, buckets {engine.runner.buckets}, "
          f"{engine.block_manager.num_pages} KV pages)", flush=True)
    result = dict(date=datetime.date.today().isoformat(), backend=jax.default_backend(), device=str(jax.devices()[0].device_kind),
                  host=platform.node(), model=a.model_config or engine.model_name, dtype=str(engine.runner.k_cache.dtype),
                  quantization=a.quantization, layer_loop=a.layer_loop, args=vars(a), compile_s=engine.warmup_seconds)

    if a.latency_tokens:
        lat = decode_latency(engine, 128, a.latency_tokens)
        wbytes = weight_bytes(engine.runner.params)
        bw = copy_bandwidth_bytes_per_s() if jax.default_backend() != "cpu" else None
        result.update(decode_b1_ms=lat * 1e3, weight_bytes=wbytes)
        line = f"batch-1 decode: {lat * 1e3:.2f} ms/token ({1 / lat:.1f} tok/s)"
        if bw:
            roof = wbytes / bw
            result.update(copy_bw_tb_s=bw / 1e12, roofline_ms=roof * 1e3, ratio_to_roofline=lat / roof)
            line += f"; roofline {roof * 1e3:.2f} ms ({wbytes / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s) -> {lat / roof:.2f}x"
        print(line, flush=True)

    if a.num_requests == 0:
        _write(result, a)
        return
    rng = np.random.default_rng(0)
    vocab = engine.model_config.vocab_size
    in_lens = rng.integers(a.input_len[0], a.input_len[1] + 1, a.num_requests)
    out_lens = rng.integers(a.output_len[0], a.output_len[1] + 1, a.num_requests)
    engine.step_seconds = dict.fromkeys(engine.step_seconds, 0.0)
    trace = StepTrace().install(engine) if a.step_trace else None
    steps0 = engine.num_steps
    t0 = time.perf_counter()
    for i, (n_in, n_out) in enumerate(zip(in_lens, out_lens)):
        engine.add_request(f"req-{i}", None, SamplingParams(temperature=0.6, max_tokens=int(n_out), ignore_eos=True),
                           prompt_token_ids=rng.integers(0, vocab, int(n_in)).tolist())
    generated = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated += len(out.outputs[0].token_ids_delta)
    elapsed = time.perf_counter() - t0
    steps = engine.num_steps - steps0
    breakdown = {k: v / steps * 1e3 for k, v in engine.step_seconds.items()}
    result.update(num_requests=a.num_requests, output_tokens=generated, total_input_tokens=int(in_lens.sum()),
                  elapsed_s=elapsed, output_tok_s=generated / elapsed, steps=steps, step_ms=elapsed / steps * 1e3,
                  host_ms_per_step=breakdown, preemptions=engine.stats().num_preemptions)
    result["total_tok_s"] = (int(in_lens.sum()) + generated) / elapsed
    print(f"{a.num_requests} requests, {int(in_lens.sum())} input / {generated} output tokens in {elapsed:.1f} s: "
          f"{generated / elapsed:.0f} output tok/s, {result['total_tok_s']:.0f} total tok/s, {steps} steps ({elapsed / steps * 1e3:.1f} ms/step), "
          f"preemptions {result['preemptions']}")
    print("per-step host ms: " + ", ".join(f"{k} {v:.2f}" for k, v in breakdown.items()))
    if trace is not None:
        result["step_trace"] = trace_summary(engine, trace)
        print(format_summary(result["step_trace"]), flush=True)
    _write(result, a)


def trace_summary(engine: LLMEngine, trace: StepTrace) -> list[dict]:
    runner = engine.runner
    kv_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves((runner.k_cache, runner.v_cache)))
    on_gpu = jax.default_backend() != "cpu"
    return trace.summary(
        weight_bytes=weight_bytes(runner.params), kv_bytes_per_token=kv_bytes // (runner.num_pages * runner.page_size),
        num_params=sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(runner.params)
                       if jax.tree_util.keystr(path) != "['embed']"),
        copy_bytes_per_s=copy_bandwidth_bytes_per_s() if on_gpu else copy_bandwidth_bytes_per_s(1 << 28),
        matmul_flops_per_s=matmul_flops_per_s() if on_gpu else matmul_flops_per_s(1024))


def _write(result: dict, a) -> None:
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        attention = "" if a.attention_impl == "auto" else f"_{a.attention_impl}"
        name = f"offline_{result['model']}_{a.quantization or result['dtype']}_{a.layer_loop}{attention}.json".replace("/", "_")
        with open(os.path.join(a.out, name), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
