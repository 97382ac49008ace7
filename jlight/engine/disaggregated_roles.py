"""Disaggregated prefill and decode as two processes of one jax.distributed job (process 0 prefill, 1 decode), each
an engine over its own devices with its own mesh, KV pool and scheduler, behind LLMEngine's interface
(add_request / step / abort_request / stats), so AsyncLLM and the server run on either unchanged. A router
(serve/router.py) sends each request through both, with vLLM's `kv_transfer_params` field:
  1. to the prefill process with {"do_remote_decode": true}: PrefillRoleEngine computes the prompt and samples the
     first token (handoff.PrefillHalf, the request's own seed, drawn here when it has none), holds the prompt's pages
     under a transfer id (kv_channel.PageSender) and answers with the first token's RemotePrefill as the output's
     `kv_transfer_params`;
  2. to the decode process with that RemotePrefill: DecodeRoleEngine continues the request (handoff.DecodeHalf):
     when it has room it orders the pages (kv_channel.PageReceiver; a cross-process jax.device_put), and once they
     arrive it adopts the request with its first token, which its output stream carries like every later token.
Invariants: a request that reaches the decode side is never lost: when its pages cannot come (a failed or timed
out transfer, an expired hold, a prompt that tokenized differently) it is recomputed there, keeping the first token
(or from scratch, when the prompts differ); an abort on the decode side frees the decode pages at once and the
prefill pages when the prefill process answers the order (or its cancel); a first token that ends the request comes
back with no transfer id, and the decode side only emits it. Requests without kv_transfer_params run whole on
either process.
"""
from __future__ import annotations

import dataclasses
import time
import uuid

import jax
import numpy as np

from jlight.engine.disaggregated import check_pages_only, hands_off, role_config, with_seed
from jlight.engine.engine_config import EngineConfig
from jlight.engine.handoff import DecodeHalf, Handoff, PrefillHalf
from jlight.engine.kv_channel import PageReceiver, PageSender
from jlight.engine.llm_engine import EngineStats, LLMEngine
from jlight.engine.outputs import CompletionOutput, RequestOutput
from jlight.engine.sampling_params import SamplingParams
from jlight.sharding import distributed

ROLES = ("prefill", "decode")
PROCESS_ID = {"prefill": 0, "decode": 1}  # the prefill process hosts the job's coordination service


