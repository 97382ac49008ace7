"""The tool-call parsers (serve/tool_parsers.py): whole texts, and streams split anywhere."""
import json

import pytest

from jlight.serve import tool_parsers
from jlight.serve.tool_parsers import HermesStream, new_stream, parse

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


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
LLAMA_TEXTS = [
    "plain text, no calls at all",
    LLAMA_CALL,
    "  \n" + LLAMA_CALL,
    "<|python_tag|>" + LLAMA_CALL,
    LLAMA_CALL + "; " + '{"name": "get_time", "parameters": {}}',
    "<|python_ta is not the tag",
    "Use {braces} like this",
    LLAMA_CALL + " and then some text",  # not calls alone: content
    '{"name": "f", "parameters": {}',  # cut short: content
    '{"parameters": {}}',  # no name: content
    '{"name": "Bob", "age": 3}',  # an answer in JSON, not a call: no arguments
    "   ",
]


MISTRAL_CALLS = '[{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, {"name": "get_time", "arguments": {}}]'
MISTRAL_TEXTS = [
    "plain text, no calls at all",
    MISTRAL_CALLS,
    "[TOOL_CALLS]" + MISTRAL_CALLS,
    " \n" + MISTRAL_CALLS,
    "[1, 2, 3]",  # a JSON array that is not calls: content
    '[{"name": "Bob", "age": 3}]',  # objects without arguments: content
    MISTRAL_CALLS[:30],  # cut short: content
    "[TOOL_CALLS]get_weather[ARGS]{}",  # the v11 form, not read: content
    "[TOOL_CA and then no tag",
]


def test_mistral_whole_texts():
    want = [("get_weather", '{"city": "Paris", "days": 2}'), ("get_time", "{}")]
    assert parse(MISTRAL_TEXTS[0], "mistral") == (MISTRAL_TEXTS[0], [])
    for text in MISTRAL_TEXTS[1:4]:
        assert parse(text, "mistral") == (None, want), text
    for text in MISTRAL_TEXTS[4:]:
        assert parse(text, "mistral") == (text, []), text


def test_llama3_json_whole_texts():
    weather = ("get_weather", '{"city": "Paris", "days": 2}')
    assert parse(LLAMA_TEXTS[0], "llama3_json") == (LLAMA_TEXTS[0], [])
    for text in LLAMA_TEXTS[1:4]:
        assert parse(text, "llama3_json") == (None, [weather]), text
    assert parse(LLAMA_TEXTS[4], "llama3_json") == (None, [weather, ("get_time", "{}")])
    for text in LLAMA_TEXTS[5:]:
        assert parse(text, "llama3_json") == (text, []), text


def _streamed(pieces, parser):
    stream, content, calls = new_stream(parser), "", []
    for piece in pieces:
        text, new = stream.feed(piece)
        content, calls = content + text, calls + new
    rest, more = stream.finish()
    content, calls = content + rest, calls + more
    assert stream.num_calls == len(calls)
    return content, calls


@pytest.mark.parametrize("parser,text", [("hermes", t) for t in TEXTS] + [("llama3_json", t) for t in LLAMA_TEXTS]
                         + [("mistral", t) for t in MISTRAL_TEXTS])
def test_a_stream_split_anywhere_gives_the_whole_texts_answer(parser, text):
    want_content, want_calls = parse(text, parser)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    splits += [[text[:i], text[i:j], text[j:]] for i in range(0, len(text), 7) for j in range(i, len(text), 5)]
    for pieces in splits:
        content, calls = _streamed(pieces, parser)
        assert calls == want_calls, pieces
        # the stream's content is the same text; a whole text of calls and whitespace says None instead
        assert (None if calls and not content.strip() else content) == want_content, pieces


def test_llama3_json_content_streams_at_once():
    stream = new_stream("llama3_json")
    assert stream.feed(" ") == ("", [])  # undecided
    assert stream.feed("Hel") == (" Hel", [])
    assert stream.feed("lo {") == ("lo {", [])


def test_content_is_never_a_piece_of_a_call():
    """Streamed content never holds text of a block that becomes a call, even one tag character."""
    stream = HermesStream()
    sent = ""
    for ch in "ok " + CALL:
        sent += stream.feed(ch)[0]
    assert sent == "ok "
    assert sorted(tool_parsers.TOOL_CALL_PARSERS) == ["hermes", "llama3_json", "mistral"]
