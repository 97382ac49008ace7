"""A Sequence is one sample of one request: its tokens, pages and progress, and the only writer of them.

Every change of its state is one of its methods, named for the engine event that causes it; each checks
the rules below and raises `SequenceStateError` (a bug in the engine, never a user's input) on a break.

Invariants:
  * status moves WAITING -> RUNNING (`admit`, `resume`), RUNNING -> WAITING (`preempt`) and
    WAITING or RUNNING -> FINISHED (`finish`); FINISHED is final.
  * A waiting sequence has no computed tokens, pages, prefix keys or state slot: a preemption drops them
    all (its pages usually survive in the prefix cache) and the sequence is recomputed from admission.
    A finished one holds no pages or state slot either. Releasing their references is the block
    manager's and the state pool's business, done before `preempt` / `finish`.
  * Only a running sequence grows its page tables or is launched. Its page tables (`pages`, and with KV
    groups each of `group_pages`) have one length; an entry of a window group becomes NULL_PAGE only
    in a leading run (`drop_window_pages`). The scheduler launches a row only when its pages cover the
    tokens the row computes (len(pages) * page_size >= num_computed_tokens after the launch).
  * 0 <= num_computed_tokens; admission leaves at least one known token to compute; a launch never
    lowers it; a rollback (rejected drafts) never raises it. While a speculating row's drafts are in
    flight it counts them, so it may pass num_tokens until the rollback.
  * `page_keys` are the prefix keys of the leading full pages (the block manager computes them, the
    sequence appends them in order), never more than there are pages.
  * num_pending_tokens >= 0: one a launched sampling row, one less as the host fetches it, or as the
    engine discards a row drafted ahead of a verify row that rejected a draft (`discard_row_ahead`,
    speculative.py); `in_flight_drafts` are the drafts of the last launched sampling row, and
    `kept_all_drafts` says whether the last verify row read back kept all of its own.
  * Output tokens are only appended (the host sees each once); `finish_reason` is set once (`stop`),
    then the engine finishes the sequence.
  * The text state (`detokenizer`, `text`, `emitted_*`, `stop_checked_len`, `prompt_logprobs`) is output_processor.py's.
  * `page_tables()` equals the page tables as int32 arrays: every method that changes a table drops the
    arrays, and the next call makes them again (a decode row's tables change once a page of tokens, so
    the steps between copy arrays into their inputs, not Python lists).
"""
from __future__ import annotations

import enum
import itertools

import numpy as np

from jlight.core.kv_layout import NULL_PAGE
from jlight.engine.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class SequenceStateError(RuntimeError):
    """A state change that breaks a Sequence invariant: the engine's own bug."""


