"""OpenAI request/response bodies for /v1/completions and /v1/chat/completions.

The request models carry range checks in their Field() constraints so they show up in
the OpenAPI schema (clients and schemathesis read them); `to_sampling_params` maps a
validated request onto jlight's SamplingParams. Checks that need the model (context
length, vocabulary) live in serve/validation.py.
"""
from __future__ import annotations

import functools
import time
import typing
from typing import Annotated, Any, Literal

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError,
                      ValidationInfo, WrapValidator, model_validator)

from jlight.engine.sampling_params import MAX_N, MAX_STOP_STRINGS, MAX_TOP_LOGPROBS, SamplingParams

MAX_PROMPTS_PER_REQUEST = 64  # a completions request may batch this many prompts
MAX_LOGIT_BIAS_ENTRIES = 32  # the engine applies at most this many per request

# Strict types: OpenAI rejects "1" where an integer is expected, so do we. A strict float
# still takes an integer (temperature=1) but not a string or a bool.
PositiveInt = Annotated[StrictInt, Field(ge=1)]


def Number(**bounds):
    return Annotated[float, Field(strict=True, **bounds)]


TokenIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]


def OneOf(union: Any, shapes: str):
    """A field that takes several shapes. pydantic would report only the first shape's
    complaint ("Input should be a valid string" for token ids with a negative one); the
    message names every shape instead."""
    def check(value, handler, info: ValidationInfo):
        try:
            return handler(value)
        except ValidationError:
            raise ValueError(f"{info.field_name} must be {shapes}") from None
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
    """A field of a feature jlight lacks. A value that asks for nothing (no tools, plain text)
    passes; any other is a 400 naming the field, because an answer that ignored it (prose
    where JSON was asked for, no tool call) would look like success."""
    def check(value, info: ValidationInfo):
        if value is not None and not asks_nothing(value):
            raise ValueError(f"{info.field_name} is not supported ({why}); leave {info.field_name} out")
        return value
    return Annotated[base, AfterValidator(check)]


NO_GUIDED = "jlight has no guided decoding (structured output)"
NO_TOOLS = "jlight does not parse tool calls"
GuidedDecoding = Unsupported(Any, lambda v: False, NO_GUIDED)


class StreamOptions(OpenAIBody):
    include_usage: StrictBool = False


def _only_when_streaming(value, info: ValidationInfo):
    """stream_options without stream=true (OpenAI and vLLM answer 400): the options would do nothing."""
    if value is not None and not info.data.get("stream"):
        raise ValueError("stream_options is only allowed with stream=true; set stream=true or leave stream_options out")
    return value


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
    # vLLM's structured-output extensions, which jlight lacks.
    guided_json: GuidedDecoding = None
    guided_regex: GuidedDecoding = None
    guided_choice: GuidedDecoding = None
    guided_grammar: GuidedDecoding = None
    structured_outputs: GuidedDecoding = None


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


class ChatMessage(OpenAIBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: OneOf(StrictStr | list[TextPart] | None,
                   'a string or a list of {"type": "text", "text": ...} parts (jlight takes text only)') = None
    name: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: PositiveInt | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: PositiveInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True
    tools: Unsupported(list, lambda v: v == [], NO_TOOLS) = None
    functions: Unsupported(list, lambda v: v == [], NO_TOOLS) = None
    tool_choice: Unsupported(Any, lambda v: v in ("none", "auto"), NO_TOOLS) = None
    function_call: Unsupported(Any, lambda v: v in ("none", "auto"), NO_TOOLS) = None
    response_format: Unsupported(dict, lambda v: v == {"type": "text"}, NO_GUIDED) = None


class TokenizeRequest(OpenAIBody):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True


class DetokenizeRequest(OpenAIBody):
    model: StrictStr | None = None
    tokens: list[Annotated[StrictInt, Field(ge=0)]]


# ---- responses -------------------------------------------------------------------

class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class CompletionLogprobs(BaseModel):
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = []


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str | None = "assistant"
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None = None


class ChatDeltaChoice(BaseModel):
    index: int
    delta: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "jlight"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


# ---- request -> SamplingParams -----------------------------------------------------

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
    )


def usage_of(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                     total_tokens=prompt_tokens + completion_tokens)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code)).model_dump()
