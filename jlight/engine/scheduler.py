"""Scheduler: decides which tokens run in each step.

Each step is one ragged batch under a token budget (`max_num_batched_tokens`) and a row
budget (`max_num_seqs`). Running sequences go first (decode tokens and the next chunk of
unfinished prompts), then waiting ones are admitted first-come-first-served, with their
prompts cut into chunks that fit the budget. When pages run out, the most recently
admitted running sequence is preempted: its pages are released and it is recomputed later
(its full pages usually survive in the prefix cache).
A model whose layers differ in attention kind keeps a page table per KV group (`kv_groups`,
kv_groups.py): each step first gives back the pages a sliding window no longer sees, and every
count of pages (growing a row, admitting a prompt) is the sum over the groups.
"""
from __future__ import annotations

import collections
import dataclasses

from jlight.engine.block_manager import BlockManager
from jlight.engine.kv_groups import KVGroupPages
from jlight.engine.sequence import SeqStatus, Sequence
from jlight.engine.speculative import SpeculativeConfig
from jlight.engine.state_pool import StatePool


@dataclasses.dataclass
class ScheduledSeq:
    seq: Sequence
    start: int  # first position computed this step
    num_tokens: int  # tokens computed this step (a speculating row: its last token and the drafts)
    samples: bool  # the chunk reaches the end of the known tokens, so a token is sampled
    drafts: list[int] = dataclasses.field(default_factory=list)  # tokens proposed after the last known one
    # Drafted ahead (speculative.py): the row starts at the token its sequence's row in flight samples last, taken
    # from the device, as if that row keeps every draft; `discarded` once it turns out not to.
    ahead: bool = False
    discarded: bool = False