_seq_counter = itertools.count()


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_token_ids: list[int], params: SamplingParams, seed: int, arrival: float,
                 *, eos_ids_for_min_tokens: list[int] = (), detokenizer=None, matcher=None, parent: Sequence | None = None):
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
        self._table_arrays: list[np.ndarray] | None = None  # page_tables(), made when asked after a change
        self.page_keys: list[bytes] = []  # prefix keys of the leading full pages
        self.state_slot = 0  # hybrid models: its recurrent-state slot while running (state_pool.py), 0 = none
        self.restore_from = 0  # hybrid models: the snapshot slot to copy into state_slot before its next step
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache (or being written by a launched step)
        self.num_pending_tokens = 0  # sampled on device in a launched step, not yet seen by the host
        self.last_row: int | None = None  # row of this sequence in the most recently launched step
        self.in_flight_drafts: list[int] = []  # the drafts its last launched sampling row verifies
        self.kept_all_drafts = True  # whether the last verify row read back kept every draft
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache on first admission
        self.admitted_once = False
        self.parent = parent  # for n > 1: samples after the first wait for its prompt
        self.eos_ids_for_min_tokens = list(eos_ids_for_min_tokens)  # banned until min_tokens are out (EOS + stop ids)
        self.matcher = matcher  # structured outputs: the grammar matcher of the tokens so far (llguidance)
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
        self.detokenizer = detokenizer
        self.text = ""
        self.emitted_text_len = 0  # text, token ids and logprobs handed out in outputs so far
        self.emitted_token_len = 0
        self.stop_checked_len = 0  # text searched for stop strings (none ends inside it)
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

    # ---- scheduling: admission, pages, preemption, finish -----------------------------------
    def admit(self, pages: list[int], num_computed_tokens: int, page_keys=(), group_pages: list[list[int]] | None = None,
              state_slot: int = 0, restore_from: int = 0) -> None:
        """Start running with these page tables (one reference each, taken by the caller), the first
        num_computed_tokens' K/V already in them (a prefix-cache hit), the keys of the hit's pages, and a
        hybrid model's state slot and the snapshot to restore into it. The first admission records the
        hit as the prompt tokens served from the cache."""
        self._expect(SeqStatus.WAITING, "admit")
        if not 0 <= num_computed_tokens < self.num_tokens:
            raise SequenceStateError(f"seq {self.seq_id}: admitted with {num_computed_tokens} computed tokens of "
                                     f"{self.num_tokens}: at least one must be left to compute")
        self._start_running(pages, num_computed_tokens, list(page_keys), group_pages)
        self.state_slot, self.restore_from = state_slot, restore_from
        if not self.admitted_once:
            self.num_cached_tokens = num_computed_tokens
            self.admitted_once = True

    def resume(self, pages: list[int], num_computed_tokens: int) -> None:
        """Start running with pages whose first num_computed_tokens' K/V another engine computed
        (disaggregated.py); the sequence counts as admitted, none of its tokens as served from the cache."""
        self._expect(SeqStatus.WAITING, "resume")
        if not 0 <= num_computed_tokens < self.num_tokens:
            raise SequenceStateError(f"seq {self.seq_id}: resumed with {num_computed_tokens} computed tokens of "
                                     f"{self.num_tokens}: at least one must be left to compute")
        self._start_running(pages, num_computed_tokens, [], None)
        self.admitted_once = True

    def _start_running(self, pages, num_computed_tokens, page_keys, group_pages) -> None:
        if len(page_keys) > len(pages):
            raise SequenceStateError(f"seq {self.seq_id}: {len(page_keys)} prefix keys for {len(pages)} pages")
        group_pages = [list(t) for t in group_pages] if group_pages is not None else []
        if any(len(t) != len(pages) for t in group_pages):
            raise SequenceStateError(f"seq {self.seq_id}: page tables of unequal lengths")
        self.pages, self.group_pages, self.page_keys = list(pages), group_pages, page_keys
        self._table_arrays = None
        self.num_computed_tokens = num_computed_tokens
        self.status = SeqStatus.RUNNING

    def add_pages(self, pages: list[int], group_pages: list[list[int]] = ()) -> None:
        """Grow the page tables (group 0's by `pages`, group g's by group_pages[g - 1]) by one length."""
        self._expect(SeqStatus.RUNNING, "add pages to")
        if len(group_pages) != len(self.group_pages) or any(len(t) != len(pages) for t in group_pages):
            raise SequenceStateError(f"seq {self.seq_id}: every page table grows by the same number of pages")
        self.pages.extend(pages)
        for table, new in zip(self.group_pages, group_pages):
            table.extend(new)
        self._table_arrays = None

    def drop_window_pages(self, group: int, end: int) -> list[int]:
        """Null out group `group`'s entries before `end` (pages its window no longer sees); returns the
        pages dropped, latest first, whose references the caller releases."""
        self._expect(SeqStatus.RUNNING, "drop pages of")
        table = self.pages if group == 0 else self.group_pages[group - 1]
        self._table_arrays = None
        dropped = []
        for i in range(min(end, len(table)) - 1, -1, -1):  # the null entries are a leading run
            if table[i] == NULL_PAGE:
                break
            dropped.append(table[i])
            table[i] = NULL_PAGE
        return dropped

    def page_tables(self) -> list[np.ndarray]:
        """The page tables, group 0's then each of group_pages', as int32 arrays (not to be written to)."""
        if self._table_arrays is None:
            self._table_arrays = [np.asarray(t, np.int32) for t in (self.pages, *self.group_pages)]
        return self._table_arrays

    def add_page_keys(self, keys: list[bytes]) -> None:
        """The prefix keys of the next full pages, published by the block manager."""
        if len(self.page_keys) + len(keys) > len(self.pages):
            raise SequenceStateError(f"seq {self.seq_id}: more prefix keys than pages")
        self.page_keys.extend(keys)

    def preempt(self) -> None:
        """Stop running and drop every computed token, page and slot (released by the caller first); it
        waits to be admitted again and recomputed."""
        self._expect(SeqStatus.RUNNING, "preempt")
        self._drop_resources()
        self.num_computed_tokens = 0
        self.last_row = None
        self.status = SeqStatus.WAITING

    def finish(self) -> None:
        """Leave the engine (finished or aborted), its pages and slot released by the caller first."""
        if self.status is SeqStatus.FINISHED:
            raise SequenceStateError(f"seq {self.seq_id}: finished twice")
        self._drop_resources()
        self.status = SeqStatus.FINISHED

    def _drop_resources(self) -> None:
        self.pages, self.page_keys = [], []
        self.group_pages = [[] for _ in self.group_pages]
        self._table_arrays = None
        self.state_slot = self.restore_from = 0

    # ---- steps: launch, fetch, rollback ------------------------------------------------------
    def state_restored(self) -> None:
        """The snapshot named by restore_from is copied into its state slot (enqueued before its step)."""
        self.restore_from = 0

    def launched(self, num_computed_tokens: int, row: int | None, drafts: list[int] = ()) -> None:
        """A step is launched that computes its tokens up to num_computed_tokens and, with a `row`, samples
        its next token on device in that row, after verifying `drafts`."""
        self._expect(SeqStatus.RUNNING, "launch")
        if num_computed_tokens < self.num_computed_tokens:
            raise SequenceStateError(f"seq {self.seq_id}: a launch lowers its computed tokens "
                                     f"({self.num_computed_tokens} -> {num_computed_tokens})")
        self.num_computed_tokens = num_computed_tokens
        if row is not None:
            self.num_pending_tokens += 1
            self.last_row = row
            self.in_flight_drafts = drafts  # the scheduled row's list, never changed after its launch

    def fetched(self) -> None:
        """The host has the token a launched step sampled for it (appended next, unless it finished)."""
        if self.num_pending_tokens <= 0:
            raise SequenceStateError(f"seq {self.seq_id}: fetched a token no step sampled")
        self.num_pending_tokens -= 1

    def roll_back_to(self, num_computed_tokens: int) -> None:
        """Rejected drafts: only the first num_computed_tokens' K/V belong to the sequence (the rest are
        overwritten later). A sequence preempted since the launch has nothing left to roll back."""
        if self.status is SeqStatus.WAITING:
            return
        self._expect(SeqStatus.RUNNING, "roll back")
        if not 0 <= num_computed_tokens <= self.num_computed_tokens:
            raise SequenceStateError(f"seq {self.seq_id}: rolled back from {self.num_computed_tokens} to "
                                     f"{num_computed_tokens} computed tokens")
        self.num_computed_tokens = num_computed_tokens

    def drafts_verified(self, kept_all: bool) -> None:
        """A verify row is read back: it kept every draft, or rejected one."""
        self.kept_all_drafts = kept_all

    def discard_row_ahead(self, num_computed_tokens: int) -> None:
        """The verify row just read back rejected a draft, so the row launched after it, drafted ahead as if
        it kept them all, stands at the wrong positions: only the first num_computed_tokens' K/V belong to
        the sequence, and the later row's token is never fetched."""
        self._expect(SeqStatus.RUNNING, "discard the row ahead of")
        if self.num_pending_tokens != 1:
            raise SequenceStateError(f"seq {self.seq_id}: a row ahead is discarded with {self.num_pending_tokens} "
                                     "tokens pending (the row ahead's alone is)")
        self.roll_back_to(num_computed_tokens)
        self.num_pending_tokens = 0
        self.last_row = None
        self.in_flight_drafts = []

    def set_drafts(self, drafts: list[int] | None) -> None:
        """A device proposer's drafts after its known tokens (None: it has none)."""
        if drafts is None:
            self.draft_tokens, self.drafts_follow = [], -1
        else:
            self.draft_tokens, self.drafts_follow = drafts, len(self.prompt_token_ids) + len(self.output_token_ids)

    # ---- output ----------------------------------------------------------------------------
    def append_token(self, token: int, now: float, logprobs: dict[int, float] | None = None, logprob: float = 0.0) -> None:
        """One output token the host has, at time `now`, with its logprobs entry when they are asked."""
        if self.finish_reason is not None:
            raise SequenceStateError(f"seq {self.seq_id}: a token after its finish ({self.finish_reason})")
        self.output_token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        if logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprob

    def take_logprobs(self, logprobs: list[dict[int, float]], cumulative_logprob: float) -> None:
        """The logprobs of the tokens another engine sampled for it (disaggregated.py)."""
        self.logprobs, self.cumulative_logprob = list(logprobs), cumulative_logprob

    def stop(self, reason: str, stop_reason: str | int | None = None) -> None:
        """Decide to finish ("stop", "length", "abort", "error"), with the stop string or token that did it;
        the engine then finishes it (`finish`)."""
        if self.finish_reason is not None:
            raise SequenceStateError(f"seq {self.seq_id}: stopped twice ({self.finish_reason}, then {reason})")
        self.finish_reason, self.stop_reason = reason, stop_reason

    def _expect(self, status: SeqStatus, what: str) -> None:
        if self.status is not status:
            raise SequenceStateError(f"cannot {what} seq {self.seq_id}: it is {self.status.value}, not {status.value}")
