"""Where a large-batch decode step's time goes: B sequences with C tokens of context each, all
decoding, through the full engine; the step's device wall time against its roofline, and CUPTI's
kernel list.

Use: a decode step's cost at one batch and context, broken down by kernel (context_sweep.py and the peer's
vllm_growth.py give the same steps' wall time across contexts). After the device figures, --engine-steps
full engine steps with the batch unchanged give tok/s and the host time inside runner.launch (a launch
about as long as the step means the host waited for the device inside the jitted call).

  python benchmarks/batch_decode_profile.py --model-config llama3-8b --batches 64,256 --context 1024 --out DIR
  python benchmarks/batch_decode_profile.py --model-config tiny --batches 4 --context 40   # CPU smoke run

Roofline of a decode step: max(bytes / copy rate, FLOPs / 645 TFLOP/s), where bytes = the weights
(but the embedding table) + every K/V page the batch reads (B x C tokens, all layers), and FLOPs =
2 x weights x B + the attention's 4 x B x C x heads x head_dim x layers.
"""
import argparse
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from decode_latency import _spy_on_steps, back_to_back_ms, kernel_breakdown  # noqa: E402
from harness import copy_bytes_per_s, random_loaded_model, result_header, weight_bytes, write_result  # noqa: E402

from jlight.engine import model_runner  # noqa: E402
from jlight.engine.engine_config import EngineConfig  # noqa: E402
from jlight.engine.llm_engine import LLMEngine  # noqa: E402
from jlight.engine.sampling_params import SamplingParams  # noqa: E402

BF16_MATMUL_FLOPS = 645e12  # the H200's measured bf16 matmul rate (task statement, 2026-11-29)


