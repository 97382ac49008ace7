"""Speculative decoding with model proposers (jlight/engine/proposers/): a draft model, on tiny float32
models. Greedy tokens equal speculation off through the whole engine (batched beside requests that do
not speculate, chunked prefill, prefix caching, preemption); a draft identical to the target keeps
every draft (drafting and its K/V are in step with the target); bad configs name their key and fix.

The draft checkpoints are written here in their published layouts: a layer-skip draft is the target's
HF checkpoint cut to its first layers (same tensor names, fewer layers)."""
import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import jlight
from jlight import SamplingParams

# The pool and chunks of test_speculative.py: eight sequences of ~100 tokens preempt each other; chunks of 32 tokens.
ENGINE = dict(dtype="float32", max_num_seqs=8, max_num_batched_tokens=32, page_size=8, num_pages=64, min_token_bucket=8)
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


def write_layer_skip_draft(target_dir: str, out_dir: str, num_layers: int) -> str:
    """The target's checkpoint with only its first num_layers layers (a self-speculative draft)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_layers
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(os.path.join(target_dir, name), out_dir)
    tensors = load_file(os.path.join(target_dir, "model.safetensors"))
    kept = {n: t for n, t in tensors.items() if not n.startswith("model.layers.") or int(n.split(".")[2]) < num_layers}
    save_file(kept, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def prompts_with_shared_prefixes(n: int, seed: int) -> list[list[int]]:
    """Random prompts, some repeating a phrase, and two that extend earlier ones (prefix-cache hits)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        phrase = rng.integers(3, 500, int(rng.integers(4, 12))).tolist()
        out.append(phrase * int(rng.integers(2, 4)) if i % 3 else rng.integers(3, 500, int(rng.integers(5, 60))).tolist())
    return out + [out[1] + out[4][:9], out[2][:16] + [7, 7, 7]]


def token_ids(outputs):
    return [[c.token_ids for c in o.outputs] for o in outputs]


def spec_counts(llm, before):
    s = llm.engine.stats()
    return (s.spec_num_drafts - before.spec_num_drafts, s.spec_num_draft_tokens - before.spec_num_draft_tokens,
            s.spec_num_accepted_tokens - before.spec_num_accepted_tokens)


@pytest.fixture(scope="module")
def target_dir(tiny_model):
    return tiny_model("LlamaForCausalLM", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def plain(target_dir):
    return jlight.LLM(target_dir, **ENGINE)


def check_matches_plain(plain, spec, prompts, kept_some: bool = True):
    """Greedy tokens of `prompts` (the last one with a repetition penalty: it never speculates) equal the
    engine without speculation; the batch preempted, hit the prefix cache and verified drafts."""
    params = [GREEDY] * (len(prompts) - 1) + [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                                             repetition_penalty=1.3)]
    before = spec.engine.stats()
    want = token_ids(plain.generate(prompts, params, use_tqdm=False))
    got = token_ids(spec.generate(prompts, params, use_tqdm=False))
    assert got == want
    stats = spec.engine.stats()
    rows, drafts, accepted = spec_counts(spec, before)
    assert rows > 0 and accepted < drafts
    assert accepted > 0 or not kept_some
    assert stats.num_preemptions > before.num_preemptions
    assert stats.prefix_cache_hit_tokens > before.prefix_cache_hit_tokens
    return drafts, accepted


# --- draft model ----------------------------------------------------------------------------

def test_draft_model_identical_to_the_target_keeps_every_draft(target_dir):
    """Drafting right and its K/V in step with the target's: a draft that is the target keeps every draft."""
    spec = jlight.LLM(target_dir, **ENGINE, speculative_config={"method": "draft_model", "model": target_dir,
                                                                "num_speculative_tokens": 3})
    prompts = prompts_with_shared_prefixes(6, seed=5)
    before = spec.engine.stats()
    spec.generate(prompts, GREEDY, use_tqdm=False)
    rows, drafts, accepted = spec_counts(spec, before)
    assert rows > 20 and accepted / drafts > 0.97, (rows, drafts, accepted)


def test_layer_skip_draft_model_gives_the_targets_greedy_tokens(target_dir, plain, tmp_path):
    draft = write_layer_skip_draft(target_dir, str(tmp_path / "draft"), num_layers=1)
    spec = jlight.LLM(target_dir, **ENGINE, speculative_config={"method": "draft_model", "model": draft,
                                                                "num_speculative_tokens": 3})
    check_matches_plain(plain, spec, prompts_with_shared_prefixes(10, seed=1))


@pytest.mark.parametrize("config, message", [
    ({"method": "medusa", "model": "x"}, "speculative_config.method='medusa' is not supported; supported: ngram, draft_model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model is missing"),
    ({"method": "ngram", "model": "x"}, "speculative_config.model='x' is not used by method 'ngram'"),
])
def test_bad_model_configs_name_the_key_and_the_fix(config, message):
    from jlight.engine.speculative import SpeculativeConfig

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        SpeculativeConfig.from_dict(config)


def test_a_draft_model_that_is_missing_or_of_another_vocabulary_is_refused(target_dir, tiny_model):
    with pytest.raises(ValueError, match="speculative_config.model='/nonexistent/draft' does not exist"):
        jlight.LLM(target_dir, **ENGINE, speculative_config={"method": "draft_model", "model": "/nonexistent/draft"})
    other = tiny_model("LlamaForCausalLM", vocab_size=384)
    with pytest.raises(ValueError, match="does not share the target's vocabulary .*draft 384 tokens, target 512"):
        jlight.LLM(target_dir, **ENGINE, warmup=False, speculative_config={"method": "draft_model", "model": other})
    with pytest.raises(ValueError, match="mesh='tp=2' is invalid: speculative_config.method='draft_model' does not run"):
        jlight.LLM(target_dir, **ENGINE, mesh="tp=2", speculative_config={"method": "draft_model", "model": target_dir})
