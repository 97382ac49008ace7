"""Disaggregated prefill and decode in one process: a prefill engine and a decode engine on disjoint
groups of devices, each with its own mesh, KV pool and scheduler, behind LLMEngine's interface
(add_request / step / abort_request / stats), as vLLM's and SGLang's PD disaggregation.

A request (n == 1, no prompt logprobs) goes to the prefill engine, which computes its prompt and samples its first
token (handoff.PrefillHalf); its handoff then goes to the decode engine (handoff.DecodeHalf), whose mover here,
LocalMover, reads the prefill pages (`ModelRunner.read_pages`) and copies them to the decode devices with `transfer`
(jax.device_put onto the decode pools' shardings: a device-to-device copy, dispatched, not awaited). A request in
transfer holds pages on both sides, the prefill pages (the source) and the reserved decode pages (the
destination); landing, a failure or an abort releases both. A failed transfer (the copy raises, at dispatch or when
polled) hands the request to the decode engine without pages: it recomputes the prompt there, keeping the first
token. A request whose first token ends it finishes on the prefill side. Requests with n > 1 or prompt logprobs run
wholly on the decode engine.
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
from jlight.engine.handoff import DecodeHalf, Handoff, PrefillHalf, moved_ready
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


def pool_shardings(engine: LLMEngine):
    """The shardings of an engine's K/V pools (read_pages' tree, None for a pool without pages)."""
    return jax.tree.map(lambda a: a.sharding, (engine.runner.k_cache, engine.runner.v_cache))


class LocalMover:
    """handoff.PageMover within one process: gathers the prefill pages and copies them onto the decode pools'
    shardings with `transfer`; the source pages stay held until the handoff lands, fails or is aborted."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine, transfer):
        self.prefill, self.decode, self.transfer = prefill, decode, transfer

    def start(self, h: Handoff):
        data = self.prefill.runner.read_pages(padded_pages(h.source))
        return self.transfer(data, pool_shardings(self.decode))

    def ready(self, h: Handoff) -> bool:
        return moved_ready(h.moved)

    def done(self, h: Handoff) -> None:
        self.prefill.block_manager.release(h.source)
        h.source = []


class DisaggregatedEngine:
    def __init__(self, prefill: LLMEngine, decode: LLMEngine, transfer=device_put_tree):
        """`transfer(data, shardings) -> data on the decode devices`: the copy (tests inject failures here)."""
        _check_alike(prefill, decode)
        self.prefill, self.decode = prefill, decode
        self.config = decode.config
        self.tokenizer, self.model_config = decode.tokenizer, decode.model_config
        self.max_model_len, self.model_name = decode.max_model_len, decode.model_name
        self.warmup_seconds = prefill.warmup_seconds + decode.warmup_seconds
        if decode.config.warmup:
            self.warmup_seconds += self._warmup_transfers()
        self.prefill_half = PrefillHalf(prefill)
        self.mover = LocalMover(prefill, decode, transfer)
        self.decode_half = DecodeHalf(decode, self.mover)
        self._rng = np.random.default_rng(decode.config.seed)

    @property
    def transfer(self):
        return self.mover.transfer

    @transfer.setter
    def transfer(self, transfer) -> None:
        self.mover.transfer = transfer

    @property
    def num_transfers(self) -> int:
        return self.decode_half.num_transfers

    @property
    def num_transfer_failures(self) -> int:
        return self.decode_half.num_transfer_failures

    @property
    def _moving(self) -> list[Handoff]:
        return self.decode_half.moving

    def _warmup_transfers(self) -> float:
        """Compile the handoff's gather (prefill side) and scatter (decode side) for every power-of-two page count
        a prompt can take."""
        t0 = time.perf_counter()
        self.prefill.runner.warmup_page_copies(self.prefill.runner.max_pages_per_seq, kinds=("read",))
        self.decode.runner.warmup_page_copies(self.decode.runner.max_pages_per_seq, kinds=("write",))
        return time.perf_counter() - t0

    @classmethod
    def from_config(cls, config: EngineConfig, transfer=device_put_tree) -> "DisaggregatedEngine":
        """Engines on the first N devices (prefill) and the next M (decode), from config.disaggregated."""
        num_prefill, num_decode = parse_disaggregated(config.disaggregated)
        devices = jax.devices()
        if num_prefill + num_decode > len(devices):
            raise ValueError(f"disaggregated={config.disaggregated!r} needs {num_prefill + num_decode} devices; "
                             f"there are {len(devices)}")
        loaded = loading.load_model(config.model, dtype=config.dtype,  # once; each engine copies it to its devices
                                    keep_mxfp4=config.quantization == "mxfp4")
        check_pages_only(loaded.config, f"disaggregated={config.disaggregated!r}", "leave disaggregated unset")
        engines = []
        for group in (devices[:num_prefill], devices[num_prefill:num_prefill + num_decode]):
            engines.append(LLMEngine(role_config(config, len(group)), loaded=loaded, devices=group))
        return cls(*engines, transfer=transfer)

    # ---- requests ---------------------------------------------------------------------------
    @property
    def requests(self) -> dict:
        return {**self.prefill.requests, **self.decode.requests,
                **{h.request_id: h for h in self.decode_half.handoffs}}

    def validate_request(self, *args, **kwargs):
        return self.decode.validate_request(*args, **kwargs)

    def add_request(self, request_id: str | None, prompt: str | None, sampling_params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None) -> str:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; give each request a unique id")
        ids, params = self.validate_request(prompt, sampling_params, prompt_token_ids)
        params = with_seed(params, self._rng)  # one seed for both sides, so the decode side samples as one engine would
        if not hands_off(params):
            return self.decode.add_request(request_id, prompt, params, ids, arrival_time)
        self.prefill_half.add(request_id, prompt, params, ids, arrival_time)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request wherever it is; one in transfer frees its pages on both sides."""
        out = self.prefill_half.abort(request_id)
        if out is None:
            out = self.decode_half.abort(request_id)
        return out if out is not None else self.decode.abort_request(request_id)

    def abort_all(self) -> list[str]:
        ids = list(self.prefill_half.prefilling) + [h.request_id for h in self.decode_half.handoffs]
        for rid in ids:
            self.abort_request(rid)
        return ids + self.prefill.abort_all() + self.decode.abort_all()

    def has_unfinished_requests(self) -> bool:
        return (bool(self.decode_half.handoffs) or self.prefill.has_unfinished_requests()
                or self.decode.has_unfinished_requests())

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs = []
        if self.prefill.has_unfinished_requests():
            for out in self.prefill.step():
                if out.finished:
                    h = self.prefill_half.finished(out)
                    if h is None:
                        outputs.append(out)  # its first token ended it: the prefill's output is final
                    else:
                        self.decode_half.offer(h)
        outputs += self.decode_half.land()  # copies started in an earlier step: each has had a step to run
        outputs += self.decode_half.start()
        if self.decode.has_unfinished_requests():
            outputs += self.decode.step()
        return outputs

    def warmup_for_one_request(self, prompt_len: int) -> float:
        """Each side's buckets for one request of prompt_len tokens (an engine built with warmup=False)."""
        return self.prefill.warmup_for_one_request(prompt_len) + self.decode.warmup_for_one_request(prompt_len)

    def run_to_completion(self) -> None:
        while self.has_unfinished_requests():
            self.step()

    def stats(self) -> EngineStats:
        """Both engines' counters; a handed-over request's prompt and first token are counted once."""
        s = EngineStats.combine([self.prefill.stats(), self.decode.stats()])
        half = self.decode_half
        return dataclasses.replace(
            s, num_waiting=s.num_waiting + len(half.handoffs),
            prompt_tokens_total=s.prompt_tokens_total - half.adopted_prompt_tokens,
            generation_tokens_total=s.generation_tokens_total - half.adopted,
            kv_transfers_received=half.num_landed, kv_transfers_failed=half.num_transfer_failures,
            kv_transfers_sent=half.num_landed)