@dataclasses.dataclass
class RemotePrefill:
    """What the prefill process hands the decode process for one request (the kv_transfer_params it answers)."""
    first_token_id: int
    seed: int
    num_prompt_tokens: int
    num_pages: int = 0
    transfer_id: str | None = None  # None: nothing to move (its first token ended it)
    first_logprobs: list[list] | None = None  # [[token id, logprob], ...] when logprobs were asked for
    cumulative_logprob: float | None = None

    @classmethod
    def from_dict(cls, value) -> "RemotePrefill":
        """Parse kv_transfer_params as the prefill process wrote them; ValueError naming the bad field."""
        def bad(field, why):
            raise ValueError(f"kv_transfer_params.{field} {why}; pass on the kv_transfer_params the prefill server answered")
        if not isinstance(value, dict):
            raise ValueError("kv_transfer_params must be an object; pass on the kv_transfer_params the prefill server answered")
        for name in ("first_token_id", "seed", "num_prompt_tokens"):
            if not isinstance(value.get(name), int) or isinstance(value.get(name), bool) or value[name] < 0:
                bad(name, "must be an integer >= 0")
        if not isinstance(value.get("num_pages", 0), int) or value.get("num_pages", 0) < 0:
            bad("num_pages", "must be an integer >= 0")
        if value.get("transfer_id") is not None and not isinstance(value["transfer_id"], str):
            bad("transfer_id", "must be a string or null")
        lps = value.get("first_logprobs")
        if lps is not None and (not isinstance(lps, list) or not all(
                isinstance(p, list) and len(p) == 2 and isinstance(p[0], int) and isinstance(p[1], (int, float)) for p in lps)):
            bad("first_logprobs", "must be a list of [token id, logprob] pairs or null")
        cum = value.get("cumulative_logprob")
        if cum is not None and not isinstance(cum, (int, float)):
            bad("cumulative_logprob", "must be a number or null")
        return cls(value["first_token_id"], value["seed"], value["num_prompt_tokens"], value.get("num_pages", 0),
                   value.get("transfer_id"), lps, cum)

    def first_output(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> RequestOutput:
        logprobs = [{int(i): float(lp) for i, lp in self.first_logprobs}] if self.first_logprobs is not None else None
        c = CompletionOutput(0, "", [self.first_token_id], "length", logprobs=logprobs,
                             cumulative_logprob=self.cumulative_logprob)
        return RequestOutput(request_id, prompt, prompt_token_ids, [c], True)


def remote_decode_asked(value) -> bool:
    """Whether kv_transfer_params ask the prefill process to hand the request on ({"do_remote_decode": true})."""
    if not isinstance(value, dict) or value.get("do_remote_decode") not in (True, False):
        raise ValueError('kv_transfer_params for a prefill server must be {"do_remote_decode": true} (or false)')
    return value["do_remote_decode"]


class _RoleEngine:
    """What both roles share: LLMEngine's attributes and the plain requests that run whole here."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self.config, self.tokenizer, self.model_config = engine.config, engine.tokenizer, engine.model_config
        self.max_model_len, self.model_name = engine.max_model_len, engine.model_name
        self.warmup_seconds = engine.warmup_seconds

    def validate_request(self, prompt, sampling_params: SamplingParams | None = None, prompt_token_ids=None):
        """LLMEngine's checks; kv_transfer_params are kept for add_request, which reads them."""
        params = sampling_params or SamplingParams()
        ids, checked = self.engine.validate_request(prompt, dataclasses.replace(params, kv_transfer_params=None),
                                                    prompt_token_ids)
        return ids, dataclasses.replace(checked, kv_transfer_params=params.kv_transfer_params)

    def _plain(self, params: SamplingParams) -> SamplingParams:
        return dataclasses.replace(params, kv_transfer_params=None)

    def warmup_for_one_request(self, prompt_len: int) -> float:
        return self.engine.warmup_for_one_request(prompt_len)

    def run_to_completion(self) -> None:
        while self.has_unfinished_requests():
            self.step()


class PrefillRoleEngine(_RoleEngine):
    def __init__(self, engine: LLMEngine, sender: PageSender, idle_wait_s: float = 0.005):
        """idle_wait_s: how long a step with nothing to run waits for the decode side's next order."""
        super().__init__(engine)
        self.sender, self.idle_wait_s = sender, idle_wait_s
        self.half = PrefillHalf(engine)
        self._rng = np.random.default_rng(engine.config.seed)
        self._next_order_check = 0.0

    @property
    def requests(self) -> dict:
        return self.engine.requests

    def add_request(self, request_id: str | None, prompt: str | None, sampling_params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None) -> str:
        params = sampling_params or SamplingParams()
        if params.kv_transfer_params is None or not remote_decode_asked(params.kv_transfer_params):
            return self.engine.add_request(request_id, prompt, self._plain(params), prompt_token_ids, arrival_time)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.engine.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; give each request a unique id")
        ids, params = self.engine.validate_request(prompt, self._plain(params), prompt_token_ids)
        if not hands_off(params):
            raise ValueError("kv_transfer_params: a remote decode takes one sample (n=1) without prompt logprobs (echo); "
                             "send this request to the decode server alone")
        self.half.add(request_id, prompt, with_seed(params, self._rng), ids, arrival_time)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        out = self.half.abort(request_id)
        return out if out is not None else self.engine.abort_request(request_id)

    def abort_all(self) -> list[str]:
        ids = list(self.half.prefilling)
        for rid in ids:
            self.half.abort(rid)
        return ids + self.engine.abort_all()

    def has_unfinished_requests(self) -> bool:
        if self.engine.has_unfinished_requests() or self.sender.held:
            return True
        now = time.monotonic()  # an order for a released hold still needs its answer: look now and then
        if now < self._next_order_check:
            return False
        self._next_order_check = now + 0.05
        return self.sender.order_waiting()

    def step(self) -> list[RequestOutput]:
        outputs = self.engine.step() if self.engine.has_unfinished_requests() else []
        for out in outputs:
            if out.finished and out.request_id in self.half.prefilling:
                out.kv_transfer_params = self._handed_on(out)
        self.sender.serve()
        if not outputs and not self.engine.has_unfinished_requests():
            self.sender.wait_for_order(self.idle_wait_s)
        return outputs

    def _handed_on(self, out: RequestOutput) -> dict:
        seed = self.half.prefilling[out.request_id].params.seed
        c = out.outputs[0]
        remote = RemotePrefill(c.token_ids[0], seed, len(out.prompt_token_ids),
                               first_logprobs=[[i, lp] for i, lp in c.logprobs[0].items()] if c.logprobs else None,
                               cumulative_logprob=c.cumulative_logprob)
        h = self.half.finished(out)
        if h is not None:
            remote.num_pages, remote.transfer_id = h.num_pages, self.sender.hold(h)
        return dataclasses.asdict(remote)

    def stats(self) -> EngineStats:
        return dataclasses.replace(self.engine.stats(), kv_transfers_sent=self.sender.num_sent)


class DecodeRoleEngine(_RoleEngine):
    def __init__(self, engine: LLMEngine, receiver: PageReceiver, idle_wait_s: float = 0.001):
        """idle_wait_s: how long a step with only moves in flight sleeps before polling them again."""
        super().__init__(engine)
        self.receiver, self.idle_wait_s = receiver, idle_wait_s
        self.half = DecodeHalf(engine, receiver)
        self._adopted: list[RequestOutput] = []  # adopted at add_request (nothing to move), for the next step

    @property
    def requests(self) -> dict:
        return {**self.engine.requests, **{h.request_id: h for h in self.half.handoffs}}

    def add_request(self, request_id: str | None, prompt: str | None, sampling_params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None) -> str:
        params = sampling_params or SamplingParams()
        if params.kv_transfer_params is None:
            return self.engine.add_request(request_id, prompt, params, prompt_token_ids, arrival_time)
        remote = RemotePrefill.from_dict(params.kv_transfer_params)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; give each request a unique id")
        params = dataclasses.replace(params, kv_transfer_params=None, seed=remote.seed)
        ids, params = self.engine.validate_request(prompt, params, prompt_token_ids)
        if not hands_off(params) or not 0 <= remote.first_token_id < self.model_config.vocab_size:
            raise ValueError("kv_transfer_params: this request cannot continue a remote prefill (it needs n=1, no prompt "
                             "logprobs, and a first token in the vocabulary); send it without kv_transfer_params")
        h = Handoff(request_id, prompt, ids, params, arrival_time or time.time(),
                    remote.first_output(request_id, prompt, ids), remote.num_pages, transfer_id=remote.transfer_id)
        if remote.num_prompt_tokens != len(ids):  # not the prompt the prefill computed: run it here from scratch
            self.receiver.done(h)
            return self.engine.add_request(request_id, prompt, params, ids, arrival_time)
        if remote.transfer_id is None:  # nothing to move: its first token ended it, or there were no pages
            self._adopted.append(self.half.adopt_without_pages(h))
        else:
            self.half.offer(h)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        out = self.half.abort(request_id)
        return out if out is not None else self.engine.abort_request(request_id)

    def abort_all(self) -> list[str]:
        ids = [h.request_id for h in self.half.handoffs]
        for rid in ids:
            self.half.abort(rid)
        return ids + self.engine.abort_all()

    def has_unfinished_requests(self) -> bool:
        return (bool(self._adopted or self.half.handoffs) or self.engine.has_unfinished_requests()
                or self.receiver.in_flight)

    def step(self) -> list[RequestOutput]:
        outputs, self._adopted = self._adopted, []
        outputs += self.half.land()  # moves ordered in an earlier step
        outputs += self.half.start()
        if self.engine.has_unfinished_requests():
            outputs += self.engine.step()
        elif not outputs:
            time.sleep(self.idle_wait_s)  # only moves in flight: poll them again shortly
        return outputs

    def stats(self) -> EngineStats:
        s = self.engine.stats()
        return dataclasses.replace(s, num_waiting=s.num_waiting + len(self.half.handoffs),
                                   kv_transfers_received=self.half.num_landed,
                                   kv_transfers_failed=self.half.num_transfer_failures)


def join_pair(role: str, coordinator_address: str, transfer_address: str | None = None) -> None:
    """Join this process to the prefill/decode pair's jax.distributed job as `role` (the prefill process is process 0,
    whose host runs the coordination service at coordinator_address). transfer_address: "host:port" where this process
    serves the pages the other pulls (JAX's socket transfers); default, on one host (a loopback coordinator), the
    coordinator's port + 1 + the process id."""
    if role not in ROLES:
        raise ValueError(f"disaggregated role {role!r} is invalid: choose 'prefill' or 'decode'")
    host, _, port = (coordinator_address or "").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"coordinator address {coordinator_address!r} must be 'host:port' (the prefill process's host), "
                         "the same for both roles, e.g. 127.0.0.1:8476")
    if transfer_address is None:
        if host not in ("127.0.0.1", "localhost"):
            raise ValueError("with a coordinator on another host, give this process's own transfer address "
                             "(--kv-transfer-address HOST:PORT, reachable from the other role's host)")
        transfer_address = f"{host}:{int(port) + 1 + PROCESS_ID[role]}"
    distributed.initialize(coordinator_address, len(ROLES), PROCESS_ID[role], transfer_address=transfer_address)


def make_role_engine(config: EngineConfig, transfer=None):
    """The engine of this process's role (config.disaggregated_role) over its own devices; the process has joined the
    pair (join_pair) first. transfer: the cross-process copy (default jax.device_put; tests inject failures)."""
    store = distributed.key_value_store()
    devices = jax.local_devices()
    engine = LLMEngine(role_config(dataclasses.replace(config, disaggregated_role=None), len(devices)), devices=devices)
    check_pages_only(engine.model_config, f"disaggregated_role={config.disaggregated_role!r}",
                     "serve this model without a disaggregated role")
    extra = {} if transfer is None else {"transfer": transfer}
    timeout = config.kv_transfer_timeout_s
    if config.disaggregated_role == "prefill":
        if config.warmup:
            engine.runner.warmup_page_copies(engine.runner.max_pages_per_seq, kinds=("read",))
        return PrefillRoleEngine(engine, PageSender(store, engine, timeout, **extra))
    if config.warmup:
        engine.runner.warmup_page_copies(engine.runner.max_pages_per_seq, kinds=("write",))
    return DecodeRoleEngine(engine, PageReceiver(store, engine, timeout, **extra))
