"""N-gram prompt lookup: drafts copied from where the sequence's last tokens occurred before.

The copy reads on into the drafts it has made (an overlapping copy): where the tokens after the matched
occurrence run into the end of the history, the drafts continue with the tokens after the occurrence again.
An occurrence p tokens before the suffix says the text repeats with period p, and the copy predicts that
the period goes on, so a sequence that repeats a short cycle (one token over and over, say) still gets
the full num_speculative_tokens drafts a step.
"""
from __future__ import annotations

import numpy as np

from jlight.engine.proposers.base import Proposer
from jlight.engine.sequence import Sequence
from jlight.engine.speculative import SpeculativeConfig


class NgramProposer(Proposer):
    drafts_ahead = True

    def __init__(self, config: SpeculativeConfig):
        self.config = config

    def drafts(self, seq: Sequence, max_drafts: int) -> list[int]:
        return propose_ngram(seq.token_array(), self.config, max_drafts)

    def drafts_after(self, seq: Sequence, in_flight: list[int], max_drafts: int) -> list[int]:
        tokens = seq.token_array()
        if in_flight:
            tokens = np.concatenate([tokens, np.asarray(in_flight, np.int32)])
        return propose_ngram(tokens, self.config, max_drafts, skip=1)


def propose_ngram(tokens: np.ndarray, config: SpeculativeConfig, max_drafts: int, skip: int = 0) -> list[int]:
    """Prompt lookup: the longest suffix of `tokens` (prompt_lookup_max down to prompt_lookup_min
    tokens) that occurred earlier in them, and the tokens that followed its latest earlier
    occurrence, max_drafts of them (at most num_speculative_tokens). Draft i is
    tokens[start + (skip + i) mod p], where start follows the occurrence and p = len(tokens) - start:
    the tokens after the occurrence, repeated where they reach the end (the module docstring says why).
    skip: tokens that follow `tokens` unseen (sampled on the device): the copy steps over them and
    drafts the positions after them. [] when no suffix recurs."""
    n_tokens = len(tokens)
    max_drafts = min(max_drafts, config.num_speculative_tokens)
    if max_drafts <= 0 or n_tokens < 2:
        return []
    # One pass over the history finds where the last token recurred (the ends of every candidate
    # occurrence, at most the second-to-last position); each suffix length then checks only those.
    ends = np.flatnonzero(tokens[:n_tokens - 1] == tokens[-1])
    for n in range(min(config.prompt_lookup_max, n_tokens - 1), config.prompt_lookup_min - 1, -1):
        cand = ends[ends >= n - 1]
        if not len(cand):
            continue
        windows = tokens[cand[:, None] + np.arange(1 - n, 1)]  # [candidates, n]
        hits = cand[(windows == tokens[n_tokens - n:]).all(axis=1)]
        if len(hits):
            start = int(hits[-1]) + 1  # the tokens after the latest earlier occurrence
            period = n_tokens - start
            return tokens[start + (skip + np.arange(max_drafts)) % period].tolist()
    return []