@dataclasses.dataclass
class SchedulePlan:
    rows: list[ScheduledSeq]
    preempted: list[Sequence]
    speculating: bool = False  # the running batch was small enough to speculate (disable_by_batch_size)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 speculative: SpeculativeConfig | None = None, state_pool: StatePool | None = None,
                 kv_groups: KVGroupPages | None = None, proposer=None, draft_ahead: bool = False):
        """speculative, proposer: speculative decoding's config and its proposer (proposers/base.Proposer), or None;
        draft_ahead: rows drafted ahead of the step in flight (the proposer's `drafts_after`, speculative.py)."""
        self.bm = block_manager
        self.kv_groups = kv_groups  # None: one page table a sequence, every page kept (no attention kinds)
        self.state_pool = state_pool  # hybrid models: a sequence holds a state slot while it runs
        self.speculative = speculative
        self.proposer = proposer
        self.draft_ahead = draft_ahead
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []  # in admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _wants_tokens(self, seq: Sequence) -> bool:
        """False for sequences that cannot take another token (they finish when the host catches up)."""
        max_tokens = seq.params.max_tokens
        if seq.prefill_done and max_tokens is not None and seq.num_output_tokens >= max_tokens:
            return False
        return seq.num_computed_tokens < self.max_model_len and seq.num_tokens <= self.max_model_len

    def _ensure_pages(self, seq: Sequence, upto_tokens: int) -> bool:
        if self.kv_groups is not None:  # windows from the first position not known to be computed (a row ahead may
            # stand past it: speculative.py)
            first = min(seq.num_computed_tokens, seq.num_tokens - seq.num_pending_tokens)
            return self.kv_groups.ensure_pages(seq, first, upto_tokens)
        need = self.bm.pages_needed(upto_tokens) - len(seq.pages)
        if need <= 0:
            return True
        if self.bm.num_free_pages < need:
            return False
        seq.add_pages(self.bm.allocate(need))
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.preempt()
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> SchedulePlan:
        rows: list[ScheduledSeq] = []
        preempted: list[Sequence] = []
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        # 1. Running sequences, oldest first: decode tokens before prompt chunks, so a long
        #    prompt never holds back the sequences that are already generating.
        decoding = [s for s in self.running if s.prefill_done]
        prefilling = [s for s in self.running if not s.prefill_done]
        spec = self._speculation()
        for seq in decoding + prefilling:
            if seq.status is not SeqStatus.RUNNING or budget == 0 or len(rows) >= self.max_num_seqs:
                continue
            if not self._wants_tokens(seq):
                continue
            if seq.matcher is not None and seq.num_pending_tokens:
                continue  # its allowed tokens depend on the one the device is still sampling (structured_output.py)
            speculating = spec is not None and seq.prefill_done and speculates(seq)
            if speculating and seq.num_pending_tokens:
                if not self.drafts_ahead(seq):
                    continue  # its drafts follow the token the device is still sampling (waits_for_step)
                row = self._row_ahead(seq, spec, budget)
                if row is not None and self._fit(seq, row.start + row.num_tokens, scheduled_ids, preempted):
                    rows.append(row)
                    scheduled_ids.add(seq.seq_id)
                    budget -= row.num_tokens
                continue
            start = seq.num_computed_tokens
            n = self._chunk(seq, start, min(seq.num_tokens - start, budget))
            drafts = self._drafts(seq, spec, budget - n) if speculating and n == 1 else []
            n += len(drafts)
            if not self._fit(seq, start + n, scheduled_ids, preempted):
                continue
            samples = start + n - len(drafts) == seq.num_tokens
            rows.append(ScheduledSeq(seq, start, n, samples, drafts))
            scheduled_ids.add(seq.seq_id)
            budget -= n
            if spec is not None and samples and speculates(seq):
                self._reserve_lookahead(seq, start + n)

        # 2. Waiting sequences, first come first served; never preempt running ones for them.
        skipped: list[Sequence] = []
        while self.waiting and budget > 0 and len(rows) < self.max_num_seqs and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens or (seq.parent is not None and not seq.parent.prefill_done and not seq.parent.finished):
                # Just preempted with a token still on device: wait until the host has it.
                # n > 1: wait until the first sample's prompt pages are computed, then share them.
                skipped.append(self.waiting.popleft())
                continue
            tokens = seq.all_token_ids
            first_admission = not seq.admitted_once
            wants_prompt_logprobs = seq.params.prompt_logprobs is not None and not seq.admitted_once
            if self.kv_groups is not None:
                hit = self.kv_groups.match_prefix([] if wants_prompt_logprobs else tokens)
                start = hit.num_pages * self.bm.page_size
                n = min(len(tokens) - start, budget)
                if not self.kv_groups.can_admit(hit, start + n):
                    break
                self.waiting.popleft()
                self.kv_groups.admit(seq, hit, start + n)
            else:
                cached_pages, cached_keys = ([], []) if wants_prompt_logprobs else self.bm.match_prefix(tokens)
                restore = 0
                if self.state_pool is not None:  # only as far as a saved state reaches
                    k, restore = self.state_pool.usable_prefix(cached_keys)
                    cached_pages, cached_keys = cached_pages[:k], cached_keys[:k]
                start = len(cached_pages) * self.bm.page_size
                n = self._chunk(seq, start, min(len(tokens) - start, budget))
                need = self.bm.pages_needed(start + n) - len(cached_pages)
                if not self.bm.can_allocate(need, cached_pages):
                    break
                self.waiting.popleft()
                # A hybrid model's slot is never short (one per max_num_seqs); the engine copies the snapshot
                # `restore` into it before the step.
                slot = self.state_pool.allocate(seq.seq_id) if self.state_pool is not None else 0
                self.bm.acquire(cached_pages)
                seq.admit(cached_pages + self.bm.allocate(need), start, cached_keys, state_slot=slot, restore_from=restore)
            if first_admission:
                self.bm.record_prefix_query(len(tokens), start)
            self.running.append(seq)
            rows.append(ScheduledSeq(seq, start, n, start + n == len(tokens)))
            scheduled_ids.add(seq.seq_id)
            budget -= n
            if spec is not None and start + n == len(tokens) and speculates(seq):
                self._reserve_lookahead(seq, start + n)
        self.waiting.extendleft(reversed(skipped))
        return SchedulePlan(rows, preempted, spec is not None)

    def _fit(self, seq: Sequence, upto_tokens: int, scheduled_ids: set[int], preempted: list[Sequence]) -> bool:
        """Pages for a running sequence's tokens up to upto_tokens, preempting the most recently admitted
        sequences not yet scheduled this step while pages are short; False when it cannot run (it may be
        the one preempted)."""
        while not self._ensure_pages(seq, upto_tokens):
            victim = next((s for s in reversed(self.running) if s.seq_id not in scheduled_ids), None)
            if victim is None:
                break
            self.preempt(victim)
            preempted.append(victim)
            if victim is seq:
                break
        return seq.status is SeqStatus.RUNNING and len(seq.pages) * self.bm.page_size >= upto_tokens

    def drafts_ahead(self, seq: Sequence) -> bool:
        """Whether a speculating sequence with a token pending on the device gets a row drafted ahead of it
        (speculative.py): the proposer drafts ahead, one row is in flight, and that row verifies no drafts or
        the sequence's latest verify row kept all of its own."""
        return self.draft_ahead and seq.num_pending_tokens == 1 and (not seq.in_flight_drafts or seq.kept_all_drafts)

    def _row_ahead(self, seq: Sequence, spec: SpeculativeConfig, budget: int) -> ScheduledSeq | None:
        """The row drafted ahead for a sequence whose row in flight samples after its drafts: it starts at the
        position of the token sampled after the last of them and verifies the drafts that follow (None when
        the row in flight, keeping every draft, would end the sequence or leave it no room)."""
        start = seq.num_computed_tokens  # the row in flight computed up to its last draft
        outputs = seq.num_output_tokens + len(seq.in_flight_drafts)  # if the row in flight keeps every draft
        room = min(budget, self.max_model_len - start) - 1
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - outputs - 1)
        if room < 0:
            return None
        drafts = self.proposer.drafts_after(seq, seq.in_flight_drafts, min(room, spec.num_speculative_tokens)) if room else []
        return ScheduledSeq(seq, start, 1 + len(drafts), True, drafts, ahead=True)

    def _speculation(self) -> SpeculativeConfig | None:
        """The speculative config while the running batch is small enough to speculate, else None."""
        spec = self.speculative
        return spec if spec is not None and len(self.running) <= spec.disable_by_batch_size else None

    def waits_for_step(self) -> bool:
        """Whether a running sequence would speculate but for a token the device is still sampling: the
        next schedule leaves it out until the host has read the step in flight back (the engine reads
        that step first, llm_engine.py)."""
        if self._speculation() is None:
            return False
        return any(seq.status is SeqStatus.RUNNING and seq.prefill_done and seq.num_pending_tokens and speculates(seq)
                   and not self.drafts_ahead(seq) for seq in self.running)

    def _drafts(self, seq: Sequence, spec: SpeculativeConfig, budget: int) -> list[int]:
        """Drafts for a decoding sequence: as many as the step's budget, the context and max_tokens leave."""
        room = min(budget, spec.num_speculative_tokens, self.max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            room = min(room, seq.params.max_tokens - seq.num_output_tokens - 1)  # the row adds up to drafts + 1
        return self.proposer.drafts(seq, room) if room > 0 else []

    def _reserve_lookahead(self, seq: Sequence, end: int) -> None:
        """Pages for the positions a device proposer drafts into after a sampling row that ends at `end`
        (proposers/device.py), taken only from unused pages: without them its drafts are written to the
        scratch page and come out worse, never wrong."""
        lookahead = self.proposer.lookahead
        if lookahead and self.kv_groups is None:
            need = self.bm.pages_needed(min(end + lookahead, self.max_model_len)) - len(seq.pages)
            if need > 0:
                seq.add_pages(self.bm.allocate_unused(need))

    def resume(self, seq: Sequence, pages: list[int], num_computed_tokens: int) -> None:
        """Run a waiting sequence at once whose first num_computed_tokens' K/V are already in `pages` (its
        references; another engine computed them: disaggregated.py)."""
        self.waiting.remove(seq)
        seq.resume(pages, num_computed_tokens)
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted sequence and release its pages."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.finish()

    def _chunk(self, seq: Sequence, start: int, n: int) -> int:
        """n, or less so that a hybrid model's prompt chunk ends where its state is saved (state_pool.py)."""
        if self.state_pool is None or not self.bm.enable_prefix_caching:
            return n
        return self.state_pool.stop_at_snapshot(len(seq.prompt_token_ids), self.bm.page_size, start, n)

    def _release(self, seq: Sequence) -> None:
        """Drop the sequence's page references and its state slot (the sequence forgets them next)."""
        if self.kv_groups is not None:
            self.kv_groups.release(seq)
        else:
            self.bm.release(seq.pages)
        if self.state_pool is not None:
            self.state_pool.release(seq.state_slot)


def speculates(seq: Sequence) -> bool:
    """Whether a sequence may verify drafts: not when its sampling needs per-position state that the
    drafts would change (penalties over the token history, a grammar's matcher)."""
    p = seq.params
    return (seq.matcher is None and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0)
