"""Tool calls in responses: the forced ones (tool_choice "required" or a named function), built on
structured outputs, and the message fields of the ones "auto" finds in free text.

These choices leave the model no other way out: the output is held to a JSON schema (as vLLM does
for these two choices) and the generated JSON *is* the call. A named function's output is its
arguments object; "required"'s is an array of {"name", "parameters"} items, one per call.
tool_choice "auto" lets the model choose, so its calls must be found in free text: that takes a
parser for the model's format (serve/tool_parsers.py), which the server has only when started with
--enable-auto-tool-choice; without one "auto" is a 400 rather than a silently ignored tool.

The request models (ChatTool, NamedToolChoice) are in serve/protocol.py; this module works on
them and on the generated text.
"""
from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from jlight.serve import tool_parsers
from jlight.serve.errors import RequestError

EMPTY_PARAMETERS = {"type": "object", "properties": {}}  # a function without `parameters` takes no arguments


@dataclasses.dataclass(frozen=True)
class ForcedToolCall:
    """What a request's tool_choice forces: one named function, or ("required") one or more of the tools."""
    function_name: str | None  # None for "required"
    schema: dict[str, Any]  # the JSON schema the output is held to
    param: str  # the request field behind `schema`, for errors (the engine's grammar compile, two constraints)

    @property
    def named(self) -> bool:
        return self.function_name is not None


def forced_tool_call(tools, tool_choice, parallel_tool_calls: bool | None = None,
                     auto_tool_choice: bool = False) -> ForcedToolCall | None:
    """The call `tool_choice` forces over `tools` (protocol.ChatTool list), None for plain text or, with
    auto_tool_choice (the server has a parser), for "auto"; a 400 naming tool_choice where the pair asks
    for what jlight cannot do."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise RequestError("tool_choice asks for a tool call but the request has no tools; send the "
                               "functions in tools, or leave tool_choice out", param="tool_choice")
        return None
    choice = "auto" if tool_choice is None else tool_choice  # OpenAI's default when tools are given
    if choice == "none":
        return None  # the template still sees the tools; the answer is text
    if choice == "auto":
        if auto_tool_choice:
            return None  # free text; the server's parser finds the calls in it
        raise RequestError(
            'tool_choice "auto" (the default when tools are given) is not supported by this server: finding '
            'calls in free output needs one started with --enable-auto-tool-choice --tool-call-parser hermes '
            '(or llama3_json or mistral: the format of the model). '
            'Or send tool_choice "required" or {"type": "function", "function": {"name": ...}} to force a '
            'call, or tool_choice "none" for a plain-text answer', param="tool_choice")
    by_name = {tool.function.name: tool for tool in tools}
    if choice == "required":
        return ForcedToolCall(None, _compact(_required_schema(tools, parallel_tool_calls)), "tools")
    name = choice.function.name
    if name not in by_name:
        raise RequestError(f"tool_choice names function {name!r}, which is not among the tools "
                           f"({', '.join(sorted(by_name))}); name one of them", param="tool_choice")
    index = next(i for i, tool in enumerate(tools) if tool.function.name == name)
    return ForcedToolCall(name, _compact(_parameters(by_name[name])), f"tools.{index}.function.parameters")


def _compact(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` with JSON's optional whitespace ruled out (llguidance's x-guidance option, which the engine
    reads). Arguments are read by a program, and a small model left free pads them with newlines until
    max_tokens cuts the call short (SmolLM2-135M did, in test_server_e2e). vLLM leaves whitespace free
    unless started with --disable-any-whitespace; a schema that sets x-guidance itself keeps its own."""
    return schema if "x-guidance" in schema else {**schema, "x-guidance": {"whitespace_flexible": False}}


def _parameters(tool) -> dict[str, Any]:
    return tool.function.parameters or EMPTY_PARAMETERS


def _required_schema(tools, parallel_tool_calls: bool | None) -> dict[str, Any]:
    """An array of at least one {"name": one of the tools, "parameters": that tool's schema}: an anyOf
    over the tools, built the way vLLM builds it. Each tool's $defs move to the top, where its
    "#/$defs/..." references point once the schema is nested."""
    defs: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        parameters = dict(_parameters(tool))
        # $defs that are not an object stay where they are, for the grammar compiler to refuse (a 400).
        tool_defs = parameters.pop("$defs") if isinstance(parameters.get("$defs"), dict) else {}
        for key, value in tool_defs.items():
            if defs.setdefault(key, value) != value:
                raise RequestError(f"tools define $defs {key!r} differently; give the definitions different "
                                   f"names", param=f"tools.{i}.function.parameters")
        items.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"],
                      # vLLM leaves extra keys open; closing them keeps a small model from wandering off.
                      "additionalProperties": False})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if parallel_tool_calls is False:  # OpenAI's switch for "at most one call"
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, index: int | None = None) -> dict[str, Any]:
    """One entry of a message's (or, with `index`, a stream delta's) tool_calls."""
    call = {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


def parse_required(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON text) for each call in "required"'s generated array; None when the text is
    not a complete array of calls (generation stopped early: max_tokens, a stop string)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not (isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item):
            return None
        calls.append((item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
    return calls


def choice_fields(forced: ForcedToolCall, text: str, engine_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """A whole response's message fields and finish_reason for generated `text`: content null and the
    calls; or, for a "required" array that did not complete, the text as content, no calls (there is
    nothing to call) and the engine's reason.

    finish_reason: OpenAI answers "stop" for a named tool_choice and "tool_calls" for "required"; vLLM
    does the same since vllm-project/vllm#25054 (2025-09, "Align finish_reason when tool is called with
    OpenAI"), so jlight follows both. A call cut short keeps the engine's reason ("length"), so that a
    client can tell its arguments are incomplete."""
    if forced.named:
        return ({"content": None, "tool_calls": [tool_call(forced.function_name, text)]},
                "stop" if engine_reason == "stop" else engine_reason)
    calls = parse_required(text)
    if calls is None:
        return {"content": text, "tool_calls": []}, engine_reason
    return ({"content": None, "tool_calls": [tool_call(name, arguments) for name, arguments in calls]},
            "tool_calls" if engine_reason == "stop" else engine_reason)


def parsed_choice_fields(text: str, engine_reason: str | None, parser: str) -> tuple[dict[str, Any], str | None]:
    """choice_fields for tool_choice "auto": the calls `parser` finds in free `text` and the rest as
    content; finish_reason "tool_calls" for a "stop" once a call was made, as OpenAI answers."""
    content, calls = tool_parsers.parse(text, parser)
    if not calls:
        return {"content": text}, engine_reason
    return ({"content": content, "tool_calls": [tool_call(name, arguments) for name, arguments in calls]},
            "tool_calls" if engine_reason == "stop" else engine_reason)
