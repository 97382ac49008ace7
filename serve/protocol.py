"""OpenAI request bodies for /v1/completions and /v1/chat/completions (the responses' are in
serve/response_models.py).

The request models carry range checks in their Field() constraints so they show up in
the OpenAPI schema (clients and schemathesis read them); `to_sampling_params` maps a
validated request onto jlight's SamplingParams. Checks that need the model (context
length, vocabulary) live in serve/validation.py.
"""
from __future__ import annotations

import functools
import json
import typing
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError,
                      ValidationInfo, WrapValidator, model_validator)

from jlight.engine.sampling_params import MAX_N, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, SamplingParams
from jlight.serve.tool_calls import ForcedToolCall, forced_tool_call

MAX_PROMPTS_PER_REQUEST = 64  # a completions request may batch this many prompts
MAX_LOGIT_BIAS_ENTRIES = 32  # the engine applies at most this many per request

# Strict types: OpenAI rejects "1" where an integer is expected, so do we. A strict float
# still takes an integer (temperature=1) but not a string or a bool.
PositiveInt = Annotated[StrictInt, Field(ge=1)]


def Number(**bounds):
    return Annotated[float, Field(strict=True, **bounds)]


TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


def OneOf(union: Any, shapes: str, name: str | None = None):
    """A field that takes several shapes. pydantic would report only the first shape's
    complaint ("Input should be a valid string" for token ids with a negative one); the
    message names every shape instead. `name`: the field's name in messages, if not its own."""
    def check(value, handler, info: ValidationInfo):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"{name or info.field_name} must be {shapes}") from None
    return Annotated[union, WrapValidator(check)]


class OpenAIBody(BaseModel):
    # Clients send fields we do not use (user, service_tier, ...); ignoring them is what
    # OpenAI-compatible servers do. Unknown *values* of known fields are still errors.
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """OpenAI's schema marks optional fields nullable (n, stream, echo, logprobs, ...) and
        clients send null for "unset": a null for a field whose type has no None of its own
        takes the default. (Where None is a value, e.g. max_tokens=None, it is kept.)"""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in _defaulted_on_null(cls)}


@functools.cache
def _defaulted_on_null(cls) -> frozenset[str]:
    return frozenset(name for name, f in cls.model_fields.items()
                     if not f.is_required() and type(None) not in typing.get_args(f.annotation))


def Unsupported(base: Any, asks_nothing, why: str):
    """A field of a feature jlight lacks. A value that asks for nothing (no tools, an empty
    suffix) passes; any other is a 400 naming the field, because an answer that ignored it
    (no tool call, no inserted suffix) would look like success."""
    def check(value, info: ValidationInfo):
        if value is not None and not asks_nothing(value):
            raise ValueError(f"{info.field_name} is not supported ({why}); leave {info.field_name} out")
        return value
    return Annotated[base, AfterValidator(check)]


LEGACY_FUNCTIONS = "the deprecated function-calling fields; send tools and tool_choice instead"
MAX_TOOLS = 128  # OpenAI's limit


class StreamOptions(OpenAIBody):
    include_usage: StrictBool = False


def _only_when_streaming(value, info: ValidationInfo):
    """stream_options without stream=true (OpenAI and vLLM answer 400): the options would do nothing."""
    if value is not None and not info.data.get("stream"):
        raise ValueError("stream_options is only allowed with stream=true; set stream=true or leave stream_options out")
    return value


# ---- structured outputs: the request fields that constrain the output ---------------

JsonSchema = dict[str, Any]  # a JSON schema as a JSON object


def SchemaOrText(name: str):
    """A JSON schema as an object or as its JSON text (vLLM takes both); the text must at least parse."""
    def parses(value):
        if isinstance(value, str):
            try:
                json.loads(value)
            except ValueError as e:
                raise ValueError(f"{name} is not valid JSON text ({e}); send the JSON schema as an object "
                                 f"or as its JSON text") from None
        return value
    return Annotated[OneOf(JsonSchema | StrictStr, "a JSON schema: an object, or its JSON text", name),
                     AfterValidator(parses)]


NonEmptyStr = Annotated[StrictStr, Field(min_length=1)]


def Choices(name: str):
    return OneOf(Annotated[list[NonEmptyStr], Field(min_length=1)], "a non-empty list of non-empty strings", name)


