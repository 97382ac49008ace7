"""Batch-1 decode latency (ms/token, full engine steps) of one random-weight model under
several engine variants, in one process so the random weights are made once.

  python benchmarks/decode_latency.py --model-config llama3-8b --kernel-breakdown --out DIR
  python benchmarks/decode_latency.py --model-config tiny --variants bf16-b8,int8-pallas-b1  # CPU smoke run

A variant (VARIANTS) is a set of EngineConfig fields: the weights (bf16 / int8 / w8a8), the matmul
path (matmul_impl), the attention kernel and the smallest compiled step (min_token_bucket: "b1"
compiles a 1-token step for batch-1 decode, "b8" pads it to 8 tokens, the engine's default).
ms/token: one request, a --prompt-len prompt, greedy, --tokens tokens; the host clock between
tokens over the last three quarters (the peer's method, (t(256) - t(1)) / 255, is
offline_throughput.py's bs1). Each variant also reports the host's dispatch time per step, a
breakdown of it (the transfer of the step's inputs as ~30 arrays or as two packed buffers, the
jitted call alone, and the step run 50 times back to back: the device's wall time per step) and,
with --kernel-breakdown on a GPU, the device time per kernel of one step (CUPTI). The roofline is
the weight bytes a step must read over the copy rate measured in the same run (harness.py); for a MoE
model also the active weights' line (harness.active_weight_bytes: the routed experts at top_k / num_experts).
"""
import argparse
import gc
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from harness import active_weight_bytes, copy_bytes_per_s, random_loaded_model, result_header, weight_bytes, write_result  # noqa: E402

from jlight.engine import kv_groups, model_runner, step_packing  # noqa: E402
from jlight.engine.engine_config import EngineConfig  # noqa: E402
from jlight.engine.llm_engine import LLMEngine  # noqa: E402
from jlight.engine.sampling_params import SamplingParams  # noqa: E402
from jlight.core.quantization import Fp8WeightT, QuantizedWeightT, W8A8WeightT  # noqa: E402
from jlight.models import get_model_family  # noqa: E402

KMAJOR_TYPES = (QuantizedWeightT, W8A8WeightT, Fp8WeightT)

# name -> EngineConfig fields. "b8" / "b1": the smallest compiled step (min_token_bucket); "-sep": q/k/v and
# gate/up as separate matmuls (fuse_projections=False); "xla": matmul_impl="reference" (XLA's dequantize-dot on
# [in, out] int8 weights); "auto": the default dispatch (on GPU, K-major int8 weights for XLA, the K-major GEMV
# for one-row steps); "pallas": the Pallas W8A16 kernels; "-triton": the Triton paged attention instead of Mosaic GPU.
_INT8_XLA = dict(quantization="int8", matmul_impl="reference")
_INT8_AUTO = dict(quantization="int8", matmul_impl="auto")
_INT8_PALLAS = dict(quantization="int8", matmul_impl="pallas")
VARIANTS = {
    "bf16-b8": dict(min_token_bucket=8),
    "bf16-b8-sep": dict(min_token_bucket=8, fuse_projections=False),
    "bf16-b8-each-layer": dict(min_token_bucket=8, trace_layers_once=False),  # every layer traced (the step XLA compiles: the same)
    "bf16-b8-packed": dict(min_token_bucket=8, pack_small_params=True),  # small vectors grouped: fewer arrays a call
    "bf16-b1": dict(min_token_bucket=1),
    "bf16-b8-triton": dict(min_token_bucket=8, attention_impl="triton"),
    "int8-auto-b8": dict(_INT8_AUTO, min_token_bucket=8),
    "int8-auto-b1": dict(_INT8_AUTO, min_token_bucket=1),
    "int8-auto-b8-triton": dict(_INT8_AUTO, min_token_bucket=8, attention_impl="triton"),
    "int8-xla-b8": dict(_INT8_XLA, min_token_bucket=8),
    "int8-xla-b8-sep": dict(_INT8_XLA, min_token_bucket=8, fuse_projections=False),
    "int8-xla-b1": dict(_INT8_XLA, min_token_bucket=1),
    "int8-pallas-b1": dict(_INT8_PALLAS, min_token_bucket=1),
    "int8-pallas-b1-sep": dict(_INT8_PALLAS, min_token_bucket=1, fuse_projections=False),
    "int8-pallas-b8": dict(_INT8_PALLAS, min_token_bucket=8),
    "w8a8-auto-b8": dict(quantization="w8a8", matmul_impl="auto", min_token_bucket=8),
    # fp8 (e4m3) weights: "fp8-b8" the default dispatch (decode steps below fp8_w8a8_min_rows: weight-only,
    # the values upcast inside XLA's dot); "fp8-w8a8-b8" e4m3 activations too at every step (XLA's fp8 gemm).
    "fp8-b8": dict(quantization="fp8", min_token_bucket=8),
    "fp8-b1": dict(quantization="fp8", min_token_bucket=1),
    "fp8-w8a8-b8": dict(quantization="fp8", fp8_w8a8_min_rows=0, min_token_bucket=8),
}
DEFAULT_VARIANTS = "bf16-b8,int8-auto-b8"


