"""jlight's Llama-family forward vs transformers on tiny random-weight models (float32).

Each architecture stresses one difference: Llama (plain GQA), Mistral (sliding window
shorter than the prompts), Qwen2 (q/k/v biases), Qwen3 (qk-norm and head_dim that is not
hidden/heads). Logits must agree to 1e-4 of their max magnitude and 32-token greedy
continuations must be identical.
"""
import numpy as np
import pytest

from direct_forward import SingleSequenceRunner, hf_greedy, hf_logits
from jlight.loading import load_model

CASES = {
    "llama": ("LlamaForCausalLM", {}),
    "mistral_sliding": ("MistralForCausalLM", {"sliding_window": 8}),
    "qwen2_bias": ("Qwen2ForCausalLM", {}),
    "qwen3_qknorm": ("Qwen3ForCausalLM", {}),
}
PROMPTS = [
    [1, 17, 42, 99],
    [1] + list(range(30, 60)),  # longer than the Mistral window and than one KV page
    [5, 300, 7, 7, 7, 400, 11, 250, 3, 90, 120, 64, 33],
]
GREEDY_TOKENS = 32


@pytest.fixture(scope="module", params=list(CASES), ids=list(CASES))
def pair(request, tiny_model):
    """(jlight runner, transformers model) for one tiny architecture."""
    import torch
    import transformers

    arch, overrides = CASES[request.param]
    path = tiny_model(arch, **overrides)
    loaded = load_model(path, dtype="float32")
    hf = getattr(transformers, arch).from_pretrained(path, dtype=torch.float32).eval()
    return SingleSequenceRunner(loaded.params, loaded.config, max_len=128, prefill_bucket=64), hf


def test_logits_match_transformers(pair):
    runner, hf = pair
    for prompt in PROMPTS:
        ours, ref = runner.prefill_logits(prompt), hf_logits(hf, prompt)
        assert ours.shape == ref.shape
        err = np.abs(ours - ref).max() / np.abs(ref).max()
        assert err < 1e-4, f"prompt of {len(prompt)} tokens: max relative logit error {err:.2e}"


def test_greedy_continuation_matches_transformers(pair):
    runner, hf = pair
    for prompt in PROMPTS[1:]:
        ours = runner.greedy(prompt, GREEDY_TOKENS)
        assert ours == hf_greedy(hf, prompt, GREEDY_TOKENS), f"prompt {prompt[:6]}..."


def test_llm_engine_greedy_matches_transformers(tiny_model):
    """End to end through jlight.LLM (scheduler, paged cache, sampler): a batch of prompts
    decoded greedily together gives transformers' per-prompt greedy tokens."""
    import torch
    import transformers

    import jlight
    from jlight.engine.sampling_params import SamplingParams

    arch, overrides = CASES["qwen3_qknorm"]
    path = tiny_model(arch, **overrides)
    hf = transformers.Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = jlight.LLM(path, dtype="float32", max_model_len=128, num_pages=64, warmup=False)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, GREEDY_TOKENS), f"prompt {prompt[:6]}..."