class JsonSchemaFormat(OpenAIBody):
    """OpenAI's response_format.json_schema; only `schema` constrains the output."""
    name: StrictStr | None = None  # OpenAI requires it; it changes nothing here, so it may be left out
    description: StrictStr | None = None
    schema_: JsonSchema | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(OpenAIBody):
    """OpenAI's response_format: text (no constraint), json_object (any JSON object), or json_schema."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError('response_format of type "json_schema" needs the schema: send '
                             '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs object: exactly one of its fields (jlight's StructuredOutputParams)."""
    # An unknown field (vLLM's whitespace_pattern, structural_tag, ...) asks for something jlight would not do.
    model_config = ConfigDict(extra="forbid")
    json_: SchemaOrText("structured_outputs.json") | None = Field(default=None, alias="json")
    json_object: StrictBool | None = None
    regex: NonEmptyStr | None = None
    choice: Choices("structured_outputs.choice") | None = None
    grammar: NonEmptyStr | None = None  # Lark or GBNF

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [name for name, value in self.params().items() if value not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")
        return self

    def params(self) -> dict[str, Any]:
        """The fields under StructuredOutputParams' names."""
        return {"json": self.json_, "json_object": self.json_object, "regex": self.regex, "choice": self.choice,
                "grammar": self.grammar}


class SamplingFields(OpenAIBody):
    """Sampling fields shared by both endpoints (OpenAI's plus vLLM-style extensions)."""
    model: StrictStr | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    temperature: Number(ge=0.0, le=2.0) | None = 1.0
    top_p: Number(gt=0.0, le=1.0) | None = 1.0
    stop: OneOf(StrictStr | Annotated[list[Annotated[StrictStr, Field(min_length=1)]], Field(max_length=MAX_STOP_STRINGS)] | None,
                f"a string or a list of at most {MAX_STOP_STRINGS} non-empty strings") = None
    seed: StrictInt | None = None
    presence_penalty: Number(ge=-2.0, le=2.0) | None = 0.0
    frequency_penalty: Number(ge=-2.0, le=2.0) | None = 0.0
    logit_bias: Annotated[dict[str, Number(ge=-100.0, le=100.0)],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | None = None
    stream: StrictBool = False
    stream_options: Annotated[StreamOptions | None, AfterValidator(_only_when_streaming)] = None  # after stream
    # Extensions (vLLM names).
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Number(ge=0.0, le=1.0) | None = None
    repetition_penalty: Number(gt=0.0) | None = None
    ignore_eos: StrictBool = False
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    stop_token_ids: list[Annotated[StrictInt, Field(ge=0)]] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    # Structured outputs, at most one of them (structured_outputs_asked): OpenAI's response_format
    # (vLLM takes it on /v1/completions too), vLLM's older guided_* fields and its newer object.
    response_format: ResponseFormat | None = None
    guided_json: SchemaOrText("guided_json") | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: Choices("guided_choice") | None = None
    guided_grammar: NonEmptyStr | None = None
    structured_outputs: StructuredOutputs | None = None
    # Disaggregated serving (vLLM's field): {"do_remote_decode": true} to a prefill server, what it answered to a
    # decode server (jlight/engine/disaggregated_roles.py); serve/router.py sets it.
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    # A string, a list of strings (a batch), a list of token ids, or a list of those.
    prompt: OneOf(StrictStr | Annotated[list[StrictStr], Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)]
                  | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS_PER_REQUEST)],
                  f"a string, a list of token ids (integers >= 0), or a batch: a list of 1 to "
                  f"{MAX_PROMPTS_PER_REQUEST} strings, or of 1 to {MAX_PROMPTS_PER_REQUEST} token-id lists")
    # 0 only with echo (vLLM's rule): the prompt and its logprobs come back, nothing is generated.
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: StrictBool = False  # the prompt comes back before the completion (serve/echo.py)
    suffix: Unsupported(StrictStr, lambda v: v == "", "jlight does not insert text (fill-in-the-middle)") = None
    best_of: PositiveInt | None = None


class TextPart(OpenAIBody):
    type: Literal["text"]
    text: StrictStr


class FunctionCallText(OpenAIBody):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI returns it


class MessageToolCall(OpenAIBody):
    """A call an earlier assistant message made (sent back in the conversation)."""
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCallText


