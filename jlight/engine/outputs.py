"""What the engine hands back for each request."""
from __future__ import annotations

import array
import collections.abc
import dataclasses


@dataclasses.dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    # text, token_ids and logprobs: everything generated so far (stop strings removed), or with the request's
    # SamplingParams.output_kind "delta" only what no output before carried (then equal to the deltas below)
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    # One dict per token of token_ids: {token_id: logprob} holding the sampled token and the top-N (AsyncLLM's
    # streams: packed).
    logprobs: list[dict[int, float]] | PackedLogprobs | None = None
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
    # A prefill process's handoff of this request to a decode process (disaggregated_roles.RemotePrefill as a dict)
    kv_transfer_params: dict | None = None


class PackedLogprobs(collections.abc.Sequence):
    """A list of per-token {token_id: logprob} dicts stored flat: int32 ids and float32 logprobs (the
    dtypes the engine computes them in, so nothing is lost), about 8 bytes a pair where a dict of
    Python objects takes about 60. Indexing gives a fresh dict (in the entry's order); slicing gives
    a PackedLogprobs. A stream's unsent logprobs wait in this form (jlight.engine.async_engine)."""

    __slots__ = ("_ids", "_lps", "_ends")

    def __init__(self, entries=()):
        self._ids, self._lps, self._ends = array.array("i"), array.array("f"), array.array("q")
        self.extend(entries)

    def extend(self, entries) -> None:
        if isinstance(entries, PackedLogprobs):
            base = len(self._ids)
            self._ids.extend(entries._ids)
            self._lps.extend(entries._lps)
            self._ends.extend(end + base for end in entries._ends)
            return
        for entry in entries:
            self._ids.extend(entry.keys())
            self._lps.extend(entry.values())
            self._ends.append(len(self._ids))

    def __len__(self) -> int:
        return len(self._ends)

    def _span(self, i: int) -> tuple[int, int]:
        return (self._ends[i - 1] if i > 0 else 0), self._ends[i]

    def __getitem__(self, i):
        if isinstance(i, slice):
            rows = range(*i.indices(len(self)))
            out = PackedLogprobs()
            if rows.step == 1 and len(rows):
                start, end = self._span(rows.start)[0], self._ends[rows.stop - 1]
                out._ids, out._lps = self._ids[start:end], self._lps[start:end]
                out._ends = array.array("q", (e - start for e in self._ends[rows.start:rows.stop]))
            else:
                out.extend(self[r] for r in rows)
            return out
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError("PackedLogprobs index out of range")
        start, end = self._span(i)
        return dict(zip(self._ids[start:end], self._lps[start:end]))

    def __eq__(self, other) -> bool:
        return isinstance(other, collections.abc.Sequence) and list(self) == list(other)

    def __repr__(self) -> str:
        return f"PackedLogprobs({list(self)!r})"
