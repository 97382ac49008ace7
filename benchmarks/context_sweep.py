"""Cost against context length: jlight's side of ../shared/peer/vllm_growth.py, on the same requests.

  python benchmarks/context_sweep.py --model-config llama3-8b --max-model-len 32768 --out DIR [--kv-cache-dtype fp8]
  python benchmarks/context_sweep.py --plot DIR/context_*.json --vllm VLLM.json [--vllm-fp8 VLLM_FP8.json] \
      [--copy-rate 4.26] -o docs/img/x.png

For each prompt length n (1k .. 32k, to 128k with --max-model-len 131072), on a random-weight model:
- TTFT: one request of n prompt tokens and one output token, wall time of the whole request;
- batch-1 and batch-16 decode: requests of n prompt tokens run to 2 and to 66 output tokens, and
  (t66 - t2) / 64 is the time of one decode step at about n tokens of context (batch 16 only while
  16 * n <= 300,000, as in vllm_growth.py);
with the generator of vllm_growth.py: prompt [(7 * i + n) % 10000 for i in range(n)] for TTFT and
[(11 * i + n + j) % 10000 for i in range(n)] for row j of a batch. Prefix caching is off, as there.

The physical line beside each decode figure: the bytes a step must read (every weight but the
embedding table, plus the K/V of every row's context) over the device's copy rate, measured in the
same process as a plain device-to-device copy counting bytes read plus written.

--plot draws jlight's JSON results beside vLLM's (the VLLM_GROWTH line of vllm_growth.py's output,
saved as JSON) and the line, into one PNG of three panels (TTFT, batch-1 and batch-16 decode).
Results of one run stay in docs/data/ beside the PNG that plots them.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import harness  # noqa: E402

from jlight.engine import startup  # noqa: E402

LENGTHS = harness.GROWTH_LENGTHS + (65536, 131000)


def measure(a) -> dict:
    """The sweep on one engine: TTFT, then batch-1 and batch-16 decode, length by length."""
    t0 = time.perf_counter()
    engine = harness.random_engine(a.model_config, a.dtype, max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                                   max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_dtype=a.kv_cache_dtype,
                                   attention_impl=a.attention_impl, enable_prefix_caching=False, warmup=a.warmup,
                                   page_size=a.page_size, gpu_memory_utilization=a.gpu_memory_utilization,
                                   **a.engine_options)
    start_s = time.perf_counter() - t0
    generate = lambda requests: harness.engine_generate(engine, requests)
    weight_bytes = harness.weight_bytes(engine.runner.params)
    kv_bytes_per_token = engine.kv_bytes_per_page(engine.runner.kv_dtype) / a.page_size
    copy_rate = harness.copy_bytes_per_s()
    # Every step shape the sweep meets, compiled before anything is timed (with --no-warmup only these
    # are compiled): a long prompt's full and remainder chunks, batch-16 prefill and decode, batch-1 decode.
    chunk = engine.runner.buckets[-1]
    for prompts, tokens in (([[5] * min(chunk + chunk // 2, a.max_model_len - 8)], 2), ([[5] * 64] * 16, 3), ([[5] * 64], 4)):
        generate([harness.Request(p, tokens) for p in prompts])
    res = dict(ttft={}, decode_b1={}, decode_b16={}, line_b1={}, line_b16={})
    for n in [n for n in (a.lengths or LENGTHS) if n + 66 <= a.max_model_len]:  # the prompt and 66 new tokens fit
        res["ttft"][n] = round(harness.growth_ttft_ms(generate, n), 1)
        for _, b in harness.growth_cases([n]):
            res[harness.GROWTH_BATCHES[b]][n] = round(harness.growth_decode_ms_per_step(generate, n, b), 3)
            step_bytes = weight_bytes + b * (n + 34) * kv_bytes_per_token  # the context halfway through the 64 steps
            res[f"line_b{b}"][n] = round(step_bytes / copy_rate * 1e3, 3)
        print(n, json.dumps({k: v.get(n) for k, v in res.items()}), flush=True)
    return dict(res, kind="jlight", options=dict(vars(a)), copy_rate_tb_s=round(copy_rate / 1e12, 3),
                weight_gb=round(weight_bytes / 1e9, 3), kv_bytes_per_token=kv_bytes_per_token, start_s=round(start_s, 1))


def plot(paths: list[str], vllm: str | None, vllm_fp8: str | None, out: str, copy_rate_tb_s: float | None = None) -> None:
    """One PNG of three panels (TTFT, batch-1 and batch-16 decode against context): jlight's results (files
    of one KV dtype are merged), vLLM's, and the bandwidth line of jlight's bf16 cache at copy_rate_tb_s
    (default: the rate the first result measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jlight = {}
    for p in paths:
        r = json.load(open(p))
        kv = r["options"].get("kv_cache_dtype", "auto")
        merged = jlight.setdefault("bf16" if kv == "auto" else kv, dict(r))
        for key in ("ttft", "decode_b1", "decode_b16"):
            merged[key] = {**merged.get(key, {}), **r.get(key, {})}
    series = [(f"jlight ({kv} KV)", r, "-o") for kv, r in jlight.items()]
    series += [(label, json.load(open(p)), "--s") for label, p in (("vLLM 0.26 (bf16 KV)", vllm), ("vLLM 0.26 (fp8 KV)", vllm_fp8)) if p]
    base = next(iter(jlight.values()))
    rate = (copy_rate_tb_s or base["copy_rate_tb_s"]) * 1e12
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = (("ttft", "time to first token (ms)", None), ("decode_b1", "batch-1 decode (ms/step)", 1),
              ("decode_b16", "batch-16 decode (ms/step)", 16))
    for ax, (key, title, batch) in zip(axes, panels):
        lengths = set()
        for label, r, style in series:
            pts = sorted((int(n), v) for n, v in r.get(key, {}).items() if v is not None)
            lengths |= {n for n, _ in pts}
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        if batch:
            kv = jlight.get("bf16", base)
            ns = sorted(lengths)
            line = [(kv["weight_gb"] * 1e9 + batch * (n + 34) * kv["kv_bytes_per_token"]) / rate * 1e3 for n in ns]
            ax.plot(ns, line, ":", color="gray", label=f"bytes / copy rate (bf16 KV, {rate / 1e12:.2f} TB/s)")
        ax.set_xscale("log", base=2)
        if not batch:
            ax.set_yscale("log")
        ax.set_xlabel("context / prompt tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Llama-3-8B shape, random bf16 weights, {base['device']} ({base['date'][:10]})")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-config", default="llama3-8b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-model-len", type=int, default=32768)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "int8"])
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--gpu-memory-utilization", type=float, default=None,
                    help="vLLM's meaning: the engine's share of the card (the peer runs 0.9); set before JAX starts")
    ap.add_argument("--attention-impl", default="auto")
    ap.add_argument("--engine-options", type=json.loads, default={}, metavar="JSON",
                    help="more EngineConfig fields, e.g. '{\"prompt_logprobs_program\": true}'")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="compile buckets when first used")
    ap.add_argument("--lengths", type=lambda v: [int(x) for x in v.split(",")], default=None,
                    help="comma-separated prompt lengths (default: 1k..128k, those that fit --max-model-len)")
    ap.add_argument("--out", default=None, help="directory for the JSON result")
    ap.add_argument("--plot", nargs="*", default=None, help="jlight JSON results to plot instead of measuring")
    ap.add_argument("--vllm", default=None, help="vllm_growth.py's VLLM_GROWTH JSON (bf16)")
    ap.add_argument("--vllm-fp8", default=None, help="the same with --kv-cache-dtype fp8")
    ap.add_argument("--copy-rate", type=float, default=None, help="TB/s for the plotted line (default: the run's own)")
    ap.add_argument("-o", "--output", default="context_sweep.png")
    a = ap.parse_args(argv)
    if a.plot is not None:
        plot(a.plot, a.vllm, a.vllm_fp8, a.output, a.copy_rate)
        return
    startup.claim_device_memory(a)  # before the random weights start JAX's backend
    result = measure(a)
    print("JLIGHT_GROWTH", json.dumps(result))
    kv = a.kv_cache_dtype if a.kv_cache_dtype != "auto" else "bf16"
    harness.write_result(a.out, f"context_{kv}_{a.max_model_len}", result)


if __name__ == "__main__":
    main()
