"""Data parallelism: `dp` replicas of the engine, each on its own group of devices.

A mesh like "dp=2,tp=4" on 8 devices makes two LLMEngines, each tensor-parallel over 4
devices, sharing the loaded weights' source but nothing at run time (their own KV pools,
schedulers and compiled steps), as vLLM's data-parallel engine cores do. A request goes to
the replica with the fewest unfinished requests; `step()` steps every busy replica. JAX
dispatch is asynchronous and each replica keeps one step in flight, so the replicas' devices
work at the same time.
"""
from __future__ import annotations

import dataclasses

import jax

from jlight import loading  # loading.load_model is looked up at each call (tests wrap it)
from jlight.engine import startup
from jlight.engine.disaggregated import DisaggregatedEngine
from jlight.engine.disaggregated_roles import make_role_engine
from jlight.engine.engine_config import EngineConfig
from jlight.engine.llm_engine import EngineStats, LLMEngine
from jlight.engine.outputs import RequestOutput
from jlight.sharding.mesh import parse_mesh_spec


def replica_mesh_spec(spec: str) -> tuple[int, str | None]:
    """'dp=2,tp=4' -> (2, 'tp=4'); 'dp=2' -> (2, None): what each replica runs."""
    sizes = parse_mesh_spec(spec)
    rest = ",".join(f"{axis}={size}" for axis, size in sizes.items() if axis != "dp" and size > 1)
    return sizes["dp"], rest or None


def make_engine(config: EngineConfig):
    """An LLMEngine, a DataParallelEngine when the mesh has dp > 1, a DisaggregatedEngine, or this process's role
    engine of a disaggregated pair (disaggregated_roles.py)."""
    startup.claim_device_memory(config)  # before anything starts JAX's backend
    if config.disaggregated_role:
        return make_role_engine(config.validate())
    if config.disaggregated:
        return DisaggregatedEngine.from_config(config.validate())
    if config.mesh and replica_mesh_spec(config.mesh)[0] > 1:
        return DataParallelEngine(config)
    return LLMEngine(config)


class DataParallelEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        dp, replica_spec = replica_mesh_spec(config.mesh)
        devices = jax.devices()
        if len(devices) % dp:
            raise ValueError(f"mesh={config.mesh!r}: dp={dp} does not divide the {len(devices)} devices")
        per = len(devices) // dp
        loaded = loading.load_model(config.model, dtype=config.dtype,  # once; each replica copies it to its devices
                                    keep_mxfp4=config.quantization == "mxfp4")
        replica_config = dataclasses.replace(config, mesh=replica_spec)
        self.replicas = [LLMEngine(replica_config, loaded=loaded, devices=devices[r * per:(r + 1) * per])
                         for r in range(dp)]
        first = self.replicas[0]
        for replica in self.replicas[1:]:  # one grammar compiler: llguidance's view of the vocabulary is built once
            replica.grammars = first.grammars
        self.config = config
        self.tokenizer, self.model_config = first.tokenizer, first.model_config
        self.max_model_len, self.model_name = first.max_model_len, first.model_name
        self.warmup_seconds = sum(r.warmup_seconds for r in self.replicas)
        self._replica_of: dict[str, LLMEngine] = {}

    @property
    def requests(self) -> dict:
        return {rid: req for r in self.replicas for rid, req in r.requests.items()}

    @property
    def num_steps(self) -> int:
        return max(r.num_steps for r in self.replicas)

    def validate_request(self, *args, **kwargs):
        return self.replicas[0].validate_request(*args, **kwargs)

    def add_request(self, request_id, prompt, sampling_params=None, prompt_token_ids=None, arrival_time=None) -> str:
        if request_id is not None and request_id in self._replica_of:
            raise ValueError(f"request_id {request_id!r} is already in use; give each request a unique id")
        replica = min(self.replicas, key=lambda r: len(r.requests))
        request_id = replica.add_request(request_id, prompt, sampling_params, prompt_token_ids, arrival_time)
        self._replica_of[request_id] = replica
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        replica = self._replica_of.pop(request_id, None)
        return replica.abort_request(request_id) if replica is not None else None

    def abort_all(self) -> list[str]:
        self._replica_of.clear()
        return [rid for r in self.replicas for rid in r.abort_all()]

    def has_unfinished_requests(self) -> bool:
        return any(r.has_unfinished_requests() for r in self.replicas)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for replica in self.replicas:
            if replica.has_unfinished_requests():
                outputs.extend(replica.step())
        for out in outputs:
            if out.finished:
                self._replica_of.pop(out.request_id, None)
        return outputs

    def run_to_completion(self) -> None:
        while self.has_unfinished_requests():
            self.step()

    def stats(self) -> EngineStats:
        return EngineStats.combine([r.stats() for r in self.replicas])
