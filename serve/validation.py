"""Checks on a request that need the model: its name, the prompt's tokens against the
context length and the vocabulary, and the final SamplingParams.validate().

Every failure is a RequestError naming the request field at fault (OpenAI's `param`).
"""
from __future__ import annotations

import json
import logging
import re

from jlight.engine.sampling_params import SamplingParams
from jlight.serve.budget import PromptBudget
from jlight.serve.errors import RequestError
from jlight.serve.protocol import ChatMessage, SamplingFields, structured_outputs_asked

logger = logging.getLogger(__name__)


def check_model_name(requested: str | None, served_names: list[str]) -> str:
    """The name to echo back in responses; 404 for a model this server does not serve."""
    if requested is None or requested == "":
        return served_names[0]
    if requested not in served_names:
        raise RequestError(
            f"model {requested!r} does not exist on this server; use one of {served_names} "
            f"(see GET /v1/models)", param="model", status=404, code="model_not_found")
    return requested


def _check_text(text: str, param: str) -> None:
    # JSON allows lone surrogates ("\ud800"); they are not text and the tokenizer rejects them.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{param} contains invalid Unicode (a lone surrogate escape); "
                           f"send valid UTF-8 text", param=param) from None


def _check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if t >= vocab_size), None)
    if bad is not None:
        raise RequestError(f"{param} holds token id {bad}, outside the vocabulary [0, {vocab_size})",
                           param=param)


def completion_prompts(prompt, tokenizer, vocab_size: int, budget: PromptBudget | None = None) -> list[list[int]]:
    """A completions `prompt` (string, strings, token ids, or lists of them) -> token id lists; a text
    that `budget` says cannot fit is refused untokenized."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and isinstance(prompt[0], int):
        prompt = [prompt]
    token_lists = []
    for item in prompt:
        if isinstance(item, str):
            if not item:
                raise RequestError("prompt must not be empty; send at least one character", param="prompt")
            _check_text(item, "prompt")
            if budget is not None:
                budget.check_text(item, "prompt")
            ids = tokenizer.encode(item, add_special_tokens=True)
        else:
            ids = list(item)
            _check_token_ids(ids, vocab_size, "prompt")
        if not ids:
            raise RequestError("prompt encodes to no tokens; send a longer prompt", param="prompt")
        token_lists.append(ids)
    return token_lists


def _template_message(m: ChatMessage, text: str) -> dict:
    """A message as chat templates read it; tool fields only where given (templates test `is defined`)."""
    message = {"role": m.role, "content": text}
    if m.tool_calls:
        message["tool_calls"] = [{"id": call.id, "type": call.type,
                                  "function": {"name": call.function.name,
                                               "arguments": _arguments_for_template(call.function.arguments)}}
                                 for call in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    return message


def _arguments_for_template(arguments: str):
    """The arguments as a dict where they parse: HF templates expect a mapping (they `tojson` it or loop
    over its items), as transformers documents and vLLM does; other text stays as sent."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def chat_prompt(messages: list[ChatMessage], tokenizer, add_generation_prompt: bool = True,
                tools: list[dict] | None = None, budget: PromptBudget | None = None) -> list[int]:
    """Render `messages` (and `tools`, the request's tool dicts, for templates that show them) with the
    model's chat template and tokenize the result; a rendered text `budget` says cannot fit is refused
    untokenized."""
    plain = []
    for i, m in enumerate(messages):
        text = m.text()
        _check_text(text, f"messages[{i}].content")
        plain.append(_template_message(m, text))
    if all(not m["content"] and not m.get("tool_calls") for m in plain):
        raise RequestError("messages are all empty; send at least one message with content",
                           param="messages")
    try:
        # Only with tools: a template (or a tokenizer stand-in) that knows nothing of them renders as before.
        extra = {"tools": tools} if tools else {}
        rendered = tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt, **extra)
    except Exception as e:  # templates raise arbitrary errors (e.g. "roles must alternate")
        logger.info("chat template rejected messages: %s", e)
        raise RequestError(f"messages cannot be rendered with this model's chat template: {e}",
                           param="messages") from None
    if budget is not None:
        budget.check_text(rendered, "messages")
    # The template already holds any BOS text; adding special tokens again would double it.
    ids = tokenizer.encode(rendered, add_special_tokens=False)
    if not ids:
        raise RequestError("messages render to an empty prompt", param="messages")
    return ids


def resolve_max_tokens(requested: int | None, prompt_len: int, max_model_len: int,
                       prompt_param: str, max_tokens_param: str) -> int:
    """max_tokens to give the engine: the request's, or the rest of the context if None."""
    room = max_model_len - prompt_len
    if room < 1:
        raise RequestError(
            f"{prompt_param} is {prompt_len} tokens but the model's context is {max_model_len} tokens, "
            f"leaving no room to generate; shorten the prompt", param=prompt_param,
            code="context_length_exceeded")
    if requested is None:
        return room
    if requested > room:
        raise RequestError(
            f"{max_tokens_param}={requested} is too large: the prompt has {prompt_len} tokens and the "
            f"context is {max_model_len}, so at most {room} can be generated; lower {max_tokens_param}",
            param=max_tokens_param, code="context_length_exceeded")
    return requested


def check_logit_bias_keys(logit_bias: dict[str, float] | None) -> None:
    for key in logit_bias or {}:
        if not re.fullmatch(r"\d+", key):
            raise RequestError(f"logit_bias key {key!r} is not a token id; keys must be integer strings",
                               param="logit_bias")


def structured_outputs_param(body: SamplingFields) -> str | None:
    """The request field that constrains the output (response_format, guided_*, structured_outputs),
    as structured_outputs_asked names it, or None; a 400 when the request sets more than one."""
    asked = [param for param, _ in structured_outputs_asked(body)]
    if len(asked) > 1:
        names = [param.split(".")[0] for param in asked]
        raise RequestError(f"{' and '.join(names)} each constrain the output; send only one of them", param=names[1])
    return asked[0] if asked else None


def engine_error(e: ValueError, structured_param: str | None = None,
                 field_names: dict[str, str] | None = None) -> RequestError:
    """A ValueError from SamplingParams.validate() or the engine's validate_request -> a 400 naming
    the request field. The engine names its fields "max_tokens=..." (`field_names` maps them to request
    fields where they differ) and structured outputs "structured_outputs.regex is invalid: ...", which
    becomes the request's own field (`structured_param`, e.g. guided_regex) in the message and param."""
    message = str(e)
    structured = re.match(r"structured_outputs(\.\w+)?\b", message)
    if structured and structured_param:
        if structured.group(1):
            message = structured_param + message[structured.end():]
        return RequestError(message, param=structured_param)
    match = re.match(r"(\w+)=", message)
    field = match.group(1) if match else None
    return RequestError(message, param=(field_names or {}).get(field, field))


def validate_sampling_params(params: SamplingParams, vocab_size: int, field_names: dict[str, str],
                             structured_param: str | None = None) -> None:
    """SamplingParams.validate(), with its ValueError turned into a 400 naming the request field
    (see engine_error)."""
    try:
        params.validate(vocab_size)
    except ValueError as e:
        raise engine_error(e, structured_param, field_names) from None
