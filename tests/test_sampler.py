"""The on-device sampler's logit processing against transformers' logits processors."""
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    TopKLogitsWarper, TopPLogitsWarper)

import jax
import jax.numpy as jnp
from jlight.engine import sampler

sample = jax.jit(sampler.sample)  # eager mode would compile every lax.cond again on each call

B, V = 4, 300


def inputs(**overrides):
    base = dict(
        temperature=np.ones(B, np.float32), top_k=np.zeros(B, np.int32), top_p=np.ones(B, np.float32),
        min_p=np.zeros(B, np.float32), repetition_penalty=np.ones(B, np.float32), presence_penalty=np.zeros(B, np.float32),
        frequency_penalty=np.zeros(B, np.float32), seed=np.arange(B, dtype=np.uint32), token_index=np.zeros(B, np.int32),
        banned_ids=np.full((B, sampler.NUM_BANNED), -1, np.int32), bias_ids=np.full((B, sampler.NUM_BIAS), -1, np.int32),
        bias_values=np.zeros((B, sampler.NUM_BIAS), np.float32), use_penalties=np.bool_(True), use_filters=np.bool_(True),
        want_logprobs=np.bool_(False), use_guide=np.bool_(False), draft_tokens=np.full(B, -1, np.int32))
    base.update(overrides)
    return sampler.SamplingInputs(**base)


def kept(x):
    return np.asarray(x) > -1e29


@pytest.mark.parametrize("seed", [0, 1])
def test_top_k_top_p_min_p_match_transformers(seed):
    logits = np.random.default_rng(seed).normal(0, 3, (B, V)).astype(np.float32)
    t = torch.tensor(logits)
    cases = [(5, 1.0, 0.0), (0, 0.8, 0.0), (0, 1.0, 0.05), (1, 1.0, 0.0),
             (10, 0.5, 0.0), (50, 0.9, 0.02), (0, 0.3, 0.0), (0, 0.97, 0.0), (200, 0.6, 0.01)]
    for i, (k, p, mp) in enumerate(cases):
        row = i % B
        s = inputs(top_k=np.full(B, k, np.int32), top_p=np.full(B, p, np.float32), min_p=np.full(B, mp, np.float32))
        ours = kept(sampler.apply_filters(jnp.asarray(logits), s))[row]
        ref = t[row:row + 1]
        if k:
            ref = TopKLogitsWarper(k)(None, ref)
        if p < 1.0:
            ref = TopPLogitsWarper(p)(None, ref)
        if mp:
            ref = MinPLogitsWarper(mp)(None, ref)
        np.testing.assert_array_equal(ours, torch.isfinite(ref[0]).numpy(), err_msg=f"top_k={k} top_p={p} min_p={mp}")


def test_repetition_presence_frequency_penalties():
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 3, (B, V)).astype(np.float32)
    prompt_len = np.array([5, 3, 8, 1], np.int32)
    history = rng.integers(0, 20, (B, 16)).astype(np.int32)
    hist_len = np.array([10, 3, 16, 6], np.int32)
    counts, seen = sampler.token_counts(jnp.asarray(history), jnp.asarray(prompt_len), jnp.asarray(hist_len), V)
    s = inputs(repetition_penalty=np.full(B, 1.3, np.float32), presence_penalty=np.full(B, 0.5, np.float32),
               frequency_penalty=np.full(B, 0.25, np.float32))
    ours = np.asarray(sampler.apply_penalties(jnp.asarray(logits), counts, seen, s))
    for b in range(B):
        ids = history[b, : hist_len[b]]
        ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor(ids[None].astype(np.int64)), torch.tensor(logits[b:b + 1]))[0].numpy()
        out_ids = ids[prompt_len[b]:]
        c = np.bincount(out_ids, minlength=V).astype(np.float32)
        ref = ref - 0.25 * c - 0.5 * (c > 0)  # OpenAI's presence / frequency penalties over the output
        np.testing.assert_allclose(ours[b], ref, rtol=1e-6, atol=1e-6)


