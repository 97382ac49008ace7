"""The engine's batch-1 int8 decode through the K-major Pallas GEMV against XLA's dequantize-dot.

A tiny random Llama (benchmarks/attention_engine_check.py's) with int8 weights, one request at a time
and a 1-token step bucket, so every decode step's linear layers and lm_head see one row: on a GPU
matmul_impl="auto" runs them on matmul_pallas.w8a16_kmajor_matmul's GEMV path, matmul_impl="reference"
on XLA's dequantize-dot over the same int8 weights. Both compute the same sums in another order, so
the logprob of each generated token should agree to bf16 rounding and greedy continuations should
part, if at all, only at near-ties.

  python benchmarks/int8_gemv_engine_check.py --out DIR    # GPU
  python benchmarks/int8_gemv_engine_check.py --quick      # CPU (both paths are XLA there: a smoke run)
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def run(model_dir, matmul_impl, prompts, max_tokens):
    import jlight
    from jlight import SamplingParams

    llm = jlight.LLM(model_dir, dtype="bfloat16", quantization="int8", matmul_impl=matmul_impl, min_token_bucket=1,
                     max_num_seqs=1, max_num_batched_tokens=256, page_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    tokens, logprobs = [], []
    for prompt in prompts:  # one at a time: every decode step is one row
        out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
        tokens.append(out.token_ids)
        logprobs.append([d[t] for d, t in zip(out.logprobs, out.token_ids)])
    return tokens, logprobs


def main():
    from attention_engine_check import first_divergence, make_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 short prompts, 4 tokens (CPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rng = np.random.default_rng(1)
    lens = [5, 40] if args.quick else [1, 5, 16, 17, 63, 200, 700, 90]
    prompts = [rng.integers(3, 500, size=n).tolist() for n in lens]
    max_tokens = 4 if args.quick else 48
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(tmp)
        want_tokens, want_lp = run(model_dir, "reference", prompts, max_tokens)
        got_tokens, got_lp = run(model_dir, "auto", prompts, max_tokens)
    first_diff = first_divergence(got_tokens, want_tokens)
    # logprobs of the tokens both generated, up to the first divergence
    diffs = np.concatenate([np.abs(np.asarray(g[:d], np.float64) - np.asarray(w[:d], np.float64))
                            for g, w, d in zip(got_lp, want_lp, [d if d is not None else max_tokens for d in first_diff])])
    result = dict(prompt_lens=lens, identical=sum(d is None for d in first_diff), of=len(prompts), first_divergence=first_diff,
                  max_abs_logprob_diff=float(diffs.max()), mean_abs_logprob_diff=float(diffs.mean()), compared=int(diffs.size))
    print(f"int8 GEMV (auto) vs XLA (reference): {result['identical']} of {result['of']} greedy continuations identical; "
          f"first divergence per prompt: {first_diff}; generated-token logprob |diff| over {diffs.size} tokens: "
          f"max {result['max_abs_logprob_diff']:.4f} mean {result['mean_abs_logprob_diff']:.5f}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "int8_gemv_engine_check.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
