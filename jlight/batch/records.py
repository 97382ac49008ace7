"""One JSONL input line -> a request to run, or an error record naming the line and the fix.

A line is a JSON object with `prompt` (a string or a list of token ids) or `messages` (chat),
an optional `id`, and optional SamplingParams fields (`max_tokens`, `temperature`, ...) that
override the job's defaults for that line. Anything else is reported, not guessed at.
"""
from __future__ import annotations

import dataclasses
import json

from jlight.engine.sampling_params import SamplingParams

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
_OTHER_FIELDS = frozenset({"id", "prompt", "messages"})


@dataclasses.dataclass
class BatchRequest:
    index: int  # position among the input's non-blank lines (the engine request id)
    line: int  # 1-based line number in the input file
    id: str  # the user's `id`, or "line-<line>"
    prompt: str | list[int] | None
    messages: list[dict] | None
    sampling_params: SamplingParams


@dataclasses.dataclass
class BatchError:
    index: int
    line: int
    id: str | None
    error: str


def parse_line(index: int, line: int, raw: bytes, defaults: dict) -> BatchRequest | BatchError:
    """Parse one input line; `defaults` are the job-wide SamplingParams fields."""
    try:
        obj = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return BatchError(index, line, None, f"line {line} is not valid JSON ({e}); write one JSON object per line")
    if not isinstance(obj, dict):
        return BatchError(index, line, None, f"line {line} is a JSON {type(obj).__name__}, not an object; write {{\"prompt\": ...}}")
    user_id = obj.get("id")
    user_id = str(user_id) if user_id is not None else None

    def error(message: str) -> BatchError:
        return BatchError(index, line, user_id, f"line {line}: {message}")

    unknown = sorted(set(obj) - SAMPLING_FIELDS - _OTHER_FIELDS)
    if unknown:
        return error(f"unknown field(s) {unknown}; use prompt or messages, id, and SamplingParams fields")
    prompt, messages = obj.get("prompt"), obj.get("messages")
    if (prompt is None) == (messages is None):
        return error("give exactly one of 'prompt' (text or token ids) and 'messages' (chat)")
    if prompt is not None and not (isinstance(prompt, str) and prompt) and not _is_token_ids(prompt):
        return error("'prompt' must be a non-empty string or a non-empty list of token ids")
    if messages is not None and not _is_messages(messages):
        return error("'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    fields = {**defaults, **{k: v for k, v in obj.items() if k in SAMPLING_FIELDS}}
    try:
        params = SamplingParams(**fields).validate()
    except (TypeError, ValueError) as e:
        return error(str(e))
    return BatchRequest(index, line, user_id or f"line-{line}", prompt, messages, params)


def _is_token_ids(x) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in x)


def _is_messages(x) -> bool:
    return isinstance(x, list) and len(x) > 0 and all(isinstance(m, dict) and "role" in m for m in x)


def result_record(request: BatchRequest, output) -> dict:
    """The output line for a finished request (`output` is its final RequestOutput): the first sample's
    text, token ids and finish reason, and its logprobs and the prompt's when the line asked for them
    (one {"token id": logprob} object per token: the sampled or prompt token and the top alternatives;
    the first prompt token's is null, having nothing before it). With n > 1, every sample in `choices`."""
    first = output.outputs[0]
    record = {
        "line": request.line,
        "id": request.id,
        **_sample_fields(first),
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": sum(len(o.token_ids) for o in output.outputs),
    }
    if output.prompt_logprobs is not None:
        record["prompt_logprobs"] = [_json_logprobs(d) for d in output.prompt_logprobs]
    if len(output.outputs) > 1:
        record["choices"] = [_sample_fields(o) for o in output.outputs]
    return record


def _sample_fields(sample) -> dict:
    fields = {"text": sample.text, "token_ids": list(sample.token_ids), "finish_reason": sample.finish_reason}
    if sample.logprobs is not None:
        fields["logprobs"] = [_json_logprobs(d) for d in sample.logprobs]
        fields["cumulative_logprob"] = sample.cumulative_logprob
    return fields


def _json_logprobs(by_token: dict[int, float] | None) -> dict[str, float] | None:
    return None if by_token is None else {str(token): logprob for token, logprob in by_token.items()}


def error_record(error: BatchError) -> dict:
    return {"line": error.line, "id": error.id, "error": error.error}