def decode_step_inputs(engine: LLMEngine, calls: list, batch: int, context: int, max_tokens: int, temperature: float,
                       top_p: float, seed: int = 0):
    """Admit `batch` requests of `context` random prompt tokens and step until every one is decoding;
    returns the StepInputs of the last step (a decode step of `batch` tokens). `calls` is the runner's
    launch spy (decode_latency._spy_on_steps)."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=max_tokens, ignore_eos=True, seed=seed)
    for i in range(batch):
        engine.add_request(f"r{i}", None, params,
                           prompt_token_ids=rng.integers(0, engine.model_config.vocab_size, context).tolist())
    generated = {}
    while len(generated) < batch or min(generated.values()) < 2:  # every sequence past its first decode step
        for out in engine.step():
            generated[out.request_id] = generated.get(out.request_id, 0) + len(out.outputs[0].token_ids_delta)
    inp = calls[-1][0]
    rows = int(np.count_nonzero(np.asarray(inp.md.context_lens)))
    if rows != batch:
        raise RuntimeError(f"the last step decodes {rows} sequences, not {batch}: some finished during the others' "
                           f"prefill (max_tokens={max_tokens} is too small)")
    return inp


def prefill_steps(batch: int, context: int, chunk: int) -> int:
    """Steps the batch's prefill takes, chunk tokens a step: the first sequence decodes about that many
    tokens before the last one starts."""
    return -(-batch * context // chunk) + 1


def engine_steps(engine: LLMEngine, calls: list, steps: int) -> dict:
    """`steps` full engine steps (host included), the batch unchanged: output tokens per second, and
    the median and largest step time and host time inside runner.launch (the jitted call: a launch
    that lasts about as long as the step means the host waited for the device inside it)."""
    first = len(calls)
    tokens, step_s = 0, []
    for _ in range(steps):
        t0 = time.perf_counter()
        tokens += sum(len(o.outputs[0].token_ids_delta) for o in engine.step())
        step_s.append(time.perf_counter() - t0)
    launch_s = [t for _, t in calls[first:]]
    ms = lambda xs: [round(1e3 * float(np.median(xs)), 3), round(1e3 * max(xs), 3)]  # noqa: E731
    return dict(tok_s=tokens / sum(step_s), step_ms_median_max=ms(step_s), launch_ms_median_max=ms(launch_s))


def roofline(cfg, params, batch: int, context: int, copy_bw: float) -> dict:
    """context: the step's mean context length."""
    kv_bytes = batch * context * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2  # bf16 K and V
    w_bytes = weight_bytes(params)
    flops = 2 * w_bytes / 2 * batch + 4 * batch * context * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return dict(weight_gb=w_bytes / 1e9, kv_gb=kv_bytes / 1e9, tflop=flops / 1e12,
                memory_ms=(w_bytes + kv_bytes) / copy_bw * 1e3, compute_ms=flops / BF16_MATMUL_FLOPS * 1e3)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-config", default="llama3-8b")
    ap.add_argument("--batches", default="64,256", help="comma-separated numbers of decoding sequences")
    ap.add_argument("--context", type=int, default=1024, help="prompt tokens of each sequence")
    ap.add_argument("--temperature", type=float, default=0.6, help="0: greedy (the sampler skips its random draw)")
    ap.add_argument("--top-p", type=float, default=1.0, help="< 1: every step sorts its logits (the sampler's filters)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the prefill chunk that fills the batch")
    ap.add_argument("--engine-steps", type=int, default=20, help="full engine steps timed after the device-side figures")
    ap.add_argument("--attention-impl", default="auto")
    ap.add_argument("--kernel-breakdown", action="store_true", help="GPU: CUPTI's kernel list of one step")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)

    loaded = random_loaded_model(a.model_config, jnp.bfloat16, max_position_embeddings=a.context + 4096)
    gpu = jax.default_backend() == "gpu"
    copy_bw = copy_bytes_per_s() if gpu else None
    result = dict(result_header(), xla_flags=os.environ.get("XLA_FLAGS", ""),
                  step_compiler_options=model_runner.STEP_COMPILER_OPTIONS, copy_bw_tb_s=copy_bw and copy_bw / 1e12, rows={})
    for batch in (int(b) for b in a.batches.split(",")):
        chunk = max(a.max_num_batched_tokens, batch)
        max_len = a.context + prefill_steps(batch, a.context, chunk) + a.engine_steps + 64
        engine = LLMEngine(EngineConfig(
            model=None, max_num_seqs=batch, max_num_batched_tokens=chunk, max_model_len=max_len,
            num_pages=batch * (-(-max_len // 16)) + 2, warmup=False, attention_impl=a.attention_impl), loaded=loaded)
        calls = _spy_on_steps(engine.runner)  # (inputs, host seconds of the launch) of every step
        t0 = time.perf_counter()
        inp = decode_step_inputs(engine, calls, batch, a.context, max_len - a.context, a.temperature, a.top_p)
        mean_context = float(np.asarray(inp.md.context_lens).sum()) / batch  # the prompt and what each decoded since
        row = dict(batch=batch, context=a.context, mean_context=mean_context, fill_s=time.perf_counter() - t0,
                   step_ms=back_to_back_ms(engine.runner, inp, reps=20))
        if copy_bw:
            row["roofline"] = roofline(engine.model_config, engine.runner.params, batch, mean_context, copy_bw)
        if a.kernel_breakdown and gpu:
            row["kernels"] = kernel_breakdown(engine.runner, (inp, None), top=16)
        row["engine"] = engine_steps(engine, calls, a.engine_steps)
        e = row["engine"]
        line = (f"B={batch:4d} C={a.context}: decode step {row['step_ms']:.2f} ms back to back; engine {e['tok_s']:.0f} tok/s, "
                f"step {e['step_ms_median_max'][0]:.2f} ms (max {e['step_ms_median_max'][1]:.1f}), launch "
                f"{e['launch_ms_median_max'][0]:.2f} ms (max {e['launch_ms_median_max'][1]:.1f})")
        if copy_bw:
            r = row["roofline"]
            floor = max(r["memory_ms"], r["compute_ms"])
            line += (f"; roofline {floor:.2f} ms (memory {r['memory_ms']:.2f}: {r['weight_gb']:.1f} GB weights + "
                     f"{r['kv_gb']:.1f} GB K/V; compute {r['compute_ms']:.2f}) -> {row['step_ms'] / floor:.2f}x")
        print(line, flush=True)
        result["rows"][str(batch)] = row
        del engine
        write_result(a.out, "batch_decode_profile", result)


if __name__ == "__main__":
    main()
