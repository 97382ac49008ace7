"""A Sequence is one sample of one request: its tokens, pages and progress."""
from __future__ import annotations

import enum
import itertools

import numpy as np

from jlight.engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_seq_counter = itertools.count()


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams, seed: int, arrival: float):
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index  # which of the request's n samples
        self.prompt_token_ids = prompt_token_ids
        self.output_token_ids: list[int] = []
        self.params = params
        self.seed = seed
        self.arrival = arrival
        self.status = SeqStatus.WAITING
        self.pages: list[int] = []  # page table of KV group 0 (the only one without attention kinds)
        self.group_pages: list[list[int]] = []  # page tables of KV groups 1.. (kv_groups.py), else empty
        self.page_keys: list[bytes] = []  # prefix keys of the leading full pages
        self.state_slot = 0  # hybrid models: its recurrent-state slot while running (state_pool.py), 0 = none
        self.restore_from = 0  # hybrid models: the snapshot slot to copy into state_slot before its next step
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (or being written by a launched step)
        self.num_pending_tokens = 0  # sampled on device in a launched step, not yet seen by the host
        self.last_row: int | None = None  # row of this sequence in the most recently launched step
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache on first admission
        self.admitted_once = False
        self.parent: Sequence | None = None  # for n > 1: samples after the first wait for its prompt
        self.eos_ids_for_min_tokens: list[int] = []  # banned until min_tokens are out (EOS + stop ids)
        self.matcher = None  # structured outputs: the grammar matcher of the tokens so far (llguidance)
        # A device proposer's drafts (proposers/device.py), made in the step that sampled its last token: they
        # continue its first `drafts_follow` known tokens (-1: none).
        self.draft_tokens: list[int] = []
        self.drafts_follow = -1
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.logprobs: list[dict[int, float]] = []
        self.cumulative_logprob = 0.0  # kept as tokens come (summing the dicts each output would be quadratic)
        self.prompt_logprobs: list[dict[int, float] | None] | None = None
        self.first_token_time: float | None = None
        # Text state (owned by the engine's output processing).
        self.detokenizer = None
        self.text = ""
        self.emitted_text_len = 0
        self.emitted_token_len = 0
        self._tokens = np.asarray(prompt_token_ids, np.int32)  # all known tokens, grown as outputs come (token_array)
        self._num_tokens_in_array = len(prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens known so far, counting ones sampled on device but not yet fetched."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_array(self) -> np.ndarray:
        """The known tokens (prompt then output) as an int32 array, extended in place as outputs come:
        the speculative proposer reads it every step without copying the whole history."""
        n = len(self.prompt_token_ids) + len(self.output_token_ids)
        if n > self._num_tokens_in_array:
            if n > len(self._tokens):
                grown = np.zeros(max(2 * len(self._tokens), n), np.int32)
                grown[: self._num_tokens_in_array] = self._tokens[: self._num_tokens_in_array]
                self._tokens = grown
            new = self.output_token_ids[self._num_tokens_in_array - len(self.prompt_token_ids):]
            self._tokens[self._num_tokens_in_array:n] = new
            self._num_tokens_in_array = n
        return self._tokens[:n]

    def token_slice(self, start: int, end: int) -> list[int]:
        """Known tokens [start, end) without concatenating prompt and output (a per-step hot path)."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def prefill_done(self) -> bool:
        return self.num_computed_tokens >= len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
