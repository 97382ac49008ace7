"""RequestOutputs -> OpenAI response bodies and SSE stream chunks, for both endpoints.

Choice numbering: a completions request with P prompts and n samples has P*n choices,
choice `prompt_index * n + sample_index`.
"""
from __future__ import annotations

import json
import time

from jlight.engine.outputs import CompletionOutput, RequestOutput
from jlight.serve.protocol import (ChatChoice, ChatCompletionResponse, ChatDeltaChoice, ChatLogprobs,
                                   ChatResponseMessage, ChatTokenLogprob, CompletionChoice,
                                   CompletionLogprobs, CompletionResponse, TopLogprob, usage_of)

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class TokenText:
    """Token id -> its text and its bytes, cached (logprobs need them for every token)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache, self.bytes_cache = tokenizer, {}, {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: for part of a multi-byte character its text is U+FFFD."""
        raw = self.bytes_cache.get(token_id)
        if raw is None:
            raw = self.bytes_cache[token_id] = list(self.tokenizer.token_bytes(token_id))
        return raw


def _new_logprobs(c: CompletionOutput, start: int) -> list[tuple[int, dict[int, float]]]:
    """(sampled token id, {token id: logprob}) for generated tokens start.. of this output."""
    if not c.logprobs:
        return []
    if len(c.logprobs) == len(c.token_ids):  # cumulative list
        entries = c.logprobs[start:]
    else:  # only the newest tokens'
        entries = c.logprobs[-len(c.token_ids_delta):] if c.token_ids_delta else []
    ids = c.token_ids[len(c.token_ids) - len(entries):]
    return list(zip(ids, entries))


class ResponseBuilder:
    """Builds one HTTP request's bodies; keeps per-choice state across stream chunks."""

    def __init__(self, kind: str, request_id: str, model: str, tokenizer, n: int, want_logprobs: bool,
                 num_top_logprobs: int = 0):
        self.kind, self.id, self.model, self.n = kind, request_id, model, n
        self.want_logprobs, self.num_top = want_logprobs, num_top_logprobs
        self.token_text = TokenText(tokenizer)
        self.created = int(time.time())
        self.tokens_sent: dict[int, int] = {}  # choice index -> tokens already streamed
        self.text_offset: dict[int, int] = {}  # choice index -> characters already streamed
        # The engine repeats a finished sample in later outputs while its siblings (n > 1) run on.
        self.finish_sent: set[int] = set()

    # ---- logprobs in the two OpenAI shapes ----

    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: -kv[1])[:self.num_top]

    def completion_logprobs(self, pairs, offset: int) -> CompletionLogprobs:
        lp = CompletionLogprobs()
        for token_id, entry in pairs:
            text = self.token_text(token_id)
            lp.tokens.append(text)
            lp.token_logprobs.append(entry.get(token_id))
            lp.top_logprobs.append({self.token_text(t): v for t, v in self._top(entry)} if self.num_top else None)
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    def chat_logprobs(self, pairs) -> ChatLogprobs:
        def item(t, v, cls=TopLogprob, **kw):
            return cls(token=self.token_text(t), logprob=v, bytes=self.token_text.bytes(t), **kw)
        return ChatLogprobs(content=[
            item(token_id, entry.get(token_id, float("-inf")), ChatTokenLogprob,
                 top_logprobs=[item(t, v) for t, v in self._top(entry)])
            for token_id, entry in pairs])

    # ---- whole responses ----

    def full_response(self, finals: list[RequestOutput]) -> dict:
        """`finals[i]` is prompt i's last RequestOutput."""
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
        completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
        usage = usage_of(prompt_tokens, completion_tokens)
        choices = []
        for p, out in enumerate(finals):
            for c in sorted(out.outputs, key=lambda c: c.index):
                index = p * self.n + c.index
                pairs = _new_logprobs(c, 0) if self.want_logprobs else []
                reason = c.finish_reason  # "abort" only reaches a client when the server shuts down under it
                if self.kind == "chat":
                    choices.append(ChatChoice(index=index, message=ChatResponseMessage(content=c.text),
                                              logprobs=self.chat_logprobs(pairs) if self.want_logprobs else None,
                                              finish_reason=reason))
                else:
                    choices.append(CompletionChoice(index=index, text=c.text, finish_reason=reason,
                                                    logprobs=self.completion_logprobs(pairs, 0) if self.want_logprobs else None))
        cls = ChatCompletionResponse if self.kind == "chat" else CompletionResponse
        return cls(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage).model_dump()

    # ---- streaming ----

    def _chunk(self, choices: list[dict], usage=None) -> str:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            body["usage"] = usage.model_dump()
        return sse(body)

    def role_chunks(self, num_prompts: int) -> list[str]:
        """Chat streams open each choice with an empty assistant delta, as OpenAI does."""
        if self.kind != "chat":
            return []
        return [self._chunk([ChatDeltaChoice(index=i, delta=ChatResponseMessage(role="assistant", content="")).model_dump()])
                for i in range(num_prompts * self.n)]

    def stream_chunks(self, prompt_index: int, out: RequestOutput) -> list[str]:
        chunks = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            if not (c.text_delta or c.token_ids_delta or c.finished):
                continue
            index = prompt_index * self.n + c.index
            if index in self.finish_sent:
                continue
            if c.finished:
                self.finish_sent.add(index)
            start = self.tokens_sent.get(index, 0)
            pairs = _new_logprobs(c, start) if self.want_logprobs else []
            self.tokens_sent[index] = len(c.token_ids)
            reason = c.finish_reason  # "abort" only reaches a client when the server shuts down under it
            if self.kind == "chat":
                choice = ChatDeltaChoice(index=index, delta=ChatResponseMessage(role=None, content=c.text_delta),
                                         logprobs=self.chat_logprobs(pairs) if self.want_logprobs else None,
                                         finish_reason=reason).model_dump()
                choice["delta"] = {"content": c.text_delta}  # later deltas carry no role
            else:
                offset = self.text_offset.get(index, 0)
                choice = CompletionChoice(index=index, text=c.text_delta, finish_reason=reason,
                                          logprobs=self.completion_logprobs(pairs, offset) if self.want_logprobs else None).model_dump()
                self.text_offset[index] = offset + len(c.text_delta)
            chunks.append(self._chunk([choice]))
        return chunks

    def usage_chunk(self, finals: list[RequestOutput]) -> str:
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
        completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
        return self._chunk([], usage=usage_of(prompt_tokens, completion_tokens))
