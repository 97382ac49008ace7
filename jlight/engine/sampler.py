"""On-device sampling: every row of a batch with its own parameters, in one jitted function.

Order of logit processing (as in vLLM): logit bias and banned tokens (min_tokens), the
structured-output mask, then repetition / presence / frequency penalties, then temperature, top-k, top-p and min-p;
greedy rows take the argmax. Expensive parts run under `lax.cond` so a batch that does
not use them pays nothing, and no parameter value ever changes a compiled shape.

Randomness: each row's key is derived from its request seed and the index of the token
being sampled, so a seeded request gets the same tokens whatever else is in the batch.

Speculative decoding (speculative.py): a row may carry a draft token, the next position's
proposal. The row samples its token as it would without the draft (the argmax for a greedy row)
and accepts the draft when that token is the draft. So it accepts with the probability its target
distribution (after every step above) gives the draft, and a row that rejects it holds a token of
the target distribution without the draft, renormalized: for a deterministic proposal, speculative
sampling's rule, so the kept tokens follow the target distribution exactly. And since the token at
each index comes from the same key whatever was drafted, a seeded request gets the same tokens with
speculation on or off, whatever its drafts were.
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
    use_guide: jax.Array  # [] bool: some row's tokens are held to a grammar (the step's allowed-token bitmask)
    draft_tokens: jax.Array  # [B] int32, the draft this row verifies (speculative decoding), -1 for none


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


# The sorts below sit under lax.conds. XLA:GPU would sort with CUB custom calls, which its CUDA graphs
# cannot hold, and a conditional whose branch holds one runs on the host, which then waits for the
# forward pass to read the predicate. So the step is compiled without CUB sorts
# (model_runner.STEP_COMPILER_OPTIONS; the figures are in docs/BENCHMARKS.md). The sorts stay sorts: a
# sort-free version (bisection over int32 keys, argmax passes) makes small steps' CUDA graphs larger
# and their dispatch slower.
def apply_filters(logits, s: SamplingInputs):
    """Top-k, then top-p, then min-p over temperature-scaled logits; removed entries -> -inf-ish."""
    vocab = logits.shape[-1]
    sorted_logits = -jnp.sort(-logits, axis=-1)  # descending
    # top-k: keep logits >= the k-th largest.
    k = jnp.where(s.top_k > 0, jnp.minimum(s.top_k, vocab), vocab)
    kth = jnp.take_along_axis(sorted_logits, (k - 1)[:, None], axis=-1)
    sorted_logits = jnp.where(jnp.arange(vocab)[None, :] < k[:, None], sorted_logits, _NEG)
    # top-p: keep the smallest prefix whose probability reaches top_p (always the first).
    probs = jax.nn.softmax(sorted_logits, axis=-1)
    cum_before = jnp.cumsum(probs, axis=-1) - probs
    keep_sorted = cum_before < s.top_p[:, None]
    last_kept = jnp.sum(keep_sorted, axis=-1) - 1
    p_threshold = jnp.take_along_axis(sorted_logits, last_kept[:, None], axis=-1)
    # min-p: keep tokens whose probability is at least min_p * max probability.
    max_logit = sorted_logits[:, :1]
    minp_threshold = jnp.where(s.min_p[:, None] > 0, max_logit + jnp.log(jnp.maximum(s.min_p[:, None], 1e-30)), _NEG)
    threshold = jnp.maximum(jnp.maximum(kth, p_threshold), minp_threshold)
    return jnp.where(logits >= threshold, logits, _NEG)


def allowed_tokens(bitmask, vocab: int):
    """[B, W] int32 bitmask (bit t % 32 of word t // 32 set: token t allowed) -> [B, vocab] bool."""
    bits = (bitmask[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, W, 32]
    bits = bits.reshape(bitmask.shape[0], -1)
    if bits.shape[1] < vocab:  # tokens beyond the mask's width are not allowed
        bits = jnp.pad(bits, ((0, 0), (0, vocab - bits.shape[1])))
    return bits[:, :vocab] != 0


def sample(logits, s: SamplingInputs, history=None, guide_mask=None):
    """logits: [B, V] float32 raw model logits; history: None or (token ids [B, L], prompt_len [B],
    history_len [B]) for the penalties; guide_mask: None or the [B, W] int32 allowed-token bitmask of
    structured outputs (rows without constraints all ones), applied when s.use_guide.

    Returns (token ids [B], logprob of each sampled token [B], top ids [B, N], top logprobs [B, N],
    accepted [B] bool: the row kept its draft, which is then its token); logprobs are those of the raw
    model distribution (as vLLM reports by default).
    """
    raw_logprobs = jax.nn.log_softmax(logits, axis=-1)
    logits = _scatter_rows(logits, s.bias_ids, s.bias_values, "add")
    logits = _scatter_rows(logits, s.banned_ids, jnp.full(s.banned_ids.shape, _NEG), "min")
    if guide_mask is not None:  # before penalties and filters, so top-k/top-p choose among allowed tokens
        logits = jax.lax.cond(s.use_guide, lambda l: jnp.where(allowed_tokens(guide_mask, l.shape[-1]), l, _NEG),
                              lambda l: l, logits)
    if history is not None:
        def penalize(l):
            counts, seen = token_counts(*history, l.shape[-1])
            return apply_penalties(l, counts, seen, s)

        logits = jax.lax.cond(s.use_penalties, penalize, lambda l: l, logits)
    greedy = s.temperature <= 0.0
    scaled = logits / jnp.where(greedy, 1.0, s.temperature)[:, None]
    scaled = jax.lax.cond(s.use_filters, lambda l: apply_filters(l, s), lambda l: l, scaled)

    def key(seed, index):
        return jax.random.fold_in(jax.random.PRNGKey(seed), index)

    def gumbel(seed, index):
        return jax.random.gumbel(key(seed, index), (logits.shape[-1],), jnp.float32)

    def random_sample(x):
        return jnp.argmax(x + jax.vmap(gumbel)(s.seed, s.token_index), axis=-1).astype(jnp.int32)

    draft = s.draft_tokens
    # All-greedy batches skip drawing B x V random numbers.
    all_greedy = jnp.all(greedy)
    sampled = jax.lax.cond(all_greedy, lambda x: jnp.zeros(x.shape[0], jnp.int32), random_sample, scaled)
    greedy_tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    tokens = jnp.where(greedy, greedy_tokens, sampled).astype(jnp.int32)
    accepted = (draft >= 0) & (tokens == draft)
    token_logprob = jnp.take_along_axis(raw_logprobs, tokens[:, None], axis=-1)[:, 0]

    def top(lp):
        vals, ids = jax.lax.top_k(lp, NUM_TOP_LOGPROBS)
        return ids.astype(jnp.int32), vals

    empty = (jnp.zeros((logits.shape[0], NUM_TOP_LOGPROBS), jnp.int32), jnp.zeros((logits.shape[0], NUM_TOP_LOGPROBS), jnp.float32))
    top_ids, top_lps = jax.lax.cond(s.want_logprobs, top, lambda lp: empty, raw_logprobs)
    return tokens, token_logprob, top_ids, top_lps, accepted
