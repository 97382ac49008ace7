"""Disaggregated prefill and decode in one process: a prefill engine and a decode engine on disjoint
groups of devices, each with its own mesh, KV pool and scheduler, behind LLMEngine's interface
(add_request / step / abort_request / stats), as vLLM's and SGLang's PD disaggregation.

A request (n == 1, no prompt logprobs) goes to the prefill engine, which computes its prompt and
samples its first token (max_tokens 1, the request's own seed); its pages outlive that finish (the
engine's `kv_exports`). Then:
  1. handoff: the coordinator waits until the decode engine has a free row and pages for the prompt,
     reserves those pages, reads the prefill pages (`ModelRunner.read_pages`) and copies them to the
     decode devices with `transfer` (jax.device_put onto the decode pools' shardings: a device-to-device
     copy, dispatched, not awaited);
  2. landing: a later step (the next at the earliest) finds the copy ready (polled, never waited for), writes it into the reserved
     pages and the decode engine adopts the request (`LLMEngine.adopt_request`) with its first token, so
     it goes on from where the prefill left it, with the tokens one engine would give.
A request in transfer holds pages on both sides, the prefill pages (the source) and the reserved decode
pages (the destination); landing, a failure or an abort releases both. A failed transfer (the copy
raises, at dispatch or when polled) hands the request to the decode engine without pages: it recomputes
the prompt there, keeping the first token. A request whose first token ends it (EOS, a stop, max_tokens 1,
the context) finishes on the prefill side. Requests with n > 1 or prompt logprobs run wholly on the
decode engine.
Both engines must lay out pages alike (page size, KV dtype, per-page shapes) and share max_model_len.
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid

import jax
import numpy as np

from jlight import loading  # loading.load_model is looked up at each call (tests wrap it)
from jlight.engine.engine_config import EngineConfig
from jlight.engine.llm_engine import EngineStats, LLMEngine
from jlight.engine.model_runner import padded_pages
from jlight.engine.outputs import RequestOutput
from jlight.engine.sampling_params import SamplingParams
from jlight.models import get_model_family

logger = logging.getLogger(__name__)


def parse_disaggregated(spec: str) -> tuple[int, int]:
    """'prefill=4,decode=4' -> (4, 4): devices for each role (tensor parallel within a group of more than one)."""
    sizes = {}
    for part in spec.split(","):
        role, _, count = part.partition("=")
        if role.strip() not in ("prefill", "decode") or not count.strip().isdigit() or int(count) < 1:
            raise ValueError(f"disaggregated={spec!r} is invalid: give 'prefill=N,decode=M' (devices for each role)")
        sizes[role.strip()] = int(count)
    if set(sizes) != {"prefill", "decode"}:
        raise ValueError(f"disaggregated={spec!r} is invalid: name both roles, as in 'prefill=1,decode=1'")
    return sizes["prefill"], sizes["decode"]


def device_put_tree(data, shardings):
    """The default transfer: each array onto its sharding (None stays None)."""
    return jax.tree.map(lambda a, s: None if a is None else jax.device_put(a, s), data, shardings,
                        is_leaf=lambda x: x is None)


@dataclasses.dataclass
class _Handoff:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # the request's own
    arrival_time: float
    first: RequestOutput  # the prefill side's (finished) output: the first token
    source: list[int]  # prefill pages, held for the transfer
    dest: list[int] | None = None  # decode pages, reserved when the copy starts
    moved: object = None  # the copy on the decode devices (read_pages' form)


class DisaggregatedEngine:
    def __init__(self, prefill: LLMEngine, decode: LLMEngine, transfer=device_put_tree):
        """`transfer(data, shardings) -> data on the decode devices`: the copy (tests inject failures here)."""
        _check_alike(prefill, decode)
        self.prefill, self.decode, self.transfer = prefill, decode, transfer
        self.config = decode.config
        self.tokenizer, self.model_config = decode.tokenizer, decode.model_config
        self.max_model_len, self.model_name = decode.max_model_len, decode.model_name
        self.warmup_seconds = prefill.warmup_seconds + decode.warmup_seconds
        if decode.config.warmup:
            self.warmup_seconds += self._warmup_transfers()
        self._prefilling: dict[str, _Handoff] = {}  # on the prefill engine (source pages not yet known)
        self._queued: list[_Handoff] = []  # prefill done, waiting for room on the decode side
        self._moving: list[_Handoff] = []  # copy dispatched, not landed
        self._rng = np.random.default_rng(decode.config.seed)
        self.num_transfers = 0
        self.num_transfer_failures = 0
        self._adopted_prompt_tokens = self._adopted = 0  # counted by both engines; stats() counts them once

    def _warmup_transfers(self) -> float:
        """Compile the handoff's gather (prefill side) and scatter (decode side) for every power-of-two page count
        a prompt can take."""
        t0 = time.perf_counter()
        self.prefill.runner.warmup_page_copies(self.prefill.runner.max_pages_per_seq, kinds=("read",))
        self.decode.runner.warmup_page_copies(self.decode.runner.max_pages_per_seq, kinds=("write",))
        return time.perf_counter() - t0

    def _decode_shardings(self):
        return jax.tree.map(lambda a: a.sharding, (self.decode.runner.k_cache, self.decode.runner.v_cache))

    @classmethod
    def from_config(cls, config: EngineConfig, transfer=device_put_tree) -> "DisaggregatedEngine":
        """Engines on the first N devices (prefill) and the next M (decode), from config.disaggregated."""
        num_prefill, num_decode = parse_disaggregated(config.disaggregated)
        devices = jax.devices()
        if num_prefill + num_decode > len(devices):
            raise ValueError(f"disaggregated={config.disaggregated!r} needs {num_prefill + num_decode} devices; "
                             f"there are {len(devices)}")
        loaded = loading.load_model(config.model, dtype=config.dtype)  # once; each engine copies it to its devices
        if hasattr(get_model_family(loaded.config), "state_shapes"):
            raise ValueError(f"disaggregated={config.disaggregated!r}: the handoff moves K/V pages, not "
                             f"{loaded.config.architecture}'s recurrent state; leave disaggregated unset")
        engines = []
        for group in (devices[:num_prefill], devices[num_prefill:num_prefill + num_decode]):
            mesh = f"tp={len(group)}" if len(group) > 1 else None
            # The handoff moves one page table a request: the one-group pool (every page kept).
            engines.append(LLMEngine(dataclasses.replace(config, mesh=mesh, disaggregated=None, disable_hybrid_kv_cache_manager=True),
                                     loaded=loaded, devices=group))
        return cls(*engines, transfer=transfer)

    # ---- requests ---------------------------------------------------------------------------
    @property
    def requests(self) -> dict:
        return {**self.prefill.requests, **self.decode.requests,
                **{h.request_id: h for h in self._queued + self._moving}}

    def validate_request(self, *args, **kwargs):
        return self.decode.validate_request(*args, **kwargs)

    def add_request(self, request_id: str | None, prompt: str | None, sampling_params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None) -> str:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; give each request a unique id")
        ids, params = self.validate_request(prompt, sampling_params, prompt_token_ids)
        if params.seed is None:  # one seed for both sides, so the decode side samples as one engine would
            params = dataclasses.replace(params, seed=int(self._rng.integers(0, 2**31)))
        if params.n > 1 or params.prompt_logprobs is not None:
            return self.decode.add_request(request_id, prompt, params, ids, arrival_time)
        first_only = dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1))
        self.prefill.kv_exports[request_id] = None
        self.prefill.add_request(request_id, prompt, first_only, ids, arrival_time)
        self._prefilling[request_id] = _Handoff(request_id, ids, params, self.prefill.requests[request_id].arrival_time,
                                                None, [])
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; one in transfer frees its pages on both sides."""
        if request_id in self._prefilling:
            del self._prefilling[request_id]
            self.prefill.kv_exports.pop(request_id, None)
            return self.prefill.abort_request(request_id)
        for waiting in (self._queued, self._moving):
            for h in waiting:
                if h.request_id == request_id:
                    waiting.remove(h)
                    self._release(h)
                    for c in h.first.outputs:  # nothing of it was handed out: the deltas are all of it
                        c.finish_reason = "abort"
                    return h.first
        return self.decode.abort_request(request_id)

    def abort_all(self) -> list[str]:
        ids = [rid for rid in list(self._prefilling) + [h.request_id for h in self._queued + self._moving]]
        for rid in ids:
            self.abort_request(rid)
        return ids + self.prefill.abort_all() + self.decode.abort_all()

    def has_unfinished_requests(self) -> bool:
        return bool(self._queued or self._moving) or self.prefill.has_unfinished_requests() or self.decode.has_unfinished_requests()

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = []
        if self.prefill.has_unfinished_requests():
            for out in self.prefill.step():
                if out.finished:
                    outputs += self._prefill_done(out)
        outputs += self._land_transfers()  # copies started in an earlier step: each has had a step to run
        self._start_transfers()
        if self.decode.has_unfinished_requests():
            outputs += self.decode.step()
        return outputs

    def _prefill_done(self, out: RequestOutput) -> list[RequestOutput]:
        h = self._prefilling.pop(out.request_id)
        h.first, h.source = out, self.prefill.kv_exports.pop(out.request_id) or []
        c = out.outputs[0]
        more = h.params.max_tokens is None or h.params.max_tokens > 1
        if c.finish_reason == "length" and more and len(h.prompt_token_ids) + 1 < self.max_model_len:
            self._queued.append(h)
            return []
        self.prefill.block_manager.release(h.source)  # its first token ended it: the prefill's output is final
        return [out]

    def _start_transfers(self) -> None:
        decode, bm = self.decode, self.decode.block_manager
        while self._queued:
            h = self._queued[0]
            busy = len(decode.scheduler.running) + len(decode.scheduler.waiting) + len(self._moving)
            if busy >= decode.config.max_num_seqs or bm.num_free_pages < len(h.source):
                return  # waits for the decode side to have room; its prefill pages stay held
            self._queued.pop(0)
            h.dest = bm.allocate(len(h.source))
            self.num_transfers += 1
            try:
                data = self.prefill.runner.read_pages(padded_pages(h.source))
                h.moved = self.transfer(data, self._decode_shardings())
            except Exception as e:  # a failed copy loses nothing: the decode side recomputes
                self._failed(h, e)
                continue
            self._moving.append(h)

    def _land_transfers(self) -> list[RequestOutput]:
        outputs = []
        for h in list(self._moving):
            try:
                if not all(a.is_ready() for a in jax.tree.leaves(h.moved)):
                    continue
                jax.block_until_ready(h.moved)  # ready: raises only if the copy failed
            except Exception as e:
                self._moving.remove(h)
                outputs.append(self._failed(h, e))
                continue
            self._moving.remove(h)
            tier = self.decode.block_manager.host_tier
            if tier is not None:  # pages that reserving dest evicted go to host before they are overwritten
                tier.sync(self.decode.runner)
            self.decode.runner.write_pages(padded_pages(h.dest), h.moved)
            self.prefill.block_manager.release(h.source)
            outputs.append(self._adopt(h, h.dest))
        return outputs

    def _failed(self, h: _Handoff, error: Exception) -> RequestOutput:
        logger.warning("KV transfer of request %s failed (%s); recomputing its prompt on the decode side", h.request_id, error)
        self.num_transfer_failures += 1
        self._release(h)
        return self._adopt(h, None)

    def _adopt(self, h: _Handoff, pages) -> RequestOutput:
        c = h.first.outputs[0]
        self._adopted_prompt_tokens += len(h.prompt_token_ids)
        self._adopted += 1
        return self.decode.adopt_request(h.request_id, h.first.prompt, h.prompt_token_ids, h.params, c.token_ids[0], h.arrival_time,
                                         pages=pages, logprobs=c.logprobs, cumulative_logprob=c.cumulative_logprob or 0.0)

    def _release(self, h: _Handoff) -> None:
        self.prefill.block_manager.release(h.source)
        if h.dest is not None:
            self.decode.block_manager.release(h.dest)
        h.source, h.dest, h.moved = [], None, None

    def warmup_for_one_request(self, prompt_len: int) -> float:
        """Each side's buckets for one request of prompt_len tokens (an engine built with warmup=False)."""
        return self.prefill.warmup_for_one_request(prompt_len) + self.decode.warmup_for_one_request(prompt_len)

    def run_to_completion(self) -> None:
        while self.has_unfinished_requests():
            self.step()

    def stats(self) -> EngineStats:
        """Both engines' counters; a handed-over request's prompt and first token are counted once."""
        s = EngineStats.combine([self.prefill.stats(), self.decode.stats()])
        return dataclasses.replace(
            s, num_waiting=s.num_waiting + len(self._queued) + len(self._moving),
            prompt_tokens_total=s.prompt_tokens_total - self._adopted_prompt_tokens,
            generation_tokens_total=s.generation_tokens_total - self._adopted)


def _check_alike(prefill: LLMEngine, decode: LLMEngine) -> None:
    def layout(engine):
        pools = (engine.runner.k_cache, engine.runner.v_cache)
        return jax.tree.map(lambda a: (a.shape[0],) + a.shape[2:] + (str(a.dtype),), pools)
    if prefill.config.page_size != decode.config.page_size:
        raise ValueError(f"page_size differs between prefill ({prefill.config.page_size}) and decode "
                         f"({decode.config.page_size}); give both one page size")
    if layout(prefill) != layout(decode):
        raise ValueError(f"the KV pages of prefill {layout(prefill)} and decode {layout(decode)} differ (KV dtype, or KV "
                         "heads replicated to a different tp); give both sides the same kv_cache_dtype and KV layout")
    if prefill.max_model_len != decode.max_model_len:
        raise ValueError(f"max_model_len differs between prefill ({prefill.max_model_len}) and decode ({decode.max_model_len})")
