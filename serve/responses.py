"""RequestOutputs -> OpenAI response bodies and SSE stream chunks, for both endpoints.

Choice numbering: a completions request with P prompts and n samples has P*n choices,
choice `prompt_index * n + sample_index`.

A stream's chunks are rendered one at a time, as the previous one is sent, and none carries more
than `piece_tokens` tokens' logprobs: a delta merged while the client read slowly goes out as
logprobs-only pieces, then its text and finish_reason. So a stream whose client stops reading holds
one small rendered chunk, besides its unsent tokens (packed, in AsyncLLM's mailbox).

Token texts and bytes (logprobs name every token they list) are cached in one TokenText per server,
shared by every request (serve/handlers.py): its size is bounded by the vocabulary, once. A cache per
request grows with the distinct tokens that request has rendered, and a stream keeps its cache while
its client does not read: with a 128k vocabulary and top_logprobs=20, one n=8 stream of 500 tokens
renders ~60k distinct tokens, ~16 MB of cache, and a dozen silent readers would hold that many times over.
"""
from __future__ import annotations

import dataclasses
import json
import threading
import time
from typing import Iterator, Sequence

from jlight.engine.outputs import CompletionOutput, PackedLogprobs, RequestOutput
from jlight.serve import tool_parsers
from jlight.serve.echo import Echo, prompt_offsets, prompt_pairs
from jlight.serve.tool_calls import ForcedToolCall, choice_fields, parsed_choice_fields, tool_call
from jlight.serve.response_models import (ChatChoice, ChatCompletionResponse, ChatDeltaChoice, ChatLogprobs,
                                          ChatResponseMessage, ChatTokenLogprob, CompletionChoice,
                                          CompletionLogprobs, CompletionResponse, TopLogprob, usage_of)

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class TokenText:
    """Token id -> its text and its bytes, cached (logprobs need them for every token). Shared by the
    requests of a server, from the event loop and the host workers. Two lists indexed by token id hold
    them (about 100 bytes a token once cached: a dict of int keys took 170, and grew in jumps as it resized),
    sized to the vocabulary up front where the tokenizer says it; an id past the end grows both under a lock.
    A list's get and set are atomic, and two threads that miss the same token at once store the same value."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        size = getattr(tokenizer, "vocab_size", 0)
        size = size if isinstance(size, int) else 0
        self._texts: list[str | None] = [None] * size
        self._raw: list[bytes | None] = [None] * size
        self._grow = threading.Lock()

    def __len__(self) -> int:
        """Tokens whose text is cached."""
        return len(self._texts) - self._texts.count(None)

    def _reach(self, token_id: int) -> None:
        if token_id >= len(self._texts):
            with self._grow:
                more = token_id + 1 - len(self._texts)
                if more > 0:
                    self._texts.extend([None] * more)
                    self._raw.extend([None] * more)

    def __call__(self, token_id: int) -> str:
        self._reach(token_id)
        text = self._texts[token_id]
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes: for part of a multi-byte character its text is U+FFFD. Cached as a
        bytes object (a list of ints takes twice the memory); each call gives a fresh list."""
        self._reach(token_id)
        raw = self._raw[token_id]
        if raw is None:
            raw = self._raw[token_id] = bytes(self.tokenizer.token_bytes(token_id))
        return list(raw)


def _logprob_tokens(c: CompletionOutput) -> tuple[list[int], Sequence[dict[int, float]]]:
    """(token ids, their {token id: logprob} entries): `c.logprobs` covers the last len(c.logprobs) of
    c.token_ids (every token in a whole response's output, the new ones in a stream's)."""
    if not c.logprobs:
        return [], []
    return c.token_ids[len(c.token_ids) - len(c.logprobs):], c.logprobs