def hands_off(params: SamplingParams) -> bool:
    """Whether a request goes through a handoff: n == 1 and no prompt logprobs (others run on the decode side)."""
    return params.n == 1 and params.prompt_logprobs is None


def with_seed(params: SamplingParams, rng: np.random.Generator) -> SamplingParams:
    """`params` with a seed: its own, or one drawn from rng, so both halves sample alike."""
    return params if params.seed is not None else dataclasses.replace(params, seed=int(rng.integers(0, 2**31)))


def role_config(config: EngineConfig, num_devices: int) -> EngineConfig:
    """One role's engine config over num_devices devices: tensor parallel over them, the one-group KV pool (a
    handoff moves one page table a request)."""
    mesh = f"tp={num_devices}" if num_devices > 1 else None
    return dataclasses.replace(config, mesh=mesh, disaggregated=None, disable_hybrid_kv_cache_manager=True)


def check_pages_only(model_config, option: str, fix: str) -> None:
    """Refuse a hybrid model: a handoff moves K/V pages, not recurrent state."""
    if hasattr(get_model_family(model_config), "state_shapes"):
        raise ValueError(f"{option}: the handoff moves K/V pages, not {model_config.architecture}'s recurrent state; {fix}")


def page_layout(engine: LLMEngine):
    """What must agree between a prefill and a decode engine for pages to move: per-page shape and dtype of each pool."""
    pools = (engine.runner.k_cache, engine.runner.v_cache)
    return jax.tree.map(lambda a: [a.shape[0], *a.shape[2:], str(a.dtype)], pools)


def _check_alike(prefill: LLMEngine, decode: LLMEngine) -> None:
    if prefill.config.page_size != decode.config.page_size:
        raise ValueError(f"page_size differs between prefill ({prefill.config.page_size}) and decode "
                         f"({decode.config.page_size}); give both one page size")
    if page_layout(prefill) != page_layout(decode):
        raise ValueError(f"the KV pages of prefill {page_layout(prefill)} and decode {page_layout(decode)} differ (KV dtype, "
                         "or KV heads replicated to a different tp); give both sides the same kv_cache_dtype and KV layout")
    if prefill.max_model_len != decode.max_model_len:
        raise ValueError(f"max_model_len differs between prefill ({prefill.max_model_len}) and decode ({decode.max_model_len})")
