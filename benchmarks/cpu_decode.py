"""CPU decode speed of SmolLM2-135M-Instruct: jlight (float32, bfloat16) next to transformers
(eager, same GGUF, same dtypes) in the same run on the same machine.

Batch 1, greedy, a 64-token prompt; decode tokens/s excludes the prefill:
(time for N new tokens - time for 1 new token) / (N - 1).

  python benchmarks/cpu_decode.py [--new-tokens 128] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import platform
import time

import numpy as np

from jlight.engine.sampling_params import SamplingParams

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import result_header  # noqa: E402


def timed_generate(fn, n_new: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn(n_new)
        best = min(best, time.perf_counter() - t)
    return best


def decode_rate(fn, n_new: int) -> float:
    fn(2)  # warm-up (compiles, allocations)
    return (n_new - 1) / (timed_generate(fn, n_new) - timed_generate(fn, 1))


def jlight_rate(dtype: str, prompt: list[int], n_new: int) -> float:
    import jlight

    llm = jlight.LLM(None, dtype=dtype, max_num_seqs=1, max_num_batched_tokens=64, max_model_len=1024)

    def run(n):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    return decode_rate(run, n_new)


def transformers_rate(dtype: str, gguf_path: str, prompt: list[int], n_new: int) -> float:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                                 dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([prompt])

    def run(n):
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    return decode_rate(run, n_new)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch

    from jlight.loading.default_model import default_gguf_path

    gguf = default_gguf_path()
    prompt = np.random.default_rng(0).integers(100, 40000, 64).tolist()
    rows = []
    for dtype in ("float32", "bfloat16"):
        rows.append(dict(engine="jlight", dtype=dtype, decode_tok_s=jlight_rate(dtype, prompt, a.new_tokens)))
        rows.append(dict(engine=f"transformers {__import__('transformers').__version__} (torch {torch.__version__}, "
                         f"{torch.get_num_threads()} threads)", dtype=dtype,
                         decode_tok_s=transformers_rate(dtype, gguf, prompt, a.new_tokens)))
        for r in rows[-2:]:
            print(f"{r['engine']:60s} {r['dtype']:9s} {r['decode_tok_s']:8.1f} decode tok/s", flush=True)
    result = dict(result_header(), cpu=platform.processor() or platform.machine(),
                  cores=os.cpu_count(), new_tokens=a.new_tokens, prompt_tokens=len(prompt), rows=rows)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "cpu_decode.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
