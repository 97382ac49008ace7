"""`echo` for /v1/completions: the prompt comes back before the completion, and with
`logprobs` so do its tokens' logprobs, as in OpenAI's legacy API and vLLM. Evaluation
harnesses (lm-evaluation-harness's `local-completions`) score log-likelihoods this way.

The engine computes the prompt logprobs (SamplingParams.prompt_logprobs); this module only
lays them out: one entry per prompt token, None for the first one, which nothing predicts.
"""
from __future__ import annotations

import dataclasses

from jlight.engine.outputs import RequestOutput
from jlight.tokenizer import IncrementalDetokenizer


@dataclasses.dataclass
class Echo:
    texts: list[str]  # each prompt's text, in prompt order
    generate: bool = True  # False for max_tokens=0: the prompt alone comes back


def prompt_texts(prompt, token_lists: list[list[int]], tokenizer) -> list[str]:
    """The text echoed for each prompt: a string as it was sent, token ids decoded
    (special tokens kept, as vLLM does, so that every prompt token has text)."""
    items = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    return [item if isinstance(item, str) else tokenizer.decode(ids, skip_special_tokens=False)
            for item, ids in zip(items, token_lists)]


def prompt_pairs(out: RequestOutput) -> list[tuple[int, dict[int, float] | None]]:
    """(prompt token id, {token id: logprob} or None) for every prompt token."""
    entries = out.prompt_logprobs or [None]
    # Only the first prompt token lacks an entry: the engine records all of them before it
    # samples the first token, and outputs only come with sampled tokens.
    assert len(entries) == len(out.prompt_token_ids), (len(entries), len(out.prompt_token_ids))
    return list(zip(out.prompt_token_ids, entries))


def prompt_offsets(tokenizer, ids: list[int], text: str) -> list[int]:
    """Where each prompt token starts in `text`. Tokens advance by the text they decode to
    in context (the incremental detokenizer's pieces, so a character split over tokens is
    counted once), except a special token absent from `text` at that point, such as a BOS
    the tokenizer added to a string prompt: that one takes no room."""
    special = set(getattr(tokenizer, "all_special_ids", ()))
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    offsets, pos = [], 0
    for token_id in ids:
        offsets.append(min(pos, len(text)))
        piece = detokenizer.add([token_id])
        if token_id in special and not text.startswith(piece, pos):
            continue
        pos += len(piece)
    return offsets
