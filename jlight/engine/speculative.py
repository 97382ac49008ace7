"""Speculative decoding: the configuration, and reading a verified row.

A speculating sequence carries k draft tokens from its proposer (jlight/engine/proposers/: n-gram
prompt lookup on the host, or a draft model / EAGLE head / DeepSeek MTP layer run on the device);
its row in the next step computes k + 1 tokens (its last sampled token, then the drafts) and the
sampler draws a token at each of those k + 1 positions (sampler.sample, with `draft_tokens`). Draft
i + 1 stands at position i + 1 and is kept while every draft before it was kept and the sampler
accepted it at position i; the first position that rejects gives the sequence the sampler's token
there instead, and a row that keeps all k drafts also gets the token sampled after the last one. So
a verified row adds 1 to k + 1 tokens, and its output follows the target model's distribution
exactly (greedy: token for token). Every proposer drafts greedily: a draft is a function of the
tokens before it (a point-mass proposal), the case the sampler's acceptance rule is exact for.

Drafting ahead (a host proposer with `Proposer.drafts_ahead`, where EngineConfig.draft_ahead allows:
GPUs by default): the next step is launched before the step in flight is read back, as plain decoding
is (llm_engine.py). A sequence whose row in flight samples its next token gets a row in the next step
that assumes that row keeps every draft: its first token is the one sampled after the last draft
(taken from the device, as a plain decode row's is), its drafts are the proposer's continuation of
the known tokens, the drafts in flight and that token (`drafts_after`). When the row in flight keeps
every draft, the row ahead stands where a serial schedule would have put it; only its drafts may
differ, and the sampler's token at a position does not depend on the draft there (sampler.py), so
the output is the same. When it rejects one, the row ahead stands at the wrong positions: the
engine discards it (its sampled tokens are never read, its K/V lie past num_computed_tokens). A
rejection costs that row; so a sequence drafts ahead of a verify row only while its latest verify
row read back kept every draft, and otherwise waits for the step in flight as below.

Invariants the engine keeps for a speculating sequence (llm_engine.py, scheduler.py):
- it is scheduled when the host knows all its tokens, or ahead of exactly one row in flight by a
  proposer that drafts ahead (above), so the proposer's drafts follow the latest token or its place;
- the K/V its row wrote past the kept tokens (rejected drafts) lie beyond num_computed_tokens
  once the row is read back, so no attention reads them and the next step writes over them;
  no page holding them is published to the prefix cache; a device proposer's own K/V pool holds
  the same pages and keeps to the same rule (proposers/device.py);
- penalties and structured outputs turn speculation off for a sequence (their per-position state
  would need the drafts), and so does a running batch larger than `disable_by_batch_size`; drafts
  only follow a finished prefill, so prompt logprobs are untouched.
"""
from __future__ import annotations

import dataclasses

import numpy as np

# Methods by vLLM's names; "mtp" is "deepseek_mtp" (the one MTP family jlight runs).
METHODS = ("ngram", "draft_model", "eagle", "eagle3", "deepseek_mtp", "mtp")
# Methods that run a model of their own and so need speculative_config.model (deepseek_mtp reads
# the target's checkpoint when it is not given).
MODEL_METHODS = ("draft_model", "eagle", "eagle3")


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` names: `method` ("ngram": prompt lookup, matched on the last
    prompt_lookup_max .. prompt_lookup_min tokens; "draft_model": a smaller model of the same vocabulary
    at `model`) and num_speculative_tokens drafts a step."""
    method: str = "ngram"
    model: str | None = None  # the draft model's (or head's) directory
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    # Speculation pauses while more sequences than this run: a verify step costs more than it saves
    # once the batch keeps the weights' reads busy. Every step's sampled rows are compiled with room for
    # this many sequences' drafts. The default is where n-gram speculation still paid on an H100 with most
    # drafts kept (spec_decode.py --sections batch: 1.3x at 32 sequences, 1.08x at 64; docs/BENCHMARKS.md);
    # fewer kept drafts bring the crossing lower.
    disable_by_batch_size: int = 32

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
        if self.model is not None and not isinstance(self.model, str):
            bad("model", "must be a path string")
        if self.method in MODEL_METHODS and not self.model:
            raise ValueError(f"speculative_config.model is missing: method {self.method!r} runs a model of its own; "
                             f"give its directory, e.g. {{'method': {self.method!r}, 'model': 'path/to/draft', "
                             f"'num_speculative_tokens': {self.num_speculative_tokens}}}")
        if self.method == "ngram" and self.model is not None:
            bad("model", "is not used by method 'ngram' (prompt lookup runs no model); drop it, or pick "
                "method 'draft_model'")
        return self


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
