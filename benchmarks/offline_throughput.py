"""Offline throughput and batch-1 decode on the vLLM peer's requests, through the full engine.

Runs, in one engine and in the order of ../shared/peer/vllm_bench.py (requests from harness.py, built
with the peer's calls, so both engines do the same work):
  init   seconds to make the model (random weights of --model-config, or load --model) and build the engine
         (every step bucket compiled): the peer's init_s;
  nano   nano-vllm's workload (256 requests, randint(100, 1024) tokens in and out, temperature 0.6,
         ignore_eos): output tok/s = output tokens / wall time of the whole run, with the host's ms a step
         (schedule / prepare / launch / wait and process) and, with --step-trace, every step against its
         own roofline (step_trace.py);
  bs1    one 128-token request, greedy: (t(256 tokens) - t(1 token)) / 255 ms, median of 3, against the weight
         roofline (weight bytes / the copy rate measured in the same run; on GPUs only) and, for a MoE model,
         the active weights' roofline (harness.active_weight_bytes: the routed experts at top_k / num_experts);
  fixed  with --fixed IN OUT N: N requests of IN random tokens and OUT output tokens (the peer reports 1000 1000 1000).

  python benchmarks/offline_throughput.py --model-config llama3-8b --dtype bfloat16 --fixed 1000 1000 1000 --out DIR
  python benchmarks/offline_throughput.py --model-config tiny --num-requests 8 --input-len 10 40 --output-len 4 12 --bs1-tokens 8
  python benchmarks/offline_throughput.py --model-config gemma3-12b --dtype bfloat16 --out DIR   (also gpt-oss-20b,
         qwen3-next-16l: benchmarks/family_shapes.py; their vLLM peer is benchmarks/vllm_families.py)
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import harness  # noqa: E402
from step_trace import StepTrace, format_summary  # noqa: E402

from jlight.engine import startup  # noqa: E402
from jlight.engine.engine_config import EngineConfig  # noqa: E402
from jlight.engine.llm_engine import LLMEngine  # noqa: E402


def build_engine(a) -> LLMEngine:
    opts = dict(dtype=a.dtype, max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
                quantization=a.quantization, attention_impl=a.attention_impl, matmul_impl=a.matmul_impl,
                max_model_len=a.max_model_len, num_pages=a.num_pages, layer_loop=a.layer_loop,
                kv_cache_dtype=a.kv_cache_dtype, page_size=a.page_size, mesh=a.mesh, min_token_bucket=a.min_token_bucket,
                kv_offloading_size=a.kv_offloading_size, warmup=not a.no_warmup,
                gpu_memory_utilization=a.gpu_memory_utilization)
    if a.fp8_w8a8_min_rows is not None:
        opts["fp8_w8a8_min_rows"] = a.fp8_w8a8_min_rows
    opts.update(a.engine_options)
    if a.model_config:
        dtype = a.dtype if a.dtype != "auto" else "float32" if jax.default_backend() == "cpu" else "bfloat16"
        loaded = harness.random_loaded_model(a.model_config, jnp.dtype(dtype), max_position_embeddings=a.max_model_len,
                                             mxfp4=a.quantization == "mxfp4", init=a.init)
        return LLMEngine(EngineConfig(model=None, **{**opts, "dtype": "auto"}), loaded=loaded, give_weights=True)
    return LLMEngine(EngineConfig(model=a.model, **opts))


def run_workload(engine: LLMEngine, requests: list, trace: StepTrace | None = None, output_kind: str = "final_only") -> dict:
    """The requests through the engine as one run: output tok/s and where the host's time went."""
    engine.step_seconds = dict.fromkeys(engine.step_seconds, 0.0)
    steps0, preempt0 = engine.num_steps, engine.stats().num_preemptions
    compiled0, calls = harness.steps_compiled_by_jit(engine), harness.spy_on_step_calls(engine)
    launches = harness.spy_on_launches(engine)
    try:
        wall, generated = harness.engine_generate(engine, requests, output_kind)
    finally:
        harness.stop_spying(engine)
    steps = max(engine.num_steps - steps0, 1)
    input_tokens = sum(len(r.prompt_token_ids) for r in requests)
    launch_ms = np.array([1e3 * phases["launch"] for _, phases, _ in calls])
    slowest = sorted(calls, key=lambda c: -c[0])[:3]
    return dict(requests=len(requests), input_tokens=input_tokens, output_tokens=generated, wall_s=wall,
                output_tok_s=generated / wall, total_tok_s=(input_tokens + generated) / wall, steps=steps,
                step_ms=wall / steps * 1e3, host_ms_per_step={k: v / steps * 1e3 for k, v in engine.step_seconds.items()},
                preemptions=engine.stats().num_preemptions - preempt0,
                # whether the launches are slow alike or a few are very slow (a compile, a wait), and any compile
                launch_ms=dict(median=float(np.median(launch_ms)), p90=float(np.percentile(launch_ms, 90)),
                               max=float(launch_ms.max())) if len(launch_ms) else {},
                slowest_step_calls_phases_ms=[dict(call=round(1e3 * s, 2), **{k: round(1e3 * v, 2) for k, v in p.items()})
                                              for s, p, _ in slowest],
                steps_compiled_during_run=harness.steps_compiled_by_jit(engine) - compiled0,
                # whether a launch waits on the device: begun while the step before it ran, returned with it done
                launch_waits=harness.launch_waits(launches))