def decode_latency(engine: LLMEngine, prompt_len: int, n_tokens: int) -> float:
    """Seconds per token of one request decoding alone (steady state: the first quarter of the tokens skipped)."""
    prompt = np.random.default_rng(1).integers(0, engine.model_config.vocab_size, prompt_len).tolist()
    engine.add_request("latency", None, SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True),
                       prompt_token_ids=prompt)
    stamps = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            stamps.extend([time.perf_counter()] * len(out.outputs[0].token_ids_delta))
    steady = stamps[len(stamps) // 4:]
    return (steady[-1] - steady[0]) / (len(steady) - 1)


def _spy_on_steps(runner) -> list:
    """Record (StepInputs, host seconds of the launch: packing and the jitted call) for each step."""
    calls, launch = [], runner.launch

    def spy(inp, guide_mask=None, serial=False):
        t0 = time.perf_counter()
        out = launch(inp, guide_mask, serial)
        calls.append((inp, time.perf_counter() - t0))  # the host's dispatch time (the step runs async)
        return out

    runner.launch = spy
    return calls


def dispatch_breakdown(runner, inp, reps: int = 50) -> dict:
    """Parts of a step's dispatch (ms, each the median of `reps`, waiting for each): the transfer of
    its numpy inputs as the StepInputs tree (one copy per leaf, as every step did before packing)
    and as the two packed buffers (packing included), and the host time of the jitted call when
    its buffers are already on the device. The calls run real steps on the runner's pools."""
    def median_ms(fn):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    row = dict(transfer_unpacked_ms=median_ms(lambda: jax.device_put(inp)),
               transfer_packed_ms=median_ms(lambda: jax.device_put(step_packing.pack(inp)[:2])))
    ints, floats, layout = step_packing.pack(inp)
    ints, floats = jax.block_until_ready(jax.device_put((ints, floats)))
    r, times = runner, []
    for _ in range(reps + 1):  # the first call is not timed: it may trace for device-resident buffers
        t0 = time.perf_counter()
        out = r._step(r.step_params, r.k_cache, r.v_cache, r.history, r.prev_sampled, ints, floats, r.unconstrained_mask(inp), layout)
        times.append(time.perf_counter() - t0)
        r.k_cache, r.v_cache, r.history, r.prev_sampled, _ = jax.block_until_ready(out)
    row["call_on_device_inputs_ms"] = 1e3 * statistics.median(times[1:])
    row["back_to_back_ms"] = back_to_back_ms(runner, inp, reps)
    row.update(call_cost_per_array(len(jax.tree.leaves((r.step_params, r.k_cache, r.v_cache, r.history, r.prev_sampled))) + 3,
                                   reps))
    return row


def call_cost_per_array(n: int, reps: int = 50) -> dict:
    """The host time a jitted call takes for each device array it is given: a trivial program of n small arrays
    (a step's count) against one of one array, the calls' own time (median of reps, the device idle between).
    Where it is microseconds, a step's parameter count is a step's dispatch (step_arrays: n)."""
    def call_ms(k):
        arrays = [jax.device_put(np.full((8,), i, np.float32)) for i in range(k)]
        fn = jax.jit(lambda *xs: xs[0] + 1, keep_unused=True)  # every array reaches the program, as a step's do
        jax.block_until_ready(fn(*arrays))  # compiled
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            out = fn(*arrays)
            times.append(time.perf_counter() - t0)
            jax.block_until_ready(out)
        return 1e3 * statistics.median(times)

    one, many = call_ms(1), call_ms(n)
    return dict(step_arrays=n, call_one_array_ms=one, call_step_arrays_ms=many, call_us_per_array=1e3 * (many - one) / (n - 1))


def back_to_back_ms(runner, inp, reps: int = 50) -> float:
    """The step of `inp` run `reps` times back to back, waiting once at the end: the device's wall time
    per step (gaps between kernels and any overlap of neighbours included), as long as the host's
    dispatch of a step is shorter than the step. CUPTI's per-kernel sum (kernel_breakdown) counts neither.
    The steps run on the runner's pools, writing the step's K/V slots again."""
    r = runner
    ints, floats, layout = step_packing.pack(inp)
    ints, floats = jax.block_until_ready(jax.device_put((ints, floats)))
    mask = r.unconstrained_mask(inp)
    r.k_cache, r.v_cache, r.history, r.prev_sampled, _ = jax.block_until_ready(  # compiled, and the queue empty
        r._step(r.step_params, r.k_cache, r.v_cache, r.history, r.prev_sampled, ints, floats, mask, layout))
    t0 = time.perf_counter()
    for _ in range(reps):
        r.k_cache, r.v_cache, r.history, r.prev_sampled, _ = r._step(
            r.step_params, r.k_cache, r.v_cache, r.history, r.prev_sampled, ints, floats, mask, layout)
    jax.block_until_ready(r.k_cache)
    return 1e3 * (time.perf_counter() - t0) / reps


def prefill_step_ms(engine, step_args: list, num_tokens: int, reps: int = 20) -> float:
    """back_to_back_ms of the step that prefills one fresh prompt of num_tokens tokens (no other
    sequence running), so its matmuls have num_tokens rows: how the step's time grows with its rows."""
    first = len(step_args)
    prompt = np.random.default_rng(num_tokens).integers(0, engine.model_config.vocab_size, num_tokens).tolist()
    engine.add_request(f"prefill-{num_tokens}", None, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
                       prompt_token_ids=prompt)
    engine.run_to_completion()
    return back_to_back_ms(engine.runner, step_args[first][0], reps)


def greedy_tokens(engine, n: int) -> list[int]:
    """The greedy continuation of a fixed 5-token prompt."""
    engine.add_request("greedy-check", None, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                       prompt_token_ids=[11, 22, 33, 44, 55])
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens.extend(out.outputs[0].token_ids_delta)
    return tokens


def kernel_breakdown(runner, step_args, top: int = 12) -> list[dict]:
    """Device time per kernel (CUPTI) of one step with the last decode step's inputs, summed by
    kernel name: where a step's milliseconds go. Run without donation, on the runner's live pools."""
    from jax.experimental.mosaic.gpu import profiler

    inp, _ = step_args
    step = jax.jit(runner._packed_step, static_argnums=8, compiler_options=model_runner.STEP_COMPILER_OPTIONS)
    ints, floats, layout = step_packing.pack(inp)
    _, kernels = profiler.measure(step, aggregate=False)(
        runner.step_params, runner.k_cache, runner.v_cache, runner.history, runner.prev_sampled, ints, floats,
        runner.unconstrained_mask(inp), layout)
    by_name: dict[str, list] = {}
    for name, ms in kernels or []:
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += ms
    rows = sorted(({"kernel": n, "count": c, "ms": ms} for n, (c, ms) in by_name.items()), key=lambda r: -r["ms"])
    total = sum(r["ms"] for r in rows)
    print(f"  device time of one step: {total:.2f} ms in {sum(r['count'] for r in rows)} kernels; the largest:")
    for r in rows[:top]:
        print(f"    {r['ms']:7.3f} ms  x{r['count']:<4d} {r['kernel'][:110]}")
    sequence = [dict(kernel=n, us=ms * 1e3) for n, ms in kernels or []]
    middle = len(sequence) // 2  # one layer in the middle of the step, in launch order
    print("  kernels %d-%d in launch order:" % (middle, middle + 24))
    for i, r in enumerate(sequence[middle:middle + 24], middle):
        print(f"    {i:4d} {r['us']:8.2f} us  {r['kernel'][:100]}")
    return [dict(total_ms=total)] + rows[:top] + [dict(sequence=sequence)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-config", default="llama3-8b", help="random bf16 weights of this shape (benchmarks/model_configs.py)")
    ap.add_argument("--variants", default=DEFAULT_VARIANTS, help=f"comma-separated, of: {', '.join(VARIANTS)}")
    ap.add_argument("--tokens", type=int, default=96, help="decode tokens per variant (the first quarter is skipped)")
    ap.add_argument("--prompt-len", type=int, default=1, help="1: the prompt step has the decode step's shape, one compile per variant")
    ap.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "unroll"], help="auto: unroll on GPU")
    ap.add_argument("--kernel-breakdown", action="store_true", help="GPU: device time per kernel of one decode step (CUPTI)")
    ap.add_argument("--step-tokens", default="", help="comma-separated N: also time a step that prefills N tokens "
                    "(back to back), e.g. 32,128,512, to see at which rows int8 weights stop paying")
    ap.add_argument("--num-pages", type=int, default=None,
                    help="KV pool pages (default: the fewest the run needs); a step's time should not grow with it")
    ap.add_argument("--out", default=None, help="directory for decode_latency.json")
    a = ap.parse_args(argv)
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")

    loaded = random_loaded_model(a.model_config, jnp.bfloat16, max_position_embeddings=4096)
    gpu = jax.default_backend() == "gpu"
    bw = copy_bytes_per_s() if gpu else None
    result = dict(result_header(), model=a.model_config, copy_bw_tb_s=bw and bw / 1e12, num_pages_given=a.num_pages,
                  variants={})
    step_tokens = [int(n) for n in a.step_tokens.split(",") if n]
    max_len = max([a.prompt_len + a.tokens + 16] + [n + 16 for n in step_tokens])
    max_batched = max([16] + step_tokens)  # a prefill of N tokens runs as one step
    # a page id holds one KV group's layers (engine/kv_groups.py: a windowed family's local and global layers
    # are groups of their own), so a sequence takes pages in every group
    kv_layout = kv_groups.layout_for(get_model_family(loaded.config), loaded.config)
    pages = a.num_pages or kv_layout.num_groups * (-(-max_len // 16) + 2)
    for name in names:
        try:
            engine = LLMEngine(EngineConfig(
                model=None, max_num_seqs=4, max_num_batched_tokens=max_batched, max_model_len=max_len, num_pages=pages,
                layer_loop=a.layer_loop, warmup=False, **VARIANTS[name]), loaded=loaded,
                give_weights=len(names) == 1)  # one variant: one copy of the weights at the peak (gpt-oss-20b's 42 GB)
            step_args = _spy_on_steps(engine.runner)
            seconds = decode_latency(engine, a.prompt_len, a.tokens)
            dispatch_ms = 1e3 * statistics.median(t for _, t in step_args[len(step_args) // 2:])
            last_decode = step_args[-1][0]
            greedy = greedy_tokens(engine, 16)  # to compare variants (and XLA flags) for correctness
            kmajor = [w for w in jax.tree.leaves(engine.runner.params, is_leaf=lambda x: isinstance(x, KMAJOR_TYPES))
                      if isinstance(w, KMAJOR_TYPES)]
            row = dict(ms=seconds * 1e3, weight_bytes=weight_bytes(engine.runner.params), buckets=engine.runner.buckets,
                       active_weight_bytes=active_weight_bytes(engine.runner.params, engine.runner.config),
                       kmajor_weights=len(kmajor),
                       dispatch_ms=dispatch_ms, greedy_tokens=greedy)
            print(f"  host time to dispatch one step (median of the later half): {dispatch_ms:.2f} ms; "
                  f"{len(kmajor)} K-major weights", flush=True)
            # After the greedy check: the breakdown's steps overwrite the pools (nothing reads them afterwards).
            row.update(dispatch_breakdown(engine.runner, last_decode))
            print(f"  dispatch breakdown (median of 50): transfer unpacked {row['transfer_unpacked_ms']:.3f} ms, "
                  f"packed {row['transfer_packed_ms']:.3f} ms; call on device inputs {row['call_on_device_inputs_ms']:.3f} ms; "
                  f"back to back {row['back_to_back_ms']:.3f} ms/step; a trivial call of the step's {row['step_arrays']} "
                  f"arrays {row['call_step_arrays_ms']:.3f} ms against {row['call_one_array_ms']:.3f} of one: "
                  f"{row['call_us_per_array']:.2f} us an array", flush=True)
            if a.kernel_breakdown and gpu:
                try:
                    row["kernels"] = kernel_breakdown(engine.runner, step_args[-1])
                except Exception as e:  # noqa: BLE001 - the latency above stands without it
                    row["kernels"] = f"failed: {type(e).__name__}: {e}"[:300]
                    print(f"  kernel breakdown {row['kernels']}", flush=True)
            if step_tokens:  # last: these steps add to step_args, whose last entry the breakdown above reads
                row["prefill_step_ms"] = {n: prefill_step_ms(engine, step_args, n) for n in step_tokens}
                print("  prefill step, back to back: " + ", ".join(
                    f"{n} tokens {ms:.2f} ms" for n, ms in row["prefill_step_ms"].items()), flush=True)
            line = f"{name:28s} {row['ms']:7.2f} ms/token"
            if bw:
                row["roofline_ms"] = row["weight_bytes"] / bw * 1e3
                line += f"  roofline {row['roofline_ms']:.2f} ms ({row['weight_bytes'] / 1e9:.2f} GB) -> {row['ms'] / row['roofline_ms']:.2f}x"
                if row["active_weight_bytes"] != row["weight_bytes"]:  # MoE: one token reads top_k of the routed experts
                    row["active_roofline_ms"] = row["active_weight_bytes"] / bw * 1e3
                    line += (f"; active weights {row['active_roofline_ms']:.2f} ms ({row['active_weight_bytes'] / 1e9:.2f} GB)"
                             f" -> {row['ms'] / row['active_roofline_ms']:.2f}x")
            del engine
        except Exception as e:  # noqa: BLE001 - one failed variant must not lose the others
            row = dict(error=f"{type(e).__name__}: {e}"[:400])
            line = f"{name:28s} FAILED {row['error']}"
        finally:
            gc.collect()
        print(line, flush=True)
        result["variants"][name] = row
        write_result(a.out, "decode_latency", result)
    base = result["variants"].get("bf16-b8", {}).get("ms")
    if base:
        for name, row in result["variants"].items():
            if "ms" in row:
                print(f"speed-up over bf16-b8: {name:28s} {base / row['ms']:.2f}x")


if __name__ == "__main__":
    main()
