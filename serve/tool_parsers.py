"""Tool calls found in free output, for tool_choice "auto" (`jlight serve --enable-auto-tool-choice
--tool-call-parser NAME`, vLLM's flags and parser names).

- "hermes": the model writes each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  as the chat templates of Hermes, Qwen2.5 and Qwen3 teach it. Text outside the blocks is the
  message's content. A block whose JSON is not a call (bad JSON, no name) stays in the content as
  written, so nothing the model wrote is lost; so does a block that max_tokens cut short.
- "llama3_json": Llama 3.1-3.3's JSON tool calling. An answer that opens with `{` (or Llama's
  `<|python_tag|>`) is calls, `{"name": ..., "parameters": {...}}` objects separated by `;`;
  any other answer is content. Calls that do not parse whole come back as content.
- "mistral": Mistral's JSON tool calls (tokenizer v3, e.g. Mistral-7B-Instruct-v0.3): an answer that
  opens with `[` (or `[TOOL_CALLS]`) is a JSON array of `{"name", "arguments"}` objects. The later
  `[TOOL_CALLS]name[ARGS]{...}` form (tokenizer v11+) is not read: such an answer stays content.

Streaming gives the same content and calls as parsing the whole text (tests check every split
point): content streams as it comes, except what could still turn out to be a call; each call
goes out whole, hermes's once its block closes, the others' at the end.
"""
from __future__ import annotations

import functools
import json
from typing import Callable

START, END = "<tool_call>", "</tool_call>"  # hermes
PYTHON_TAG = "<|python_tag|>"  # llama3_json: Llama's token before a call (the text has it only with special tokens)
TOOL_CALLS_TAG = "[TOOL_CALLS]"  # mistral's, likewise

Call = tuple[str, str]  # (function name, arguments as JSON text)


def parse_call(block: str) -> Call | None:
    """The call in one block's inner text, or None when it is not one."""
    try:
        return call_of(json.loads(block))
    except ValueError:
        return None


def call_of(obj, need_arguments: bool = False) -> Call | None:
    """The call a decoded JSON value states, or None when it is not one. need_arguments: only an object
    that names its arguments is a call (else a JSON answer about someone's "name" would be one)."""
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]):
        return None
    if need_arguments and not ("arguments" in obj or "parameters" in obj):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))  # some templates say "parameters"
    if isinstance(arguments, str):  # already JSON text
        return obj["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def parse(text: str, parser: str = "hermes") -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole generated text; content None when only calls were written."""
    stream = new_stream(parser)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return _content(content + rest, calls + more), calls + more


def new_stream(parser: str):
    """A choice's stream state for `parser` (a TOOL_CALL_PARSERS name)."""
    return TOOL_CALL_PARSERS[parser]()


def _content(text: str, calls: list[Call]) -> str | None:
    """The message content: None when the text was calls and whitespace between them."""
    return None if calls and not text.strip() else text


class HermesStream:
    """One choice's stream: feed() each text delta, finish() at the end. Each returns (content delta,
    calls completed by it)."""

    def __init__(self):
        self.pending = ""  # text not yet given out: a possible start of a block, or an open block
        self.in_block = False
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[Call]]:
        self.pending += delta
        content, calls = [], []
        while True:
            if self.in_block:
                end = self.pending.find(END, len(START))
                if end < 0:
                    break
                block, self.pending = self.pending[:end + len(END)], self.pending[end + len(END):]
                self.in_block = False
                call = parse_call(block[len(START):-len(END)])
                if call is None:
                    content.append(block)
                else:
                    calls.append(call)
                continue
            start = self.pending.find(START)
            if start >= 0:
                content.append(self.pending[:start])
                self.pending, self.in_block = self.pending[start:], True
                continue
            keep = _partial_start(self.pending)  # the tail that may yet become "<tool_call>"
            content.append(self.pending[:len(self.pending) - keep])
            self.pending = self.pending[len(self.pending) - keep:]
            break
        self.num_calls += len(calls)
        return "".join(content), calls

    def finish(self) -> tuple[str, list[Call]]:
        """Whatever is left is content: a possible start that never came, or an unclosed block."""
        rest, self.pending, self.in_block = self.pending, "", False
        return rest, []


class JsonAnswerStream:
    """A stream for formats whose calls are the whole answer (llama3_json, mistral): undecided until the
    first visible character; then either content, passed on as it comes, or calls, held to the end and
    parsed whole. tag: what may come first; opens: what starts calls; parse_calls: the body (tag cut)
    -> its calls, or None when it is not calls."""

    def __init__(self, tag: str, opens: tuple[str, ...], parse_calls: Callable[[str], list[Call] | None]):
        self.tag, self.opens, self.parse_calls = tag, opens, parse_calls
        self.pending = ""
        self.mode = None  # None: undecided; "text"; "calls"
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[Call]]:
        if self.mode == "text":
            return delta, []
        self.pending += delta
        if self.mode is None:
            head = self.pending.lstrip()
            if not head or (self.tag.startswith(head) and head != self.tag):
                return "", []  # whitespace, or maybe the start of the tag: wait
            if head.startswith((self.tag, *self.opens)):
                self.mode = "calls"
            else:
                self.mode, text, self.pending = "text", self.pending, ""
                return text, []
        return "", []

    def finish(self) -> tuple[str, list[Call]]:
        text, self.pending = self.pending, ""
        body = text.strip()
        calls = self.parse_calls(body[len(self.tag):] if body.startswith(self.tag) else body) if self.mode == "calls" else None
        if not calls:  # undecided (only whitespace), or calls that do not parse: content
            return text, []
        self.num_calls += len(calls)
        return "", calls


def llama3_calls(body: str) -> list[Call] | None:
    """Llama 3.1-3.3: `{"name", "parameters"}` objects separated by `;` (after <|python_tag|>, if any)."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(body) and (body[i].isspace() or (calls and body[i] == ";")):
            i += 1
        if i == len(body):
            return calls
        try:
            obj, i = decoder.raw_decode(body, i)
        except ValueError:
            return None
        call = call_of(obj, need_arguments=True)  # no tag around it: the arguments key marks a call
        if call is None:
            return None
        calls.append(call)


def mistral_calls(body: str) -> list[Call] | None:
    """Mistral's JSON tool calls: a JSON array of `{"name", "arguments"}` objects (after `[TOOL_CALLS]`, a
    special token and so often absent from the text)."""
    try:
        items = json.loads(body)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    calls = [call_of(item, need_arguments=True) for item in items]
    return None if None in calls else calls


TOOL_CALL_PARSERS = {  # name -> a new stream
    "hermes": HermesStream,
    "llama3_json": functools.partial(JsonAnswerStream, PYTHON_TAG, ("{",), llama3_calls),
    "mistral": functools.partial(JsonAnswerStream, TOOL_CALLS_TAG, ("[",), mistral_calls),
}


def _partial_start(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of START."""
    for n in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0