def test_greedy_bias_and_banned_tokens():
    logits = np.random.default_rng(3).normal(0, 1, (B, V)).astype(np.float32)
    top = logits.argmax(-1)
    banned = np.full((B, sampler.NUM_BANNED), -1, np.int32)
    banned[0, 0] = top[0]
    bias_ids = np.full((B, sampler.NUM_BIAS), -1, np.int32)
    bias_vals = np.zeros((B, sampler.NUM_BIAS), np.float32)
    bias_ids[1, 0], bias_vals[1, 0] = 7, 100.0
    s = inputs(temperature=np.zeros(B, np.float32), banned_ids=banned, bias_ids=bias_ids, bias_values=bias_vals,
               use_penalties=np.bool_(False), use_filters=np.bool_(False))
    toks, _, _, _, _ = sample(jnp.asarray(logits), s)
    toks = np.asarray(toks)
    assert toks[0] == np.argsort(-logits[0])[1]  # the top token is banned: the runner-up wins
    assert toks[1] == 7
    assert (toks[2:] == top[2:]).all()


def test_seeded_rows_do_not_depend_on_their_neighbours():
    logits = np.random.default_rng(4).normal(0, 1, (B, V)).astype(np.float32)
    s = inputs(seed=np.array([11, 12, 13, 14], np.uint32), token_index=np.array([3, 0, 5, 2], np.int32), use_filters=np.bool_(False))
    a = np.asarray(sample(jnp.asarray(logits), s)[0])
    shuffled = logits.copy()
    shuffled[1:] = np.random.default_rng(5).normal(0, 1, (B - 1, V))
    s2 = s._replace(seed=np.array([11, 99, 98, 97], np.uint32))
    b = np.asarray(sample(jnp.asarray(shuffled), s2)[0])
    assert a[0] == b[0]
    # Sampling is real: over many keys the empirical distribution follows softmax.
    draws = [int(t) for i in range(50) for t in np.asarray(sample(jnp.asarray(logits[:1].repeat(B, 0)), inputs(
        seed=np.arange(B, dtype=np.uint32) + 4 * i, use_filters=np.bool_(False)))[0])]
    probs = np.exp(logits[0] - logits[0].max()); probs /= probs.sum()
    top5 = np.argsort(-probs)[:5]
    assert abs(np.mean(np.isin(draws, top5)) - probs[top5].sum()) < 0.12



def test_the_structured_output_mask_allows_only_its_tokens():
    """Bit t % 32 of word t // 32 allows token t (llguidance's layout, read back with numpy's unpackbits);
    a vocabulary wider than the mask allows none of the extra tokens; use_guide=False ignores the mask."""
    rng = np.random.default_rng(5)
    words = (V - 40 + 31) // 32  # narrower than V: the last tokens have no bits
    mask = rng.integers(-2**31, 2**31, size=(B, words), dtype=np.int64).astype(np.int32)
    mask[:, 0] &= ~1  # token 0 never allowed
    expected = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")[:, :V].astype(bool)
    expected = np.pad(expected, ((0, 0), (0, V - expected.shape[1])))
    assert (np.asarray(sampler.allowed_tokens(jnp.asarray(mask), V)) == expected).all()

    logits = rng.standard_normal((B, V)).astype(np.float32)
    logits[:, 0] = 100.0  # the unconstrained favourite, which the mask bans
    for temperature in (0.0, 1.5):
        s = inputs(temperature=np.full(B, temperature, np.float32), use_guide=np.bool_(True))
        for trial in range(5):
            s = s._replace(token_index=np.full(B, trial, np.int32))
            tokens = np.asarray(sample(jnp.asarray(logits), s, guide_mask=jnp.asarray(mask))[0])
            assert expected[np.arange(B), tokens].all(), tokens
        if temperature == 0.0:
            assert (tokens == np.where(expected, logits, -np.inf).argmax(-1)).all()
    s = inputs(temperature=np.zeros(B, np.float32), use_guide=np.bool_(False))
    assert (np.asarray(sample(jnp.asarray(logits), s, guide_mask=jnp.asarray(mask))[0]) == 0).all()
