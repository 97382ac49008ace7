"""The hermes tool-call parser (serve/tool_parsers.py): whole texts, and streams split anywhere."""
import json

import pytest

from jlight.serve import tool_parsers
from jlight.serve.tool_parsers import HermesStream, parse

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
TEXTS = [
    "plain text, no calls at all",
    CALL,
    "Let me look that up.\n" + CALL,
    CALL + "\n" + CALL.replace("get_weather", "get_time").replace('{"city": "Paris", "days": 2}', "{}"),
    "a < b and <tool_ is not a tag" + CALL + " after",
    '<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>',  # arguments given as JSON text
    '<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>',  # "parameters", as some templates say
    "<tool_call>{not json}</tool_call> then " + CALL,  # a bad block stays in the content
    '<tool_call>{"arguments": {}}</tool_call>',  # no name: not a call
    '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',  # arguments not an object
    "cut short: " + CALL[:40],  # max_tokens inside a block: its text is content
    "ends with a possible start <tool_c",
    "<tool_call><tool_call>" + CALL[len("<tool_call>"):],  # a block opened twice: the JSON is not a call
]


def test_whole_texts():
    assert parse(TEXTS[0]) == (TEXTS[0], [])
    assert parse(CALL) == (None, [("get_weather", '{"city": "Paris", "days": 2}')])
    assert parse(TEXTS[2]) == ("Let me look that up.\n", [("get_weather", '{"city": "Paris", "days": 2}')])
    content, calls = parse(TEXTS[3])
    assert content is None and [name for name, _ in calls] == ["get_weather", "get_time"]
    assert parse(TEXTS[4]) == ("a < b and <tool_ is not a tag after", [("get_weather", '{"city": "Paris", "days": 2}')])
    assert parse(TEXTS[5]) == (None, [("f", '{"x": 1}')])
    assert parse(TEXTS[6]) == (None, [("f", '{"x": 1}')])
    assert parse(TEXTS[7]) == ("<tool_call>{not json}</tool_call> then ", [("get_weather", '{"city": "Paris", "days": 2}')])
    for text in TEXTS[8:]:  # not calls: the text comes back whole
        assert parse(text) == (text, [])
    assert json.loads(parse(CALL)[1][0][1]) == {"city": "Paris", "days": 2}


def _streamed(pieces):
    stream, content, calls = HermesStream(), "", []
    for piece in pieces:
        text, new = stream.feed(piece)
        content, calls = content + text, calls + new
    content += stream.finish()[0]
    assert stream.num_calls == len(calls)
    return content, calls


@pytest.mark.parametrize("text", TEXTS)
def test_a_stream_split_anywhere_gives_the_whole_texts_answer(text):
    want_content, want_calls = parse(text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    splits += [[text[:i], text[i:j], text[j:]] for i in range(0, len(text), 7) for j in range(i, len(text), 5)]
    for pieces in splits:
        content, calls = _streamed(pieces)
        assert calls == want_calls, pieces
        # the stream's content is the same text; a whole text of calls and whitespace says None instead
        assert (None if calls and not content.strip() else content) == want_content, pieces


def test_content_is_never_a_piece_of_a_call():
    """Streamed content never holds text of a block that becomes a call, even one tag character."""
    stream = HermesStream()
    sent = ""
    for ch in "ok " + CALL:
        sent += stream.feed(ch)[0]
    assert sent == "ok "
    assert tool_parsers.TOOL_CALL_PARSERS == ("hermes",)
