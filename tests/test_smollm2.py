"""SmolLM2-135M-Instruct (Q4_1 GGUF): jlight's GGUF loader vs transformers loading the same file.

Covers dequantization, llama.cpp's Q/K row permutation being undone, the config built from
GGUF metadata, and the tokenizer / chat template built from GGUF metadata.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from direct_forward import SingleSequenceRunner, gguf_and_transformers, hf_greedy, hf_logits

CHAT_QUESTION = "What is the capital of France?"
OTHER_PROMPTS = [
    "Hi",
    "The three primary colors are",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Write a short poem about the sea. It should rhyme and mention the moon, the tide, and a lighthouse keeper "
    "who has lived alone on a rocky island for forty years, listening to the waves every night.",
]
GREEDY_TOKENS = 32
TOKENIZER_TEXTS = [
    "Hello, world! How are you today?",
    "naïve café — déjà vu; 日本語のテキスト; 한국어; emoji 😀👍🏽 and ZWJ 👩‍👩‍👧",
    "def f(x):\n\tif x > 0:\n        return x ** 2  # square\n\n\n    return -x",
    "   leading and trailing spaces   \n\n  tabs\t\tand\r\nCRLF",
    "Numbers 1234567890, 3.14159, 1e-5 and version v2.0.1",
    "<|im_start|>user\nspecial tokens inline<|im_end|>",
    "It's they're we've I'd you'll",
]


@pytest.fixture(scope="module")
def models(smollm2_gguf):
    """(jlight LoadedModel float32, transformers model, transformers tokenizer) for the same GGUF."""
    return gguf_and_transformers(smollm2_gguf)


@pytest.fixture(scope="module")
def runner(models):
    loaded = models[0]
    return SingleSequenceRunner(loaded.params, loaded.config, max_len=256, prefill_bucket=128)


def chat_ids(tokenizer, question):
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": question}]))


def test_config_from_gguf_metadata(models):
    loaded, hf, _ = models
    c, h = loaded.config, hf.config
    assert (c.architecture, c.vocab_size, c.hidden_size, c.num_layers) == ("LlamaForCausalLM", h.vocab_size, h.hidden_size, h.num_hidden_layers)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size) == (9, 3, 64, 1536)
    assert c.rope_theta == 100000.0 and c.tie_word_embeddings
    assert loaded.tokenizer.eos_token_ids == [2] and loaded.tokenizer.bos_token_id == 1


def test_chat_logits_match_transformers(models, runner):
    loaded, hf, _ = models
    ids = chat_ids(loaded.tokenizer, CHAT_QUESTION)
    ours, ref = runner.prefill_logits(ids), hf_logits(hf, ids)
    err = np.abs(ours - ref).max() / np.abs(ref).max()
    assert err < 1e-4, f"max relative logit error {err:.2e}"
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_greedy_continuations_match_transformers(models, runner):
    loaded, hf, _ = models
    tok = loaded.tokenizer
    prompts = [chat_ids(tok, CHAT_QUESTION)] + [tok.encode(p) for p in OTHER_PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts), "prompts should have different lengths"
    greedy = []
    for prompt in prompts:
        greedy.append(runner.greedy(prompt, GREEDY_TOKENS))
        assert greedy[-1] == hf_greedy(hf, prompt, GREEDY_TOKENS), tok.decode(prompt)
    answer = tok.decode(greedy[0][:16])  # greedy: the first 16 of the chat answer's 32 tokens
    assert "Paris" in answer, answer


def test_tokenizer_matches_transformers(models):
    loaded, _, hf_tok = models
    tok = loaded.tokenizer
    for text in TOKENIZER_TEXTS:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text), text
        assert tok.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids, skip_special_tokens=False)
        assert tok.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
    assert tok.vocab_size == len(hf_tok)
    assert set(hf_tok.all_special_ids) <= set(tok.all_special_ids)


@pytest.mark.parametrize(
    "messages, add_generation_prompt",
    [
        ([{"role": "user", "content": CHAT_QUESTION}], True),
        ([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Bonjour ?"}], True),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello! 😀"}, {"role": "user", "content": "bye"}], False),
    ],
)
def test_chat_template_matches_transformers(models, messages, add_generation_prompt):
    loaded, _, hf_tok = models
    ours = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    ref = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == ref


def test_bfloat16_top1_agrees_with_float32(models, runner):
    """Teacher-forced over prompt + float32 greedy output: bf16 argmax agrees at >= 95% of positions.

    The bf16 params are the float32 dequantized weights cast to bf16, which is exactly what
    load_model(dtype="bfloat16") does per tensor (tests/test_loading.py checks that path).
    """
    loaded = models[0]
    ids = chat_ids(loaded.tokenizer, CHAT_QUESTION)
    ids = ids + runner.greedy(ids, GREEDY_TOKENS)
    f32_top1 = runner.teacher_forced_top1(ids)
    bf16_params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), loaded.params)
    bf16_top1 = SingleSequenceRunner(bf16_params, loaded.config, max_len=256, prefill_bucket=128).teacher_forced_top1(ids)
    agreement = float((f32_top1 == bf16_top1).mean())
    assert agreement >= 0.95, f"bf16/f32 top-1 agreement {agreement:.3f}"
