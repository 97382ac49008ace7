"""Turns sampled token ids into text and finish decisions, and builds RequestOutputs.

Stop strings are cut exactly (even when they span tokens), and a streaming client never
sees a partial stop string: the last (longest stop string - 1) characters are held back
until the sequence either moves past them or finishes.
"""
from __future__ import annotations

import logging

import numpy as np

from jlight.engine.outputs import CompletionOutput, RequestOutput
from jlight.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)


class _NoText:
    """Stands in for a detokenizer when the model has no tokenizer (token ids only)."""

    def add(self, token_ids) -> str:
        return ""

    def flush(self) -> str:
        return ""


def make_detokenizer(tokenizer, params):
    if tokenizer is None:
        return _NoText()
    return IncrementalDetokenizer(tokenizer, skip_special_tokens=params.skip_special_tokens)


def append_token(seq, token: int, eos_ids: set[int], max_model_len: int) -> None:
    """Account for one new output token (already in seq.output_token_ids): text and finish reason."""
    p = seq.params
    n_out = len(seq.output_token_ids)
    past_min = n_out >= p.min_tokens
    # On every finish the detokenizer's held-back bytes (a multi-byte character cut off, kept for a next
    # token that will not come) are flushed, as decode gives them (U+FFFD), so text == decode(token_ids).
    if past_min and not p.ignore_eos and token in eos_ids:
        seq.text += seq.detokenizer.flush()
        seq.stop("stop")
        return
    if past_min and token in p.stop_token_ids:
        seq.text += seq.detokenizer.flush()
        seq.stop("stop", token)
        return
    seq.text += seq.detokenizer.add([token])
    at_length = (p.max_tokens is not None and n_out >= p.max_tokens) or len(seq.prompt_token_ids) + n_out >= max_model_len
    if at_length:  # flushed before the stop-string check, which then sees the whole text
        seq.text += seq.detokenizer.flush()
    if p.stop and past_min:
        _check_stop_strings(seq)
        if seq.finish_reason is not None:
            return
    elif p.stop:  # the text before min_tokens is passed over: a stop string must end after it
        seq.stop_checked_len = len(seq.text)
    if at_length:
        seq.stop("length")


def grammar_accepts(seq, token: int) -> bool:
    """Feed a constrained sequence's sampled token to its matcher. False (and the sequence finished with
    "error") when the matcher refuses it: the mask allowed no token at all (a constraint this vocabulary
    cannot spell, e.g. a character none of its tokens can start) or the matcher failed."""
    if seq.matcher.consume_token(token) and not seq.matcher.is_error():
        return True
    logger.warning("request %s: no token satisfies its structured-output constraint (%s); finishing it with "
                   "finish_reason='error'", seq.request_id,
                   (seq.matcher.get_error().strip().splitlines() or [f"token {token} refused"])[0][:300])
    seq.text += seq.detokenizer.flush()
    seq.stop("error")
    return False


def abort(seq) -> None:
    """The request is aborted: flush the text (as at every finish: text == decode(token_ids)) and stop."""
    if seq.detokenizer is not None:
        seq.text += seq.detokenizer.flush()
    seq.stop("abort")


def finish_grammar(seq) -> None:
    """The constraint is complete (only EOS could follow): finish now, saving the EOS step."""
    seq.text += seq.detokenizer.flush()
    seq.stop("stop")


def _check_stop_strings(seq) -> None:
    p = seq.params
    longest = max(len(s) for s in p.stop)
    # Only the tail can hold a stop string that was not there before this token.
    search_from = max(0, seq.stop_checked_len - longest + 1)
    seq.stop_checked_len = len(seq.text)
    best = None
    for s in p.stop:
        i = seq.text.find(s, search_from)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is not None:
        i, s = best
        seq.text = seq.text[: i + len(s)] if p.include_stop_str_in_output else seq.text[:i]
        seq.stop("stop", s)


def logprob_dict(token, token_lp, top_ids, top_lps, num_top: int) -> dict[int, float]:
    d = {int(i): float(v) for i, v in zip(top_ids[:num_top], top_lps[:num_top])}
    d[int(token)] = float(token_lp)
    return d


def record_prompt_logprobs(plan, out) -> None:
    """Store each prompt token's logprob (and top alternatives) for rows that asked for them."""
    target = np.asarray(out.prompt_logprob)
    ids, vals = np.asarray(out.prompt_top_ids), np.asarray(out.prompt_top_logprobs)
    t = 0
    for r in plan.rows:
        seq = r.seq
        k = seq.params.prompt_logprobs
        n_prompt = len(seq.prompt_token_ids)
        if k is not None and r.start < n_prompt:
            if seq.prompt_logprobs is None:
                seq.prompt_logprobs = [None]  # the first prompt token has no logprob
            for j in range(r.num_tokens):
                pos = r.start + j
                if pos + 1 >= n_prompt or len(seq.prompt_logprobs) > pos + 1:
                    continue
                nxt = seq.prompt_token_ids[pos + 1]
                d = {int(a): float(b) for a, b in zip(ids[t + j][:k], vals[t + j][:k])}
                d[nxt] = float(target[t + j])
                seq.prompt_logprobs.append(d)
        t += r.num_tokens


def _visible_end(seq) -> int:
    """How much of seq.text an output may show: all of it once finished or without stop strings, else all but
    the tail a stop string could still start in (never less than what was shown)."""
    if seq.finish_reason is not None or not seq.params.stop:
        return len(seq.text)
    hold = max(len(s) for s in seq.params.stop) - 1
    return max(seq.emitted_text_len, len(seq.text) - hold)


def wants_output(req) -> bool:
    """Whether a step that touched `req` owes it an output: always, but with output_kind "final_only" only once
    it has finished."""
    return req.finished or req.seqs[0].params.output_kind != "final_only"


def make_request_output(req) -> RequestOutput:
    """The request's output now, by its params' output_kind: "cumulative" and "final_only" carry everything so
    far (text, token_ids, logprobs), "delta" only what no output carried before; all carry the new part in
    text_delta / token_ids_delta. A delta output copies only its new part, so a long generation's outputs cost
    O(its length) in all, not O(length^2)."""
    completions = []
    delta_only = req.seqs[0].params.output_kind == "delta"
    for seq in req.seqs:
        end, shown = _visible_end(seq), seq.emitted_token_len
        delta = seq.text[seq.emitted_text_len:end]
        seq.emitted_text_len = end
        ids_delta = seq.output_token_ids[shown:]
        seq.emitted_token_len = len(seq.output_token_ids)
        wants_lp = seq.params.logprobs is not None
        completions.append(CompletionOutput(
            index=seq.index, text=delta if delta_only else seq.text[:end],
            token_ids=ids_delta if delta_only else list(seq.output_token_ids), finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            logprobs=(seq.logprobs[shown:] if delta_only else list(seq.logprobs)) if wants_lp else None,
            cumulative_logprob=seq.cumulative_logprob if wants_lp else None,
            text_delta=delta, token_ids_delta=ids_delta))
    first = req.seqs[0]
    return RequestOutput(
        request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids, outputs=completions,
        finished=req.finished, prompt_logprobs=first.prompt_logprobs, num_cached_tokens=first.num_cached_tokens,
        arrival_time=req.arrival_time, first_token_time=req.first_token_time)
