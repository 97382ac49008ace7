"""SamplingParams: how one request's tokens are chosen and when it stops."""
from __future__ import annotations

import dataclasses

from jlight.engine.structured_output import StructuredOutputParams

MAX_N = 64
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
OUTPUT_KINDS = ("cumulative", "delta", "final_only")


@dataclasses.dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = dataclasses.field(default_factory=list)
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per generated token (0 = only the sampled one)
    prompt_logprobs: int | None = None
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Output held to a JSON schema, any JSON object, a regex, a choice or a grammar (structured_output.py):
    # a StructuredOutputParams or a dict of its fields, e.g. {"json": schema}.
    structured_outputs: StructuredOutputParams | dict | None = None
    # Disaggregated serving (vLLM's field; disaggregated_roles.py): {"do_remote_decode": true} asks a prefill process to
    # hand the request on; what it answers (a RemotePrefill) lets a decode process continue it. Only those take it.
    kv_transfer_params: dict | None = None
    # What the engine's outputs for the request carry (vLLM's RequestOutputKind): "cumulative", everything so far at
    # every step; "delta", only what is new since the last output (text, token_ids, logprobs); "final_only", one
    # output, when the request finishes. LLM.generate asks for "final_only", LLM.stream and the server's streams for
    # "delta": building everything at every step costs a long generation O(length^2) on the host.
    output_kind: str = "cumulative"

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        # Other types are left for validate() to name (list(5) would be a TypeError here).
        if isinstance(self.stop, (list, tuple)) or self.stop is None:
            self.stop = list(self.stop or [])
        if isinstance(self.stop_token_ids, (list, tuple)) or self.stop_token_ids is None:
            self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> "SamplingParams":
        """Raise ValueError naming the first bad field; return self when all are valid."""
        def bad(field, why):
            raise ValueError(f"{field}={getattr(self, field)!r} is invalid: {why}")

        # Types first: a string or None would make the range checks below raise TypeError, and a
        # bool passes as an int. The engine relies on these types inside its step.
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            if not _is_number(getattr(self, name)):
                bad(name, "must be a number")
        for name in ("n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs", "prompt_logprobs"):
            if isinstance(getattr(self, name), bool):
                bad(name, "must be an integer")
        if not isinstance(self.stop, list):
            bad("stop", "must be a string or a list of strings")
        if not isinstance(self.stop_token_ids, list) or not all(_is_int(t) for t in self.stop_token_ids):
            bad("stop_token_ids", "must be a list of token ids (integers)")
        if self.logit_bias is not None and (
                not isinstance(self.logit_bias, dict)
                or not all(_is_int(t) or (isinstance(t, str) and t.isdigit()) for t in self.logit_bias)
                or not all(_is_number(v) and -100.0 <= v <= 100.0 for v in self.logit_bias.values())):
            bad("logit_bias", "must map token ids to numbers in [-100, 100]")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            bad("n", f"must be an integer from 1 to {MAX_N}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", "must be an integer >= 1 (or None for the rest of the context)")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", "must not exceed max_tokens")
        if not self.temperature >= 0.0:
            bad("temperature", "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k < 2**31:
            bad("top_k", "must be -1 or 0 (off) or a positive integer below 2**31")
        if not isinstance(self.min_tokens, int) or self.min_tokens >= 2**31:
            bad("min_tokens", "must be an integer below 2**31")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if not self.repetition_penalty > 0.0:
            bad("repetition_penalty", "must be > 0 (1 = off)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.seed is not None and not isinstance(self.seed, int):
            bad("seed", "must be an integer")
        if len(self.stop) > MAX_STOP_STRINGS or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", f"must be at most {MAX_STOP_STRINGS} non-empty strings")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or not 0 <= v <= MAX_TOP_LOGPROBS):
                bad(name, f"must be an integer from 0 to {MAX_TOP_LOGPROBS}")
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputParams.coerce(self.structured_outputs)
        if self.output_kind not in OUTPUT_KINDS:
            bad("output_kind", f"must be one of {', '.join(map(repr, OUTPUT_KINDS))}")
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            bad("kv_transfer_params", "must be an object (what the prefill server answered) or None")
        if vocab_size is not None:
            for t in self.stop_token_ids:
                if not isinstance(t, int) or not 0 <= t < vocab_size:
                    bad("stop_token_ids", f"token ids must be in [0, {vocab_size})")
            for t in (self.logit_bias or {}):
                if not 0 <= int(t) < vocab_size:
                    bad("logit_bias", f"token ids must be in [0, {vocab_size})")
        return self


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    """An int or a finite-or-infinite float; not a bool, a string or NaN (NaN fails every range check)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x
