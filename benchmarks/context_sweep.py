"""Cost against context length: jlight's side of ../shared/peer/vllm_growth.py, on the same requests.

  python benchmarks/context_sweep.py --model-config llama3-8b --max-model-len 32768 --out DIR [--kv-cache-dtype fp8]
  python benchmarks/context_sweep.py --plot DIR/context_*.json --vllm VLLM.json [--vllm-fp8 VLLM_FP8.json] -o docs/img/x.png

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
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LENGTHS = (1024, 2048, 4096, 8192, 16384, 32000, 65536, 131000)


def ttft_prompt(n: int) -> list[int]:
    return [(7 * i + n) % 10000 for i in range(n)]


def batch_prompts(n: int, b: int) -> list[list[int]]:
    return [[(11 * i + n + j) % 10000 for i in range(n)] for j in range(b)]


def copy_rate_bytes_per_s(nbytes: int = 2 << 30) -> float:
    """A plain device-to-device copy (read + written bytes over its time, median of 10)."""
    import jax
    import jax.numpy as jnp

    a = jnp.ones((nbytes // 4,), jnp.float32)
    copy = jax.jit(lambda x: jnp.copy(x))
    copy(a).block_until_ready()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        copy(a).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * nbytes / float(np.median(times))


def run(engine, prompts, max_tokens: int) -> float:
    """Seconds to run these requests to max_tokens output tokens each, alone in the engine (token ids
    folded into a vocabulary smaller than the generator's 10,000: the CPU smoke runs' tiny models)."""
    from jlight.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    t = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=[x % vocab for x in p])
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t


def measure(a) -> dict:
    import jax
    import jax.numpy as jnp

    from jlight.engine.engine_config import EngineConfig
    from jlight.engine.llm_engine import LLMEngine
    from model_configs import random_loaded_model

    t0 = time.perf_counter()
    loaded = random_loaded_model(a.model_config, jnp.dtype(a.dtype), max_position_embeddings=a.max_model_len)
    engine = LLMEngine(EngineConfig(model=None, dtype="auto", max_model_len=a.max_model_len, max_num_seqs=a.max_num_seqs,
                                    max_num_batched_tokens=a.max_num_batched_tokens, kv_cache_dtype=a.kv_cache_dtype,
                                    attention_impl=a.attention_impl, enable_prefix_caching=False, warmup=a.warmup,
                                    page_size=a.page_size), loaded=loaded)
    start_s = time.perf_counter() - t0
    cfg = loaded.config
    weight_bytes = sum(x.nbytes for path, x in jax.tree_util.tree_leaves_with_path(loaded.params)
                       if jax.tree_util.keystr(path) != "['embed']")
    kv_bytes_per_token = engine.kv_bytes_per_page(loaded.params["final_norm"].dtype) / a.page_size
    copy_rate = copy_rate_bytes_per_s()
    # Every step shape the sweep meets, compiled before anything is timed (with --no-warmup only these
    # are compiled): a long prompt's full and remainder chunks, batch-16 prefill and decode, batch-1 decode.
    chunk = engine.runner.buckets[-1]
    run(engine, [[5] * min(chunk + chunk // 2, a.max_model_len - 8)], 2)
    run(engine, [[5] * 64] * 16, 3)
    run(engine, [[5] * 64], 4)
    res = dict(ttft={}, decode_b1={}, decode_b16={}, line_b1={}, line_b16={})
    for n in [n for n in (a.lengths or LENGTHS) if n + 66 <= a.max_model_len]:  # the prompt and 66 new tokens fit
        res["ttft"][n] = round(run(engine, [ttft_prompt(n)], 1) * 1e3, 1)
        for b, key in ((1, "b1"), (16, "b16")):
            if b * n > 300000:
                continue
            ps = batch_prompts(n, b)
            ta = run(engine, ps, 2)
            tb = run(engine, ps, 66)
            res[f"decode_{key}"][n] = round((tb - ta) / 64 * 1e3, 3)
            step_bytes = weight_bytes + b * (n + 34) * kv_bytes_per_token  # context at the middle of the 64 steps
            res[f"line_{key}"][n] = round(step_bytes / copy_rate * 1e3, 3)
        print(n, json.dumps({k: v.get(n) for k, v in res.items()}), flush=True)
    return dict(res, kind="jlight", date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                device=str(jax.devices()[0].device_kind), command=" ".join(sys.argv), commit=_commit(),
                options=dict(vars(a)), copy_rate_tb_s=round(copy_rate / 1e12, 3), weight_gb=round(weight_bytes / 1e9, 3),
                kv_bytes_per_token=kv_bytes_per_token, start_s=round(start_s, 1), jax=jax.__version__)


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        return ""


def plot(paths: list[str], vllm: str | None, vllm_fp8: str | None, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = []
    for p in paths:
        r = json.load(open(p))
        kv = r["options"].get("kv_cache_dtype", "auto")
        series.append((f"jlight ({'bf16' if kv == 'auto' else kv} KV)", r, "-o"))
    for label, p in (("vLLM 0.26 (bf16)", vllm), ("vLLM 0.26 (fp8 KV)", vllm_fp8)):
        if p:
            series.append((label, json.load(open(p)), "--s"))
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    panels = (("ttft", "time to first token (ms)", None), ("decode_b1", "batch-1 decode (ms/step)", "line_b1"),
              ("decode_b16", "batch-16 decode (ms/step)", "line_b16"))
    for ax, (key, title, line) in zip(axes, panels):
        for label, r, style in series:
            pts = sorted((int(n), v) for n, v in r.get(key, {}).items() if v is not None)
            if pts:
                ax.plot(*zip(*pts), style, label=label)
        if line:
            for label, r, _ in series[:1]:
                pts = sorted((int(n), v) for n, v in r.get(line, {}).items())
                if pts:
                    ax.plot(*zip(*pts), ":", color="gray", label=f"bandwidth line ({label.split('(')[1][:-1]}; "
                                                                f"{r['copy_rate_tb_s']} TB/s copy)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context / prompt tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Llama-3-8B shape, random bf16 weights, one {series[0][1]['device']} ({series[0][1]['date'][:10]})")
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
    ap.add_argument("--attention-impl", default="auto")
    ap.add_argument("--no-warmup", dest="warmup", action="store_false", help="compile buckets when first used")
    ap.add_argument("--lengths", type=int, nargs="*", default=None, help="prompt lengths (default: 1k..32k, to the model length)")
    ap.add_argument("--out", default=None, help="directory for the JSON result")
    ap.add_argument("--plot", nargs="*", default=None, help="jlight JSON results to plot instead of measuring")
    ap.add_argument("--vllm", default=None, help="vllm_growth.py's VLLM_GROWTH JSON (bf16)")
    ap.add_argument("--vllm-fp8", default=None, help="the same with --kv-cache-dtype fp8")
    ap.add_argument("-o", "--output", default="context_sweep.png")
    a = ap.parse_args(argv)
    if a.plot is not None:
        plot(a.plot, a.vllm, a.vllm_fp8, a.output)
        return
    result = measure(a)
    print("JLIGHT_GROWTH", json.dumps(result))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        kv = a.kv_cache_dtype if a.kv_cache_dtype != "auto" else "bf16"
        with open(os.path.join(a.out, f"context_{kv}_{a.max_model_len}.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
