"""Speculative decoding: the configuration, the n-gram proposer, and reading a verified row.

A speculating sequence proposes k draft tokens on the host; its row in the next step computes
k + 1 tokens (its last sampled token, then the drafts) and the sampler draws a token at each of
those k + 1 positions (sampler.sample, with `draft_tokens`). Draft i + 1 stands at position i + 1
and is kept while every draft before it was kept and the sampler accepted it at position i; the
first position that rejects gives the sequence the sampler's token there instead, and a row
that keeps all k drafts also gets the token sampled after the last one. So a verified row adds
1 to k + 1 tokens, and its output follows the target model's distribution exactly (greedy:
token for token).

Invariants the engine keeps for a speculating sequence (llm_engine.py, scheduler.py):
- it is scheduled only when the host knows all its tokens (no token pending on the device), so
  the proposer sees the latest one;
- the K/V its row wrote past the kept tokens (rejected drafts) lie beyond num_computed_tokens
  once the row is read back, so no attention reads them and the next step writes over them;
  no page holding them is published to the prefix cache;
- penalties and structured outputs turn speculation off for a sequence (their per-position state
  would need the drafts), and so does a running batch larger than `disable_by_batch_size`; drafts
  only follow a finished prefill, so prompt logprobs are untouched.
"""
from __future__ import annotations

import dataclasses

import numpy as np

METHODS = ("ngram",)


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` names: method "ngram" (prompt lookup) with num_speculative_tokens
    drafts a step, matched on the last prompt_lookup_max .. prompt_lookup_min tokens."""
    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # Speculation pauses while more sequences than this run: a verify step costs more than it saves
    # once the batch keeps the weights' reads busy (and its extra sampled rows are compiled for this many).
    disable_by_batch_size: int = 8

    @classmethod
    def from_dict(cls, config: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        if config is None or isinstance(config, SpeculativeConfig):
            return config.validate() if config is not None else None
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', 'num_speculative_tokens': 4}}, "
                             f"got {type(config).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**config).validate()

    def validate(self) -> "SpeculativeConfig":
        def bad(field, why):
            raise ValueError(f"speculative_config.{field}={getattr(self, field)!r} {why}")

        if self.method not in METHODS:
            bad("method", f"is not supported; supported: {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "disable_by_batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                bad(name, "must be an integer >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            bad("prompt_lookup_min", f"must be <= prompt_lookup_max ({self.prompt_lookup_max})")
        return self


def propose_ngram(tokens: np.ndarray, config: SpeculativeConfig, max_drafts: int) -> list[int]:
    """Prompt lookup: the longest suffix of `tokens` (prompt_lookup_max down to prompt_lookup_min
    tokens) that occurred earlier in them, and the tokens that followed its latest earlier
    occurrence, at most max_drafts of them. [] when no suffix recurs."""
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
            return tokens[start:start + max_drafts].tolist()
    return []


def kept_tokens(drafts: list[int], sampled: np.ndarray, accepted: np.ndarray) -> list[int]:
    """The tokens a verified row adds: drafts[i] while sampled position i accepted it, then the token
    sampled at the first position that did not (or after the last draft).

    sampled, accepted: the row's k + 1 sampled positions (token ids, and whether each accepted the
    draft that follows it; the last position has no draft)."""
    out = []
    for i, draft in enumerate(drafts):
        if not accepted[i]:
            break
        out.append(int(draft))
    out.append(int(sampled[len(out)]))
    return out