class ResponseBuilder:
    """Builds one HTTP request's bodies; keeps per-choice state across stream chunks."""

    def __init__(self, kind: str, request_id: str, model: str, tokenizer, n: int, want_logprobs: bool,
                 num_top_logprobs: int = 0, echo: Echo | None = None, forced_tool_call: ForcedToolCall | None = None,
                 tool_parser: str | None = None, piece_tokens: int = 16, token_text: TokenText | None = None):
        self.kind, self.id, self.model, self.n = kind, request_id, model, n
        self.piece_tokens = piece_tokens  # the most tokens' logprobs one stream chunk carries
        self.forced = forced_tool_call  # a chat request's forced tool call: its output is the call's JSON
        # tool_choice "auto" on a server with a parser: calls are found in the free text (serve/tool_parsers.py)
        self.tool_parser = tool_parser
        self.tool_streams: dict = {}  # choice index -> its parser's stream state
        self.want_logprobs, self.num_top = want_logprobs, num_top_logprobs
        self.echo = echo
        # the server's shared cache (see the module's docstring); a builder of its own without one
        self.tokenizer, self.token_text = tokenizer, token_text if token_text is not None else TokenText(tokenizer)
        self.created = int(time.time())
        # choice index -> (token ids, logprobs) taken from the stream but not sent yet (held back)
        self.unsent_logprobs: dict[int, tuple[list[int], PackedLogprobs]] = {}
        self.text_offset: dict[int, int] = {}  # choice index -> characters already streamed
        # The engine repeats a finished sample in later outputs while its siblings (n > 1) run on.
        self.finish_sent: set[int] = set()
        # choice index -> a "required" forced call's text so far (its calls go out once it is complete)
        self.required_text: dict[int, str] = {}

    # ---- logprobs in the two OpenAI shapes ----

    def _top(self, entry: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda kv: -kv[1])[:self.num_top]

    def completion_logprobs(self, pairs, offset: int, lp: CompletionLogprobs | None = None) -> CompletionLogprobs:
        """Appends `pairs` to `lp` (a new one by default), their text starting at `offset`. An entry of
        None (an echoed prompt's first token, which nothing predicts) gets null logprobs."""
        lp = CompletionLogprobs() if lp is None else lp
        for token_id, entry in pairs:
            text = self.token_text(token_id)
            lp.tokens.append(text)
            lp.token_logprobs.append(None if entry is None else entry.get(token_id))
            lp.top_logprobs.append({self.token_text(t): v for t, v in self._top(entry)}
                                   if self.num_top and entry is not None else None)
            lp.text_offset.append(offset)
            offset += len(text)
        return lp

    def echoed_prompt(self, prompt_index: int, out: RequestOutput) -> tuple[str, CompletionLogprobs | None]:
        """The prompt's text and, with logprobs, its tokens' logprobs (None for the first token:
        nothing predicts it)."""
        text = self.echo.texts[prompt_index]
        if not self.want_logprobs:
            return text, None
        lp = CompletionLogprobs()
        offsets = prompt_offsets(self.tokenizer, out.prompt_token_ids, text)
        for pair, offset in zip(prompt_pairs(out), offsets):  # each at its own offset (tokens may take no room)
            self.completion_logprobs([pair], offset, lp)
        return text, lp

    def completion_choice(self, index: int, prompt_index: int, out: RequestOutput, c: CompletionOutput,
                          text: str, pairs, offset: int, first: bool, final: bool = True) -> CompletionChoice:
        """One choice's text and logprobs from `offset` on; the echoed prompt goes before them
        in a choice's `first` body (the whole response, or its first stream chunk). Only a `final`
        one (not a stream's logprobs-only piece) carries the finish_reason."""
        # "abort" only reaches a client when the server shuts down under it
        reason = c.finish_reason if final else None
        if self.echo is not None and not self.echo.generate:  # max_tokens=0: the one token run is not shown
            text, pairs, reason = "", [], "length" if reason else None
        lp = None
        if self.echo is not None and first:
            prompt_text, lp = self.echoed_prompt(prompt_index, out)
            text, offset = prompt_text + text, offset + len(prompt_text)
        if self.want_logprobs:
            lp = self.completion_logprobs(pairs, offset, lp)
        return CompletionChoice(index=index, text=text, finish_reason=reason, logprobs=lp)

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
        usage = self._usage(finals)
        choices = []
        for p, out in enumerate(finals):
            for c in sorted(out.outputs, key=lambda c: c.index):
                index = p * self.n + c.index
                pairs = list(zip(*_logprob_tokens(c))) if self.want_logprobs else []
                reason = c.finish_reason  # "abort" only reaches a client when the server shuts down under it
                if self.kind == "chat":
                    fields = {"content": c.text}
                    if self.forced is not None:
                        fields, reason = choice_fields(self.forced, c.text, reason)
                    elif self.tool_parser is not None:
                        fields, reason = parsed_choice_fields(c.text, reason, self.tool_parser)
                    choices.append(ChatChoice(index=index, message=ChatResponseMessage(**fields),
                                              logprobs=self.chat_logprobs(pairs) if self.want_logprobs else None,
                                              finish_reason=reason))
                else:
                    choices.append(self.completion_choice(index, p, out, c, c.text, pairs, 0, first=True))
        cls = ChatCompletionResponse if self.kind == "chat" else CompletionResponse
        body = cls(id=self.id, created=self.created, model=self.model, choices=choices, usage=usage,
                   kv_transfer_params=finals[0].kv_transfer_params if len(finals) == 1 else None).model_dump()
        if body["kv_transfer_params"] is None:  # only a prefill server's handoff carries the field
            del body["kv_transfer_params"]
        return body

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
        chunks = []
        for i in range(num_prompts * self.n):
            choice = ChatDeltaChoice(index=i, delta=ChatResponseMessage(role="assistant", content="")).model_dump()
            choice["delta"] = {"role": "assistant", "content": ""}
            if self.forced is not None:
                # A named call opens at once (id, name, empty arguments) and its arguments stream on.
                choice["delta"] = {"role": "assistant", "content": None}
                if self.forced.named:
                    choice["delta"]["tool_calls"] = [tool_call(self.forced.function_name, "", index=0)]
            chunks.append(self._chunk([choice]))
        return chunks

    def stream_chunks(self, prompt_index: int, out: RequestOutput) -> Iterator[str]:
        """The chunks for one stream output (`out.outputs[i].logprobs`: the new tokens' only), each
        rendered when the one before has been taken."""
        for c in sorted(out.outputs, key=lambda c: c.index):
            if not (c.text_delta or c.token_ids_delta or c.finished):
                continue
            index = prompt_index * self.n + c.index
            if index in self.finish_sent:
                continue
            if self.want_logprobs:
                ids, entries = _logprob_tokens(c)
                held = self.unsent_logprobs.setdefault(index, ([], PackedLogprobs()))
                held[0].extend(ids)
                held[1].extend(entries)
            parsed = self._parsed_delta(index, c) if self.tool_parser is not None and self.kind == "chat" else None
            if parsed is not None and not (parsed[0] or c.finished):
                continue  # held back: maybe the start of a call; its tokens' logprobs go out with what follows
            if self.forced is not None and not self.forced.named:
                # "required"'s array can only be split into calls once complete: its calls go out with
                # the finish chunk (and any logprobs then cover every token, all held until then).
                self.required_text[index] = self.required_text.get(index, "") + c.text_delta
                if not c.finished:
                    continue
                c = dataclasses.replace(c, text=self.required_text.pop(index))
            if c.finished:
                self.finish_sent.add(index)
            ids, entries = self.unsent_logprobs.pop(index, ([], ()))
            starts = list(range(0, len(ids), self.piece_tokens)) or [0]
            consumed = 0  # characters of the pieces' tokens sent before the text (completions' text_offset)
            for start in starts[:-1]:
                pairs = list(zip(ids[start:start + self.piece_tokens], entries[start:start + self.piece_tokens]))
                yield self._choice_chunk(prompt_index, out, c, index, "", pairs, consumed, None, final=False)
                consumed += sum(len(self.token_text(t)) for t, _ in pairs)
            pairs = list(zip(ids[starts[-1]:], entries[starts[-1]:]))
            yield self._choice_chunk(prompt_index, out, c, index, c.text_delta, pairs, consumed, parsed, final=True)

    def _choice_chunk(self, prompt_index: int, out: RequestOutput, c: CompletionOutput, index: int, text: str,
                      pairs, consumed: int, parsed, final: bool) -> str:
        """One stream chunk of choice `index`: `text` and `pairs`' logprobs, and with `final` the
        delta's tool calls and its finish_reason."""
        reason = c.finish_reason if final else None  # "abort" only reaches a client when the server shuts down under it
        if self.kind == "chat":
            choice = ChatDeltaChoice(index=index, delta=ChatResponseMessage(role=None, content=text),
                                     logprobs=self.chat_logprobs(pairs) if self.want_logprobs else None,
                                     finish_reason=reason).model_dump()
            choice["delta"] = {"content": text}  # later deltas carry no role
            if not final:
                if self.forced is not None or parsed is not None:
                    choice["delta"] = {}
            elif self.forced is not None:
                choice["delta"], choice["finish_reason"] = self._tool_delta(c, reason)
            elif parsed is not None:
                choice["delta"], choice["finish_reason"] = parsed
        else:
            first = index not in self.text_offset
            choice = self.completion_choice(index, prompt_index, out, c, text, pairs,
                                            self.text_offset.get(index, 0) + consumed, first, final).model_dump()
            self.text_offset[index] = self.text_offset.get(index, 0) + len(choice["text"])
        return self._chunk([choice])

    def _parsed_delta(self, index: int, c: CompletionOutput) -> tuple[dict, str | None]:
        """A chat delta under tool_choice "auto": the content that is surely not a call, each call whose
        block closed (whole), and the finish_reason ("tool_calls" for "stop" once a call was made). The
        delta is empty while the parser holds text back."""
        if index not in self.tool_streams:
            self.tool_streams[index] = tool_parsers.new_stream(self.tool_parser)
        stream = self.tool_streams[index]
        content, calls = stream.feed(c.text_delta)
        if c.finished:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
        delta: dict = {}
        if content or (c.finished and not calls):
            delta["content"] = content
        if calls:
            first = stream.num_calls - len(calls)
            delta["tool_calls"] = [tool_call(name, arguments, index=first + k) for k, (name, arguments) in enumerate(calls)]
        reason = c.finish_reason
        return delta, "tool_calls" if reason == "stop" and stream.num_calls else reason

    def _tool_delta(self, c: CompletionOutput, reason: str | None) -> tuple[dict, str | None]:
        """A forced call's stream delta: a named call's argument text, or "required"'s calls once finished."""
        if self.forced.named:  # its finish_reason is the engine's (choice_fields)
            return {"tool_calls": [{"index": 0, "function": {"arguments": c.text_delta}}]}, reason
        fields, reason = choice_fields(self.forced, c.text, reason)
        if not fields["tool_calls"]:
            return {"content": fields["content"]}, reason
        return {"tool_calls": [{"index": i, **call} for i, call in enumerate(fields["tool_calls"])]}, reason

    def _usage(self, finals: list[RequestOutput]):
        prompt_tokens = sum(len(o.prompt_token_ids) for o in finals)
        completion_tokens = sum(len(c.token_ids) for o in finals for c in o.outputs)
        if self.echo is not None and not self.echo.generate:
            completion_tokens = 0  # max_tokens=0: the token the engine ran is not returned
        return usage_of(prompt_tokens, completion_tokens)

    def usage_chunk(self, finals: list[RequestOutput]) -> str:
        return self._chunk([], usage=self._usage(finals))
