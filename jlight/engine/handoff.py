"""The two halves of a prefill -> decode handoff, each over its own LLMEngine: disaggregated.py joins them in one
process, disaggregated_roles.py runs each in its own process (as vLLM's and SGLang's PD disaggregation).

PrefillHalf runs a request's prompt on the prefill engine with max_tokens 1 and the request's own seed (the caller
fixes one, so both halves sample alike), and keeps its pages past that finish (`LLMEngine.kv_exports`). A finished
prefill becomes a Handoff that holds them, or, when its first token ends the request (EOS, a stop, max_tokens 1, the
context), the request's final output with its pages released.

DecodeHalf continues Handoffs on the decode engine:
  1. queued, in arrival order, until the decode engine has a free row and pages for the prompt;
  2. start: it reserves those pages and its PageMover dispatches the move of the prompt's K/V (never awaited);
  3. land: a later step finds the move ready (polled), writes it into the reserved pages, and the decode engine
     adopts the request (`LLMEngine.adopt_request`) with its first token, so it goes on with the tokens one engine
     would give.
Invariants: a handoff holds its reserved decode pages from start until it lands, fails or is aborted, and each of
those releases them; the mover hears of each end (`PageMover.done`), so the source side frees its pages too. A move
that fails (at start or when polled) adopts the request without pages: the decode engine recomputes the prompt,
keeping the first token, as after a preemption; its output (the first token) is returned like a landing's.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Protocol

import jax

from jlight.engine.llm_engine import LLMEngine
from jlight.engine.model_runner import padded_pages
from jlight.engine.outputs import RequestOutput
from jlight.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Handoff:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams  # the request's own (max_tokens and all), with its seed fixed
    arrival_time: float
    first: RequestOutput  # the prefill's finished output: the first token (and its logprobs when asked)
    num_pages: int  # pages the prompt's K/V fill
    source: list[int] = dataclasses.field(default_factory=list)  # the prefill pages, when in this process
    transfer_id: str | None = None  # the prefill process's name for them, when in another (disaggregated_roles.py)
    dest: list[int] | None = None  # decode pages, reserved at start
    moved: object = None  # the move in flight: the pages' K/V on their way to the decode devices
    ticket: object = None  # the mover's own record of the move


class PageMover(Protocol):
    """Moves a Handoff's K/V from wherever the prefill holds them onto the decode engine's devices."""

    def start(self, h: Handoff) -> object:
        """Dispatch the move of h's prompt pages (read_pages' form, padded_pages' count, on the decode pools'
        shardings); returns the data in flight. Raises if it cannot start."""

    def ready(self, h: Handoff) -> bool:
        """Whether h.moved has arrived (never waits); raises if the move failed."""

    def done(self, h: Handoff) -> None:
        """h landed, failed or was aborted: the source may free its pages (called once per handoff)."""


class PrefillHalf:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.prefilling: dict[str, Handoff] = {}  # request id -> its handoff, while the prompt runs

    def add(self, request_id: str, prompt: str | None, params: SamplingParams, prompt_token_ids: list[int],
            arrival_time: float | None) -> None:
        """Run the prompt and sample the first token (`params` has its seed fixed); its pages are kept."""
        first_only = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        self.engine.kv_exports[request_id] = None
        self.engine.add_request(request_id, prompt, first_only, prompt_token_ids, arrival_time)
        self.prefilling[request_id] = Handoff(request_id, prompt, prompt_token_ids, params,
                                              self.engine.requests[request_id].arrival_time, None, 0)

    def finished(self, out: RequestOutput) -> Handoff | None:
        """A finished prefill (out.finished, out.request_id in `prefilling`) as a Handoff holding its pages; None
        when its first token ends the request: `out` is then its final output and its pages are released."""
        h = self.prefilling.pop(out.request_id)
        h.first, h.source = out, self.engine.kv_exports.pop(out.request_id) or []
        h.num_pages = len(h.source)
        c = out.outputs[0]
        more = h.params.max_tokens is None or h.params.max_tokens > 1
        if c.finish_reason == "length" and more and len(h.prompt_token_ids) + 1 < self.engine.max_model_len:
            return h
        self.release(h)
        return None

    def release(self, h: Handoff) -> None:
        self.engine.block_manager.release(h.source)
        h.source = []

    def abort(self, request_id: str) -> RequestOutput | None:
        if self.prefilling.pop(request_id, None) is None:
            return None
        self.engine.kv_exports.pop(request_id, None)
        return self.engine.abort_request(request_id)


class DecodeHalf:
    def __init__(self, engine: LLMEngine, mover: PageMover):
        self.engine, self.mover = engine, mover
        self.queued: list[Handoff] = []  # waiting for room on the decode engine
        self.moving: list[Handoff] = []  # move dispatched, not landed
        self.num_transfers = 0  # moves started
        self.num_transfer_failures = 0  # moves that failed (recomputed)
        self.num_landed = 0
        self.adopted = self.adopted_prompt_tokens = 0

    @property
    def handoffs(self) -> list[Handoff]:
        return self.queued + self.moving

    def offer(self, h: Handoff) -> None:
        self.queued.append(h)

    def start(self) -> list[RequestOutput]:
        """Start the moves of queued handoffs while the decode engine has room; returns the outputs of those
        that failed to start (adopted without pages)."""
        decode, bm, outputs = self.engine, self.engine.block_manager, []
        while self.queued:
            h = self.queued[0]
            busy = len(decode.scheduler.running) + len(decode.scheduler.waiting) + len(self.moving)
            if busy >= decode.config.max_num_seqs or bm.num_free_pages < h.num_pages:
                break  # waits for room on the decode side; its source pages stay held
            self.queued.pop(0)
            h.dest = bm.allocate(h.num_pages)
            self.num_transfers += 1
            try:
                h.moved = self.mover.start(h)
            except Exception as e:  # a failed move loses nothing: the decode side recomputes
                outputs.append(self._failed(h, e))
                continue
            self.moving.append(h)
        return outputs

    def land(self) -> list[RequestOutput]:
        """Adopt the handoffs whose moves arrived (each started in an earlier step); returns their outputs."""
        outputs = []
        for h in list(self.moving):
            try:
                if not self.mover.ready(h):
                    continue
            except Exception as e:
                self.moving.remove(h)
                outputs.append(self._failed(h, e))
                continue
            self.moving.remove(h)
            tier = self.engine.block_manager.host_tier
            if tier is not None:  # pages that reserving dest evicted go to host before they are overwritten
                tier.sync(self.engine.runner)
            self.engine.runner.write_pages(padded_pages(h.dest), h.moved)
            self.num_landed += 1
            self.mover.done(h)
            outputs.append(self._adopt(h, h.dest))
        return outputs

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a queued or moving handoff, releasing its pages on both sides; its output ends with "abort"."""
        for waiting in (self.queued, self.moving):
            for h in waiting:
                if h.request_id == request_id:
                    waiting.remove(h)
                    self._release(h)
                    for c in h.first.outputs:  # nothing of it was handed out: the deltas are all of it
                        c.finish_reason = "abort"
                    return h.first
        return None

    def adopt_without_pages(self, h: Handoff) -> RequestOutput:
        """Continue h on the decode engine by recomputing its prompt (no move at all)."""
        self.mover.done(h)
        return self._adopt(h, None)

    def _failed(self, h: Handoff, error: Exception) -> RequestOutput:
        logger.warning("KV transfer of request %s failed (%s); recomputing its prompt on the decode side", h.request_id, error)
        self.num_transfer_failures += 1
        self._release(h)
        return self._adopt(h, None)

    def _adopt(self, h: Handoff, pages) -> RequestOutput:
        c = h.first.outputs[0]
        self.adopted_prompt_tokens += len(h.prompt_token_ids)
        self.adopted += 1
        return self.engine.adopt_request(h.request_id, h.first.prompt, h.prompt_token_ids, h.params, c.token_ids[0],
                                         h.arrival_time, pages=pages, logprobs=c.logprobs,
                                         cumulative_logprob=c.cumulative_logprob or 0.0)

    def _release(self, h: Handoff) -> None:
        if h.dest is not None:
            self.engine.block_manager.release(h.dest)
        self.mover.done(h)
        h.dest, h.moved = None, None


def moved_ready(moved) -> bool:
    """Whether every array of a move has arrived (never waits); raises if one failed."""
    if not all(a.is_ready() for a in jax.tree.leaves(moved)):
        return False
    jax.block_until_ready(moved)  # ready: raises only if the copy failed
    return True
