"""Tool calls found in free output, for tool_choice "auto" (`jlight serve --enable-auto-tool-choice
--tool-call-parser hermes`, vLLM's flags and parser name).

"hermes": the model writes each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
as the chat templates of Hermes, Qwen2.5 and Qwen3 teach it. Text outside the blocks is the
message's content. A block whose JSON is not a call (bad JSON, no name) stays in the content as
written, so nothing the model wrote is lost; so does a block that max_tokens cut short.

Streaming gives the same content and calls as parsing the whole text (tests check every split
point): content streams as it comes, except a tail that could still open a block; each call goes
out whole once its block closes.
"""
from __future__ import annotations

import json

TOOL_CALL_PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"

Call = tuple[str, str]  # (function name, arguments as JSON text)


def parse_call(block: str) -> Call | None:
    """The call in one block's inner text, or None when it is not one."""
    try:
        obj = json.loads(block)
    except ValueError:
        return None
    if not (isinstance(obj, dict) and isinstance(obj.get("name"), str) and obj["name"]):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))  # some templates say "parameters"
    if isinstance(arguments, str):  # already JSON text
        return obj["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)


def parse(text: str) -> tuple[str | None, list[Call]]:
    """(content, calls) of a whole generated text; content None when only calls were written."""
    stream = HermesStream()
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return _content(content + rest, calls + more), calls + more


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


def _partial_start(text: str) -> int:
    """Length of the longest suffix of text that is a proper prefix of START."""
    for n in range(min(len(text), len(START) - 1), 0, -1):
        if START.startswith(text[-n:]):
            return n
    return 0
