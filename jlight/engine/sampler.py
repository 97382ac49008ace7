"""On-device sampling: every row of a batch with its own parameters, in one jitted function.

Order of logit processing (as in vLLM): logit bias and banned tokens (min_tokens), then
repetition / presence / frequency penalties, then temperature, top-k, top-p and min-p;
greedy rows take the argmax. Expensive parts run under `lax.cond` so a batch that does
not use them pays nothing, and no parameter value ever changes a compiled shape. Nothing sorts
(see apply_filters), so every cond stays inside XLA's CUDA graphs on the GPU.

Randomness: each row's key is derived from its request seed and the index of the token
being sampled, so a seeded request gets the same tokens whatever else is in the batch.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

NUM_TOP_LOGPROBS = 20  # top alternatives computed on device when any row asks for logprobs
NUM_BANNED = 8  # per-row tokens banned until min_tokens is reached (EOS and stop ids)
NUM_BIAS = 32  # per-row logit_bias entries
_NEG = -1e30


class SamplingInputs(NamedTuple):
    temperature: jax.Array  # [B] float32 (0 = greedy)
    top_k: jax.Array  # [B] int32 (0 = off)
    top_p: jax.Array  # [B] float32 (1 = off)
    min_p: jax.Array  # [B] float32 (0 = off)
    repetition_penalty: jax.Array  # [B] float32 (1 = off)
    presence_penalty: jax.Array  # [B] float32
    frequency_penalty: jax.Array  # [B] float32
    seed: jax.Array  # [B] uint32
    token_index: jax.Array  # [B] int32, index of the output token being sampled
    banned_ids: jax.Array  # [B, NUM_BANNED] int32, -1 padded
    bias_ids: jax.Array  # [B, NUM_BIAS] int32, -1 padded
    bias_values: jax.Array  # [B, NUM_BIAS] float32
    use_penalties: jax.Array  # [] bool: any row has a penalty
    use_filters: jax.Array  # [] bool: any row has top-k / top-p / min-p
    want_logprobs: jax.Array  # [] bool


def _scatter_rows(logits, ids, values, mode):
    """Per-row scatter of values at ids (-1 entries are ignored)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    safe = jnp.where(ids >= 0, ids, 0)
    if mode == "add":
        return logits.at[rows, safe].add(jnp.where(ids >= 0, values, 0.0))
    return logits.at[rows, safe].min(jnp.where(ids >= 0, values, jnp.inf))


def token_counts(history, prompt_len, history_len, vocab: int):
    """history: [B, L] token ids (prompt then output). Returns (output counts [B, V], seen [B, V] bool)."""
    rows = jnp.arange(history.shape[0])[:, None]
    pos = jnp.arange(history.shape[1])[None, :]
    valid = pos < history_len[:, None]
    ids = jnp.where(valid, history, 0)
    counts = jnp.zeros((history.shape[0], vocab), jnp.float32).at[rows, ids].add((valid & (pos >= prompt_len[:, None])).astype(jnp.float32))
    seen = jnp.zeros((history.shape[0], vocab), jnp.bool_).at[rows, ids].max(valid)
    return counts, seen


def apply_penalties(logits, counts_output, seen, s: SamplingInputs):
    """counts_output: [B, V] occurrences in the output; seen: [B, V] bool over prompt + output."""
    rp = s.repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rp, logits * rp), logits)
    logits = logits - s.frequency_penalty[:, None] * counts_output
    logits = logits - s.presence_penalty[:, None] * (counts_output > 0)
    return logits


# Why no jnp.sort / lax.top_k here: every part of the sampler that is skipped when unused sits in a
# lax.cond, and XLA:GPU turns a sort of one long row into a CUB custom call, which cannot be
# recorded into a CUDA graph. A cond holding one then runs on the host, which must wait for the
# device to finish the whole forward pass to read the predicate: on the H200 (2026-11-29) that made
# a 1-row step take 7-9 ms to dispatch instead of ~2.5. The selections below use only reductions.
_BISECTION_STEPS = 32  # halvings of the int32 key range: exact


def sortable_keys(x):
    """float32 -> int32 with the same order (-0.0 sorts just below +0.0)."""
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _midpoint(lo, hi):
    return (lo >> 1) + (hi >> 1) + (lo & hi & 1)  # floor((lo + hi) / 2) without int32 overflow


def _bisect(keys, satisfied, lo, hi):
    """Per row, the smallest t in (lo, hi] with satisfied(t) (non-decreasing in t), given that
    satisfied(hi) holds. keys: [B, V]; lo, hi: [B] int32. Unrolled: no while loop on the host."""
    for _ in range(_BISECTION_STEPS):
        mid = _midpoint(lo, hi)
        ok = satisfied(mid)
        lo, hi = jnp.where(ok, lo, mid), jnp.where(ok, mid, hi)
    return hi