def print_workload(name: str, r: dict) -> None:
    print(f"{name}: {r['requests']} requests, {r['input_tokens']} input / {r['output_tokens']} output tokens in "
          f"{r['wall_s']:.1f} s: {r['output_tok_s']:.0f} output tok/s, {r['total_tok_s']:.0f} total tok/s, {r['steps']} steps "
          f"({r['step_ms']:.1f} ms/step), preemptions {r['preemptions']}", flush=True)
    print("  host ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in r["host_ms_per_step"].items()), flush=True)
    if r["launch_ms"]:
        print(f"  launch ms a step: median {r['launch_ms']['median']:.2f}, p90 {r['launch_ms']['p90']:.2f}, max "
              f"{r['launch_ms']['max']:.1f}; steps compiled during the run {r['steps_compiled_during_run']}; the slowest "
              "step() calls: " + "; ".join(", ".join(f"{k} {v}" for k, v in c.items()) for c in r["slowest_step_calls_phases_ms"]),
              flush=True)
        w = r["launch_waits"]
        print(f"  launches begun with the step before still running: {w['began_with_device_busy']:.0%}, of which "
              f"{w['of_those_returned_with_it_done']:.0%} returned with it done; median launch ms with the device busy / "
              f"idle at its start: {w['median_ms_device_busy_at_start']} / {w['median_ms_device_idle_at_start']}", flush=True)
        if w.get("slow"):
            s = w["slow"]
            print(f"  launches over {s['over_ms']} ms: {s['count']}, {s['total_ms']} ms in all, {s['after_another_variant']} "
                  f"of them after another compiled step; the first [call, variant before, variant, ms] (variant: tokens, "
                  f"table width, serial): {s['first']}", flush=True)


def kv_pages(runner):
    """The runner's K pages: k_cache, or for a hybrid model (recurrent layers) the pages of its PagesAndState."""
    return getattr(runner.k_cache, "pages", runner.k_cache)


def trace_summary(engine: LLMEngine, trace: StepTrace, copy_bw: float, flops: float) -> list[dict]:
    runner = engine.runner
    # the K/V pages only: a hybrid model's k_cache is PagesAndState, whose recurrent state is per sequence, not per token
    kv_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves((kv_pages(runner), runner.v_cache)))
    return trace.summary(
        weight_bytes=harness.weight_bytes(runner.params), kv_bytes_per_token=kv_bytes // (runner.num_pages * runner.page_size),
        num_params=sum(x.size for path, x in jax.tree_util.tree_leaves_with_path(runner.params)
                       if jax.tree_util.keystr(path) != "['embed']"),
        copy_bytes_per_s=copy_bw, matmul_flops_per_s=flops)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--model-config", default=None, choices=harness.CONFIG_NAMES,
                    help="random weights of this named shape instead (benchmarks/model_configs.py)")
    ap.add_argument("--init", default="normal", choices=harness.INITS,
                    help="random weights: normal (jlight's), or vllm-dummy (vLLM's load_format=dummy: uniform 1e-3, under "
                         "which a biased router sends every token to the same experts, as in the peer's dummy run)")
    ap.add_argument("--dtype", default="auto", help="auto: the checkpoint's; random weights: bfloat16 (float32 on CPU)")
    ap.add_argument("--quantization", default=None, choices=["int8", "w8a8", "fp8", "mxfp4"],
                    help="mxfp4 with --model-config: the routed experts as random MXFP4 (gpt-oss-20b)")
    ap.add_argument("--fp8-w8a8-min-rows", type=int, default=None,
                    help="fp8: steps of at least this many tokens run W8A8-FP8, smaller ones weight-only (default: EngineConfig's)")
    ap.add_argument("--num-requests", type=int, default=256, help="nano workload's requests (0: skip it)")
    ap.add_argument("--input-len", type=int, nargs=2, default=[100, 1024], help="nano workload's prompt lengths (the peer's)")
    ap.add_argument("--output-len", type=int, nargs=2, default=[100, 1024], help="nano workload's output lengths (the peer's)")
    ap.add_argument("--fixed", type=int, nargs=3, metavar=("IN", "OUT", "N"), help="also the peer's fixed workload")
    ap.add_argument("--bs1-tokens", type=int, default=256, help="batch-1 decode: tokens of the long run (0: skip)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--max-model-len", type=int, default=4096, help="the peer's 4096")
    ap.add_argument("--num-pages", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="vLLM's meaning: the engine's share of the card (the peer runs 0.9); set before JAX starts")
    ap.add_argument("--kv-cache-dtype", default="auto", help="EngineConfig.kv_cache_dtype: auto (the model's dtype), int8, fp8 ...")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--kv-offloading-size", type=float, default=None,
                    help="GiB of host KV tier (EngineConfig.kv_offloading_size); the result then carries the tier's "
                         "counters and the device <-> host copy rates")
    ap.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "unroll"])
    ap.add_argument("--mesh", default=None, help='one engine replica over a mesh, e.g. "tp=2" (no dp)')
    ap.add_argument("--attention-impl", default="auto")
    ap.add_argument("--matmul-impl", default="auto")
    ap.add_argument("--min-token-bucket", type=int, default=None, help="smallest compiled step (EngineConfig.min_token_bucket)")
    ap.add_argument("--no-warmup", action="store_true", help="compile each step bucket when first used, not at start")
    ap.add_argument("--step-trace", action="store_true",
                    help="time every step of the nano run against its own roofline, by kind and batch size (step_trace.py)")
    ap.add_argument("--profile-steps", type=int, nargs=2, metavar=("FIRST", "COUNT"), default=None,
                    help="a jax.profiler trace of the nano run's step() calls FIRST .. FIRST + COUNT - 1 into OUT/profile "
                         "(Perfetto's trace.json.gz beside the XPlane): where a slow launch waits")
    ap.add_argument("--output-kind", default="final_only", choices=["final_only", "delta", "cumulative"],
                    help="the nano requests' SamplingParams.output_kind (final_only: as the peer's llm.generate asks)")
    ap.add_argument("--engine-options", type=json.loads, default={}, metavar="JSON",
                    help='other EngineConfig fields, e.g. \'{"pack_small_params": true}\' (they win over the flags)')
    ap.add_argument("--out", default=None, help="directory for the JSON result")
    ap.add_argument("--name", default="offline_throughput", help="file stem of the JSON result")
    ap.add_argument("--log-level", default="WARNING", help="the engine's log level (INFO: the KV pool's sizing)")
    a = ap.parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    startup.claim_device_memory(a)  # before the first JAX call below starts its backend

    gpu = jax.default_backend() != "cpu"
    copy_bw = harness.copy_bytes_per_s() if gpu else None  # before the engine: its pool leaves no 2 GiB free on large shapes
    t0 = time.perf_counter()
    engine = build_engine(a)
    init_s = time.perf_counter() - t0
    print(f"engine ready in {init_s:.1f} s (compile {engine.warmup_seconds:.1f} s, buckets {engine.runner.buckets}, "
          f"{engine.block_manager.num_pages} KV pages)", flush=True)
    result = dict(model=a.model_config or engine.model_name, kv_dtype=str(kv_pages(engine.runner).dtype), args=vars(a),
                  init_s=init_s, compile_s=engine.warmup_seconds, buckets=engine.runner.buckets,
                  num_pages=engine.block_manager.num_pages)
    result["copy_bw_tb_s"] = copy_bw and copy_bw / 1e12
    stats = startup.device_memory_stats()
    if stats:  # what the steps have left: a step's temporaries need one free block of their size
        result["device_memory_when_ready"] = {k: stats.get(k) for k in ("bytes_in_use", "bytes_limit", "largest_free_block_bytes")}
        print("device memory when ready: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in
                                                       result["device_memory_when_ready"].items() if v is not None), flush=True)
    if a.kv_offloading_size:
        result["host_copy_bytes_per_s"] = harness.host_copy_bytes_per_s() if gpu else harness.host_copy_bytes_per_s(1 << 20, 2)
    generate = lambda requests: harness.engine_generate(engine, requests)  # noqa: E731
    generate([harness.Request([1] * 8, 16)])  # the peer's warm-up call

    if a.num_requests:
        trace = StepTrace().install(engine) if a.step_trace else None
        stop_profile = None
        if a.profile_steps:
            profile_dir = os.path.join(a.out or ".", "profile")
            stop_profile = harness.profile_step_calls(engine, *a.profile_steps, profile_dir)
        try:
            result["nano"] = run_workload(engine, harness.nano_workload(a.num_requests, tuple(a.input_len), tuple(a.output_len)),
                                          output_kind=a.output_kind)
        finally:  # run_workload took the wrappers off engine.step
            if stop_profile is not None:
                stop_profile()
        print_workload("nano", result["nano"])
        if a.profile_steps:  # the start of the trace lands in the window's first call
            result["nano"]["profile"] = harness.profile_summary(profile_dir, *a.profile_steps)
            print("  the profiled steps' " + harness.format_hotspots(result["nano"]["profile"]), flush=True)
        if trace is not None:
            flops = harness.matmul_flops_per_s() if gpu else harness.matmul_flops_per_s(512)
            result["step_trace"] = trace_summary(engine, trace, copy_bw or harness.copy_bytes_per_s(1 << 26), flops)
            print(format_summary(result["step_trace"]), flush=True)
        harness.write_result(a.out, a.name, result)

    if a.bs1_tokens:
        ms = harness.bs1_ms_per_token(generate, harness.bs1_prompt(), tokens=a.bs1_tokens)
        wbytes = harness.weight_bytes(engine.runner.params)
        active = harness.active_weight_bytes(engine.runner.params, engine.runner.config)
        result["bs1"] = dict(ms_per_token=ms, tokens=a.bs1_tokens, weight_bytes=wbytes)
        if active != wbytes:  # MoE: one token reads top_k of the routed experts
            result["bs1"]["active_weight_bytes"] = active
        line = f"batch-1 decode: {ms:.3f} ms/token"
        if copy_bw:
            roof = wbytes / copy_bw * 1e3
            result["bs1"].update(roofline_ms=roof, ratio_to_roofline=ms / roof)
            line += f"; roofline {roof:.2f} ms ({wbytes / 1e9:.2f} GB at {copy_bw / 1e12:.2f} TB/s) -> {ms / roof:.2f}x"
            if active != wbytes:
                roof = active / copy_bw * 1e3
                result["bs1"].update(active_roofline_ms=roof, ratio_to_active_roofline=ms / roof)
                line += f"; the active weights' roofline {roof:.2f} ms ({active / 1e9:.2f} GB) -> {ms / roof:.2f}x"
        print(line, flush=True)
        harness.write_result(a.out, a.name, result)

    if a.fixed:
        result["fixed"] = run_workload(engine, harness.fixed_workload(*a.fixed))
        print_workload(f"fixed {a.fixed[0]} in / {a.fixed[1]} out", result["fixed"])
    if a.kv_offloading_size:
        s = engine.stats()
        result["host_tier"] = {k: getattr(s, k) for k in ("device_cache_hit_tokens", "host_cache_hit_tokens",
                               "host_cache_offloaded_pages", "host_cache_dropped_pages", "host_cache_pages_total")}
        print(f"host tier: {result['host_tier']}, copies {result['host_copy_bytes_per_s']}", flush=True)
    path = harness.write_result(a.out, a.name, result)
    if path:
        print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