class ChatMessage(OpenAIBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: OneOf(StrictStr | list[TextPart] | None,
                   'a string or a list of {"type": "text", "text": ...} parts (jlight takes text only)') = None
    name: StrictStr | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant message's calls
    tool_call_id: StrictStr | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


FunctionName = Annotated[StrictStr, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDefinition(OpenAIBody):
    name: FunctionName
    description: StrictStr | None = None
    parameters: JsonSchema | None = None  # the arguments' JSON schema; none: the function takes no arguments
    strict: StrictBool | None = None  # the arguments always follow the schema here, strict or not


class ChatTool(OpenAIBody):
    type: Literal["function"]
    function: FunctionDefinition


class ChosenFunction(OpenAIBody):
    name: StrictStr  # any text: one not among the tools gets a 400 that lists them


class NamedToolChoice(OpenAIBody):
    type: Literal["function"]
    function: ChosenFunction


def _unique_names(tools: list[ChatTool]) -> list[ChatTool]:
    names = [tool.function.name for tool in tools]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise ValueError(f"tools has more than one function named {', '.join(map(repr, repeated))}; "
                         f"give each function its own name")
    return tools


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True
    # Tools (serve/tool_calls.py): only a forced call, "required" or a named function, is answered.
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS), AfterValidator(_unique_names)] | None = None
    tool_choice: OneOf(Literal["none", "auto", "required"] | NamedToolChoice | None,
                       '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}') = None
    parallel_tool_calls: StrictBool | None = None  # false: "required" makes exactly one call
    functions: Unsupported(list, lambda v: v == [], LEGACY_FUNCTIONS) = None
    function_call: Unsupported(Any, lambda v: v in ("none", "auto"), LEGACY_FUNCTIONS) = None

    def forced_tool_call(self, auto_tool_choice: bool = False) -> ForcedToolCall | None:
        """The tool call tool_choice forces, or None; a RequestError naming tool_choice for choices
        jlight cannot answer ("auto" with tools on a server without a tool-call parser)."""
        return forced_tool_call(self.tools, self.tool_choice, self.parallel_tool_calls, auto_tool_choice)

    def parses_tool_calls(self) -> bool:
        """Whether the answer is free text that may hold calls: tools given, tool_choice "auto" (OpenAI's
        default with tools), and no constraint on the output: one held to the client's own format
        (response_format, guided_*) is that answer, not calls. Only asked once
        forced_tool_call(auto_tool_choice=True) has passed."""
        return bool(self.tools) and self.tool_choice in (None, "auto") and not structured_outputs_asked(self)


class TokenizeRequest(OpenAIBody):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True
    # with messages, as in a chat request: the prompt counted is the one the chat endpoint would run
    add_generation_prompt: StrictBool = True
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS), AfterValidator(_unique_names)] | None = None


class DetokenizeRequest(OpenAIBody):
    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


# ---- request -> SamplingParams -----------------------------------------------------

def structured_outputs_asked(req: SamplingFields) -> list[tuple[str, dict[str, Any]]]:
    """Each output constraint the request sets, as (the request field that set it, as an error's param;
    the StructuredOutputParams fields it means). A valid request has at most one
    (validation.structured_outputs_param checks)."""
    asked = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        asked.append(("response_format", {"json_object": True}))
    elif fmt is not None and fmt.type == "json_schema":
        asked.append(("response_format.json_schema.schema", {"json": fmt.json_schema.schema_}))
    for field, name in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                        ("guided_grammar", "grammar")):
        if getattr(req, field) is not None:
            asked.append((field, {name: getattr(req, field)}))
    if req.structured_outputs is not None:
        name, value = next((k, v) for k, v in req.structured_outputs.params().items() if v not in (None, False))
        asked.append((f"structured_outputs.{name}", {name: value}))
    # auto_tool_choice=True: "auto" constrains nothing either way; whether this server answers it at all
    # is the handler's check, made before this (GenerationHandlers.chat)
    forced = req.forced_tool_call(auto_tool_choice=True) if isinstance(req, ChatCompletionRequest) else None
    if forced is not None:  # last, so that with another constraint the 400 names tools
        asked.append((forced.param, {"json": forced.schema}))
    return asked


def to_sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int) -> SamplingParams:
    """Map a validated request onto SamplingParams; `max_tokens` is already resolved
    against the context length. None in an optional OpenAI field means "the default"."""
    prompt_logprobs = None
    if isinstance(req, ChatCompletionRequest):
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        logprobs = req.logprobs
        if req.echo:  # the echoed prompt's tokens get logprobs like the generated ones
            prompt_logprobs = logprobs
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    asked = structured_outputs_asked(req)
    return SamplingParams(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        repetition_penalty=req.repetition_penalty or 1.0,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
        stop=stop,
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
        skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        structured_outputs=asked[0][1] if asked else None,
        kv_transfer_params=req.kv_transfer_params,
    )
