"""The engine's greedy tokens with each attention implementation, against the XLA reference.

A tiny random Llama with head_dim 64 (so the Mosaic GPU kernel takes it), bf16, and a mix of
short and long prompts run together, so steps hold prefill chunks, decode rows and page
boundaries. Each implementation's greedy continuations are compared with attention_impl="reference".

  python benchmarks/attention_engine_check.py --out DIR                  # GPU: reference, triton, mosaic
  python benchmarks/attention_engine_check.py --quick --impls mosaic  # CPU (interpret mode), small: about
        3 minutes an implementation on two cores; it runs XLA's CPU client on 4 threads (NPROC, as tests/conftest.py
        does), without which the interpreted warpgroups of a kernel can wait on one another's barrier for ever
  python benchmarks/attention_engine_check.py --kv-cache-dtype int8 --page-size 32 --out DIR  # int8 pages, all three
"""
import argparse
import json
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import result_header  # noqa: E402

# head_dim 64 = 256 / 4 (the tests' tiny models use 16); 4 query heads over 2 KV heads.
MODEL_CONFIG = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                    max_position_embeddings=2048, dtype="bfloat16")


def make_model(tmp_dir: str) -> str:
    from tiny_models import make_tiny_model

    return make_tiny_model(tmp_dir, "LlamaForCausalLM", **MODEL_CONFIG)


def run_impl(model_dir: str, attention_impl: str, prompts, max_tokens: int, **engine_kw):
    """Greedy continuations and the teacher-forced logprob of every prompt token (after the first)."""
    import jlight
    from jlight import SamplingParams

    llm = jlight.LLM(model_dir, dtype="bfloat16", attention_impl=attention_impl, **engine_kw)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(list(prompts), params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[d[t] for d, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, prompts)]
    return tokens, np.concatenate([np.asarray(lp, np.float64) for lp in logprobs])


def first_divergence(got, want) -> list:
    """Per prompt, the index of the first generated token that differs (None: all equal)."""
    return [next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), None) for g, w in zip(got, want)]


def compare(model_dir, impls, prompts, max_tokens, **engine_kw) -> dict:
    """Per implementation: how many greedy continuations equal the reference's (and where each first
    differs), and the largest difference of a prompt token's logprob. bf16 greedy decoding can part
    at a near-tie whatever the kernel, so the logprobs are the sharper check."""
    want_tokens, want_lp = run_impl(model_dir, "reference", prompts, max_tokens, **engine_kw)
    result = {}
    for impl in impls:
        tokens, lp = run_impl(model_dir, impl, prompts, max_tokens, **engine_kw)
        first_diff = first_divergence(tokens, want_tokens)
        result[impl] = dict(identical=sum(d is None for d in first_diff), of=len(prompts), first_divergence=first_diff,
                            max_abs_prompt_logprob_diff=float(np.max(np.abs(lp - want_lp))),
                            mean_abs_prompt_logprob_diff=float(np.mean(np.abs(lp - want_lp))), tokens=tokens)
    return result


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--impls", default="triton,mosaic")
    ap.add_argument("--quick", action="store_true", help="3 short prompts, 6 tokens (CPU)")
    ap.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--kv-cache-dtype", default="auto", help="auto (bf16 pages), int8 or fp8 (the reference reads the same 8-bit pages)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.quick:  # before JAX's CPU client starts: interpret mode needs a thread per warpgroup beside its callback
        os.environ.setdefault("NPROC", "4")
    rng = np.random.default_rng(0)
    lens = [5, 17, 40] if args.quick else [5, 16, 17, 63, 64, 65, 200, 700, 1000, 3, 90, 300, 33, 129, 450, 8]
    prompts = [rng.integers(3, 500, size=n).tolist() for n in lens]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_model(tmp)
        result = compare(model_dir, args.impls.split(","), prompts, 6 if args.quick else 64,
                         max_num_seqs=16, max_num_batched_tokens=256, page_size=args.page_size,
                         kv_cache_dtype=args.kv_cache_dtype)
    for impl, r in result.items():
        print(f"{impl}: {r['identical']} of {r['of']} greedy continuations identical to the reference; "
              f"first divergence per prompt: {r['first_divergence']}; prompt logprobs |diff| max "
              f"{r['max_abs_prompt_logprob_diff']:.4f} mean {r['mean_abs_prompt_logprob_diff']:.5f}")
    if {"triton", "mosaic"} <= set(result):
        same = sum(a == b for a, b in zip(result["triton"]["tokens"], result["mosaic"]["tokens"]))
        print(f"mosaic vs triton: {same} of {len(prompts)} greedy continuations identical")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        suffix = "" if args.kv_cache_dtype == "auto" else "_" + args.kv_cache_dtype
        with open(os.path.join(args.out, f"attention_engine_check_p{args.page_size}{suffix}.json"), "w") as f:
            json.dump(dict(result_header(), prompt_lens=lens, page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype,
                           result=result), f, indent=1)


if __name__ == "__main__":
    main()
