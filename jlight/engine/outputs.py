"""What the engine hands back for each request."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str  # everything generated so far (stop strings removed)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # One dict per generated token: {token_id: logprob} holding the sampled token and the top-N.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs (as vLLM), with logprobs only
    text_delta: str = ""  # new text since the previous output for this request
    token_ids_delta: list[int] = dataclasses.field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    arrival_time: float = 0.0
    first_token_time: float | None = None