def kth_largest_key(keys, k):
    """keys: [B, V] int32, k: [B] in 1..V -> [B], the k-th largest key of each row (with repeats)."""
    lo, hi = jnp.min(keys, axis=-1) - 1, jnp.max(keys, axis=-1)
    # The largest t with count(keys >= t) >= k is the smallest t whose successor fails it.
    fails_next = lambda t: jnp.sum(keys >= (t + 1)[:, None], axis=-1) < k  # noqa: E731
    return _bisect(keys, fails_next, lo, hi)  # no finite float has the lowest int32 key, so lo cannot wrap


def apply_filters(logits, s: SamplingInputs):
    """Top-k, then top-p, then min-p over temperature-scaled logits; removed entries -> -inf-ish.

    The same sets as sorting the logits (transformers' warpers; tests/test_sampler.py): top-k keeps
    keys >= the k-th largest; top-p keeps the largest tokens while the probability mass above them
    is < top_p (so always the first), i.e. keys >= the smallest key whose mass above is < top_p.
    """
    vocab = logits.shape[-1]
    keys = sortable_keys(logits)  # [B, V]
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = kth_largest_key(keys, k)  # [B]
    in_top_k = keys >= kth[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, logits, _NEG), axis=-1)
    mass_above = lambda t: jnp.sum(jnp.where(keys > t[:, None], probs, 0.0), axis=-1)  # noqa: E731
    max_key = jnp.max(keys, axis=-1)
    p_threshold = _bisect(keys, lambda t: mass_above(t) < s.top_p, kth - 1, max_key)  # within the top-k
    keep = in_top_k & (keys >= p_threshold[:, None])
    # min-p: keep tokens whose probability is at least min_p * max probability.
    max_logit = jnp.max(logits, axis=-1, keepdims=True)
    minp_threshold = jnp.where(s.min_p[:, None] > 0, max_logit + jnp.log(jnp.maximum(s.min_p[:, None], 1e-30)), _NEG)
    keep &= logits >= minp_threshold
    return jnp.where(keep, logits, _NEG)


def top_n(x, n: int):
    """The n largest entries of each row, descending: (values [B, n], ids [B, n] int32); ties go
    to the lower id (as lax.top_k). n argmax passes instead of a sort (see above)."""
    rows = jnp.arange(x.shape[0])
    values, ids = [], []
    for _ in range(n):
        i = jnp.argmax(x, axis=-1).astype(jnp.int32)
        values.append(x[rows, i])
        ids.append(i)
        x = x.at[rows, i].set(-jnp.inf)
    return jnp.stack(values, axis=-1), jnp.stack(ids, axis=-1)


def sample(logits, s: SamplingInputs, history=None):
    """logits: [B, V] float32 raw model logits; history: None or (token ids [B, L], prompt_len [B],
    history_len [B]) for the penalties.

    Returns (token ids [B], logprob of each sampled token [B], top ids [B, N], top logprobs [B, N]);
    logprobs are those of the raw model distribution (as vLLM reports by default).
    """
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    logits = _scatter_rows(logits, s.bias_ids, s.bias_values, "add")
    logits = _scatter_rows(logits, s.banned_ids, jnp.full(s.banned_ids.shape, _NEG), "min")
    if history is not None:
        def penalize(l):
            counts, seen = token_counts(*history, l.shape[-1])
            return apply_penalties(l, counts, seen, s)

        logits = jax.lax.cond(s.use_penalties, penalize, lambda l: l, logits)
    greedy = s.temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, s.temperature)[:, None]
    scaled = jax.lax.cond(s.use_filters, lambda l: apply_filters(l, s), lambda l: l, scaled)

    def gumbel(seed, index):
        key = jax.random.fold_in(jax.random.PRNGKey(seed), index)
        return jax.random.gumbel(key, (logits.shape[-1],), jnp.float32)

    def random_sample(x):
        return jnp.argmax(x + jax.vmap(gumbel)(s.seed, s.token_index), axis=-1).astype(jnp.int32)

    # All-greedy batches skip drawing B x V random numbers.
    sampled = jax.lax.cond(jnp.all(greedy), lambda x: jnp.zeros(x.shape[0], jnp.int32), random_sample, scaled)
    tokens = jnp.where(greedy, jnp.argmax(logits, axis=-1), sampled).astype(jnp.int32)
    token_logprob = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]

    def top(lp):
        vals, ids = top_n(lp, NUM_TOP_LOGPROBS)
        return ids, vals

    empty = (jnp.zeros((logits.shape[0], NUM_TOP_LOGPROBS), jnp.int32), jnp.zeros((logits.shape[0], NUM_TOP_LOGPROBS), jnp.float32))
    top_ids, top_lps = jax.lax.cond(s.want_logprobs, top, lambda lp: empty, raw_logprobs)
    return tokens, token_logprob, top_ids, top_lps
