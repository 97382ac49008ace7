"""Shared checks of the model-family tests (test_gemma.py, test_phi3_smollm3.py, ...): a tiny random
transformers model of the family against jlight, directly (logits, greedy; scanned and unrolled
layers) and through the engine (batched, chunked prefill, prefix cache, preemption)."""
from __future__ import annotations

import numpy as np

from direct_forward import SingleSequenceRunner, hf_greedy, hf_logits

GREEDY_TOKENS = 32
# Longer than the tiny models' 8-token windows and than one 16-token page; the last one shorter than both.
PROMPTS = [
    [1] + list(range(30, 60)),
    [5, 300, 7, 7, 7, 400, 11, 250, 3, 90, 120, 64, 33, 17, 200, 9, 41, 77, 305, 12, 6],
    [1, 17, 42, 99],
]


def hf_model(path: str, architecture: str):
    import torch
    import transformers

    # The eager attention is transformers' reference; its sdpa path in some releases (5.17 among them, the GPU
    # machine's) drops Gemma 2's attention soft-capping.
    return getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32,
                                                               attn_implementation="eager").eval()


def relative_error(ours: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


def check_direct(params, config, hf, prompts=PROMPTS, max_len: int = 160, bucket: int = 96) -> None:
    """float32 prefill logits within 1e-4 of transformers' and 32 identical greedy tokens."""
    runner = SingleSequenceRunner(params, config, max_len=max_len, prefill_bucket=bucket)
    for prompt in prompts:
        err = relative_error(runner.prefill_logits(prompt), hf_logits(hf, prompt))
        assert err < 1e-4, f"prompt of {len(prompt)} tokens: max relative logit error {err:.2e}"
    for prompt in prompts[:2]:
        assert runner.greedy(prompt, GREEDY_TOKENS) == hf_greedy(hf, prompt, GREEDY_TOKENS), f"prompt {prompt[:6]}..."


def check_engine(path: str, hf, num_pages: int = 24, **options):
    """jlight.LLM over a pool too small for the batch (preemption), 16-token steps (chunked
    prefills that cross the 8-token windows), prompts sharing a 32-token prefix (prefix cache):
    every output is transformers' greedy continuation of its prompt."""
    import jlight
    from jlight import SamplingParams

    rng = np.random.default_rng(7)
    prefix = [int(t) for t in rng.integers(3, 500, 32)]
    prompts = [prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]] + [
        [int(t) for t in rng.integers(3, 500, n)] for n in (27, 19, 40)]
    llm = jlight.LLM(path, dtype="float32", max_num_batched_tokens=16, min_token_bucket=16, max_num_seqs=4,
                     page_size=8, num_pages=num_pages, enable_prefix_caching=True, compilation_cache_dir=None,
                     warmup=False, **options)
    params = SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    outs = llm.generate(prompts[1:], params, use_tqdm=False)
    expected = [hf_greedy(hf, p, GREEDY_TOKENS) for p in prompts]
    assert first.outputs[0].token_ids == expected[0]
    for k, out in enumerate(outs, start=1):
        assert out.outputs[0].token_ids == expected[k], f"prompt {k} differs from transformers"
    assert outs[0].num_cached_tokens >= 16, "the shared prefix did not come from the prefix cache"
    assert llm.engine.stats().num_preemptions > 0, "the pool was meant to be too small for the batch"
    assert llm.engine.block_manager.num_used_pages == 0
    return [first] + outs


def engine_greedy_tokens(engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation (max_tokens, EOS ignored) through an LLMEngine's own step loop."""
    from jlight.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", None, params, prompt_token_ids=prompt)
    got = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids_delta)
    return [got[f"r{i}"] for i in range(len(prompts))]
