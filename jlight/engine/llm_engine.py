"""LLMEngine: the synchronous engine loop (add requests, step, collect outputs).

Steps are pipelined one deep: `step()` schedules and launches step N, then reads back the
tokens of step N-1 (which the device finished while the host was preparing N). A sequence
that finished in step N-1 therefore runs one wasted token in step N; its pages are freed
after N is queued, which is safe because the device runs steps in order.

A speculating sequence's next step needs the token the step in flight samples (its drafts follow
it: speculative.py). A proposer that drafts ahead (EngineConfig.draft_ahead) gives it a row in the
next step anyway, which assumes its row in flight keeps every draft; reading that row back, the
engine discards the row ahead when a draft was rejected (speculative.py). Otherwise, while the running batch holds such a
sequence (Scheduler.waits_for_step), `step()` reads the step in flight back first, then schedules
and launches the next one, and only then builds the request outputs of the step it read, so every
call launches a step (none runs empty, leaving the device idle over a call that only waits) and the
outputs' host work runs while the device computes. Nothing hides the launch of a step the host
waits for, so it runs the runner's serial variant where there is one
(EngineConfig.verify_step_command_buffers).
"""
from __future__ import annotations

import dataclasses
import logging
import time
import uuid

import jax
import numpy as np

from jlight import loading  # loading.load_model is looked up at each call (tests wrap it)
from jlight.core.errors import PromptTooLongError
from jlight.core.quantization import kv_pool_bytes
from jlight.engine import kv_groups, output_processor, proposers, speculative, startup, state_pool
from jlight.engine.block_manager import BlockManager, prefix_key
from jlight.engine.engine_config import EngineConfig
from jlight.engine.host_tier import HostTier
from jlight.engine.model_runner import ModelRunner, kv_pool_dtype
from jlight.engine.outputs import RequestOutput
from jlight.engine.sampler import NUM_BANNED
from jlight.engine.sampling_params import SamplingParams
from jlight.engine.scheduler import Scheduler
from jlight.engine.sequence import Sequence
from jlight.engine.state_pool import StatePool
from jlight.engine.structured_output import GrammarCompiler
from jlight.engine.weights import cpu_kernel_rows, keeps_gguf_blocks, prepare_params, unrolls
from jlight.models import get_model_family
from jlight.pallas_kernels import dispatch
from jlight.progress import Progress
from jlight.sharding.mesh import make_mesh

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_pages_total: int
    num_pages_used: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_steps: int
    # Speculative decoding (vLLM's counters): rows that verified drafts, drafts proposed, drafts kept,
    # and drafts kept at each draft position (index 0: the first draft of a row).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple = ()
    # Rows drafted ahead of the step in flight (speculative.py), and those discarded because the row before
    # them rejected a draft.
    spec_num_ahead_rows: int = 0
    spec_num_ahead_discarded: int = 0
    # Cached pages that admitted sequences took (in tokens; every admission, re-admissions after a preemption
    # too), by the tier they came from: the device's prefix cache or the host tier (host_tier.py). Then the
    # host tier's pages: copied to host, dropped by its LRU, held now, and its capacity.
    device_cache_hit_tokens: int = 0
    host_cache_hit_tokens: int = 0
    host_cache_offloaded_pages: int = 0
    host_cache_dropped_pages: int = 0
    host_cache_pages_used: int = 0
    host_cache_pages_total: int = 0
    # Disaggregated prefill/decode (handoff.py): handoffs whose pages arrived here (decode side), handoffs recomputed
    # here because their pages could not come (decode side), and handoffs whose pages went out (prefill side).
    kv_transfers_received: int = 0
    kv_transfers_failed: int = 0
    kv_transfers_sent: int = 0

    @classmethod
    def combine(cls, parts: list["EngineStats"]) -> "EngineStats":
        """The stats of replicas run side by side: counts add (per draft position too), steps are the longest."""
        def merge(name, values):
            if name == "num_steps":
                return max(values)
            if name == "spec_accepted_per_position":
                width = max(len(v) for v in values)
                return tuple(sum(v[i] for v in values if i < len(v)) for i in range(width))
            return sum(values)
        return cls(**{f.name: merge(f.name, [getattr(p, f.name) for p in parts]) for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float
    first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded=None, devices=None, *, give_weights: bool = False):
        """`devices`: run on these devices only (a data-parallel replica's group); default all.
        `loaded`: a LoadedModel to run instead of loading config.model. Its weights stay intact unless
        `give_weights`: then they are the engine's to free as it prepares its own layout, which keeps the
        peak near one copy of the weights (a model over half the device's memory fits only so), and
        `loaded.params` is None afterwards."""
        config = (config or EngineConfig()).validate()
        startup.claim_device_memory(config)  # before anything starts JAX's backend (unless `loaded` did)
        if devices is not None and not config.mesh:
            if len(devices) != 1:
                raise ValueError(f"{len(devices)} devices given without a mesh; pass mesh= to use several")
            if loaded is not None:
                given, loaded = loaded, dataclasses.replace(loaded, params=jax.device_put(loaded.params, devices[0]))
                if give_weights:
                    given.params = None
            with jax.default_device(devices[0]), startup.small_programs_cached():  # set-up's buffers live there too
                self._init(config, loaded, None, warmup=False, give_weights=give_weights)
            # Warm up outside that device context, as step() runs: the default device is part of jit's cache
            # key, so buckets compiled under it compiled again on first use. The weights are committed to
            # devices[0], so the steps run there anyway.
            with startup.small_programs_cached():
                self.warmup_seconds = self._warmup() if config.warmup else 0.0
        else:
            with startup.small_programs_cached():
                self._init(config, loaded, devices, give_weights=give_weights)

    def _init(self, config: EngineConfig, loaded, devices, warmup: bool = True, give_weights: bool = False) -> None:
        self.config = cfg = config
        self._start_time = time.perf_counter()
        startup.enable_compilation_cache(cfg.compilation_cache_dir)
        # stored steps load on threads of their own from here on
        self._prefetch = startup.prefetch_executables(cfg, None if loaded is None else loaded.config)
        # Weights this engine loads itself, or is given, are its own to free while unstacking them (below);
        # weights only lent (data-parallel replicas share one load) stay intact for the others.
        owns_weights = loaded is None or give_weights
        mesh = None
        if cfg.mesh:
            mesh = make_mesh(cfg.mesh, devices)
        if loaded is None:
            # Orbax checkpoints restore into the mesh. A single-device engine that unrolls its layers reads them
            # per layer (assemble_params' unstacked); a mesh's sharding plan places the stacked weights first.
            loaded = loading.load_model(cfg.model, dtype=cfg.dtype, mesh=mesh,
                                        unstacked=mesh is None and unrolls(cfg, None, dispatch.on_gpu()),
                                        keep_gguf_blocks=keeps_gguf_blocks(cfg, mesh, dispatch.on_gpu()),
                                        keep_mxfp4=cfg.quantization == "mxfp4")
        jax.block_until_ready(loaded.params)  # the transfers done: the load's time is all in load_seconds
        self.load_seconds = time.perf_counter() - self._start_time
        self.loaded = loaded
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = getattr(loaded, "name", None) or str(cfg.model or "SmolLM2-135M-Instruct")
        self.family = get_model_family(self.model_config)
        stateful = hasattr(self.family, "state_shapes")  # a hybrid model: recurrent layers with state slots
        if stateful:
            startup.check_hybrid(cfg, self.model_config.architecture)
        # A hybrid model's recurrent-state slots: one a running sequence, and as many snapshot slots for the
        # prefix cache (state_pool.py: one saved state a prompt).
        self.state_pool = StatePool(cfg.max_num_seqs, cfg.max_num_seqs if cfg.enable_prefix_caching else 0) if stateful else None
        params, sharding_plan = prepare_params(cfg, self.family, loaded, mesh, dispatch.on_gpu(), owns_weights,
                                               given=give_weights)
        jax.block_until_ready(params)
        self.startup_seconds = {"load": self.load_seconds, "prepare": time.perf_counter() - self._start_time - self.load_seconds}
        if sharding_plan is not None:
            self.model_config = sharding_plan.config  # e.g. KV heads replicated up to tp
        mc = self.model_config
        self.kv_layout = kv_groups.engine_layout(self.family, mc, cfg)  # layers grouped by attention kind
        self.max_model_len = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        if cfg.max_model_len and cfg.max_model_len > mc.max_position_embeddings:  # said, not silently capped
            logger.warning("max_model_len=%d is beyond the model's %d positions; using %d", cfg.max_model_len,
                           mc.max_position_embeddings, self.max_model_len)
        max_batched = cfg.max_num_batched_tokens or max(cfg.max_num_seqs, 2048 if dispatch.on_gpu() else 512)
        compute_dtype = params["final_norm"].dtype
        kv_dtype = kv_pool_dtype(compute_dtype, dispatch.on_gpu())
        if cfg.kv_cache_dtype == "fp8" and not dispatch.on_gpu():
            logger.warning("kv_cache_dtype='fp8' on the CPU: XLA:CPU converts an 8-bit float pool whole at each layer's "
                           "write, so a step's time grows with the pool (a tiny model: 1.8 ms a token with 257 pages, "
                           "57 ms with 8,193); kv_cache_dtype='int8' halves the pool as well and does not")
        if cfg.kv_cache_dtype != "auto" and mc.family == "deepseek":
            raise ValueError(f"kv_cache_dtype={cfg.kv_cache_dtype!r} is not supported for {mc.architecture} (its MLA latent "
                             "cache stays in the model dtype); use kv_cache_dtype='auto'")
        spec = cfg.speculative
        self.proposer = proposers.make_proposer(spec, cfg, self.family, mc, params, self.tokenizer, compute_dtype,
                                                self.kv_layout.num_groups, dispatch.on_gpu())
        stats = startup.device_memory_stats()  # None on the CPU
        self.memory_in_use_at_sizing = stats.get("bytes_in_use") if stats else None  # what the pool was sized beside
        num_pages = cfg.num_pages or self._size_kv_pool(kv_dtype, sharding_plan, stats)
        # The pools sized from memory (P0, and the pool beside the step where smaller), for the next start of this
        # engine to keep (startup.settled_pages).
        self._pool_sizes = [num_pages] if cfg.num_pages is None and stats is not None else []
        whole = kv_groups.pages_per_sequence(self.kv_layout.windows, cfg.page_size, self.max_model_len, max_batched) + 1
        self.eos_token_ids = set(getattr(self.tokenizer, "eos_token_ids", ()) or ()) | set(mc.eos_token_ids)
        self.grammars = GrammarCompiler(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        draft_slots = min(cfg.max_num_seqs, spec.disable_by_batch_size) * spec.num_speculative_tokens if spec else 0
        self.runner = ModelRunner(  # its K/V pools stay abstract until allocate_pools
            self.family, mc, params,
            dispatch.get_kernels(cfg.attention_impl, cfg.matmul_impl, cfg.moe_impl, sharded=mesh is not None,
                                 fp8_w8a8_min_rows=cfg.fp8_w8a8_min_rows, fp8_prefill_qk=cfg.fp8_prefill_qk,
                                 trace_layers_once=cfg.trace_layers_once,
                                 **cpu_kernel_rows(cfg, mesh, dispatch.on_gpu())),
            num_pages=num_pages, page_size=cfg.page_size, max_num_seqs=cfg.max_num_seqs,
            max_num_batched_tokens=max_batched, max_model_len=self.max_model_len, kv_dtype=kv_dtype,
            kv_cache_dtype=cfg.kv_cache_dtype, sharding_plan=sharding_plan, collective_matmul=cfg.collective_matmul, int8_all_reduce=cfg.int8_all_reduce,
            min_token_bucket=cfg.min_token_bucket or 8, one_token_bucket=cfg.min_token_bucket is None and not dispatch.on_gpu(),
            extra_token_buckets=cfg.extra_token_buckets,
            guide_mask_words=self.grammars.mask_words,
            draft_slots=draft_slots, num_state_slots=self.state_pool.total_slots if stateful else 0,
            executable_store=startup.executable_store(cfg, mc, self._prefetch),
            kv_layout=self.kv_layout if self.kv_layout.num_groups > 1 else None,
            taps=self.proposer.taps if self.proposer is not None else None,
            serial_steps=spec is not None and (cfg.verify_step_command_buffers is False
                                               or cfg.verify_step_command_buffers is None and dispatch.on_gpu()),
            pack_small_params=cfg.pack_small_params, prompt_logprobs_program=cfg.prompt_logprobs_program)
        store = self.runner.executable_store
        self._store_mark = store.loaded if store is not None else 0  # steps loaded from the store before _warmup's count
        if cfg.num_pages is None and stats is not None:
            # With gpu_memory_utilization the pool is the whole budget, so it always shrinks beside the step: the
            # largest bucket alone measures it, and the rest compile once, against the pool that stays.
            num_pages = self._fit_pool_beside_step(num_pages, stats, kv_dtype, sharding_plan, whole,
                                                   all_buckets=cfg.warmup and warmup and cfg.gpu_memory_utilization is None)
            self._pool_sizes += [num_pages] if num_pages != self._pool_sizes[0] else []
            if cfg.warmup and warmup:
                # The buckets compile before the pool takes its memory: XLA:GPU's autotuner times each GEMM on
                # buffers of its own, for which a pool that fills the budget leaves no room (gpt-oss-20b at
                # gpu_memory_utilization 0.9 on an H100: out of memory in the lm_head's autotuning).
                self.runner.size_pools(num_pages)
                self.startup_seconds["measure"] += self._compile_steps(self.runner.buckets, " against the sized pool")
        self.runner.allocate_pools(num_pages)
        if num_pages < whole:  # vLLM refuses to start here; requests that do not fit are refused one by one instead
            logger.warning("the KV cache (%d pages of %d tokens) cannot hold one sequence of max_model_len=%d tokens (%d "
                           "pages): longer requests will be refused; raise num_pages or lower max_model_len", num_pages,
                           cfg.page_size, self.max_model_len, whole)
        host_tier = startup.host_tier(cfg, self.kv_bytes_per_page(kv_dtype), max_batched) if cfg.kv_offloading_size else None
        self.block_manager = BlockManager(num_pages, cfg.page_size, cfg.enable_prefix_caching, host_tier)
        self.kv_pages = (kv_groups.KVGroupPages(self.block_manager, self.kv_layout.windows)
                         if kv_groups.keeps_window(self.kv_layout) else None)
        draft_ahead = (cfg.draft_ahead if cfg.draft_ahead is not None else dispatch.on_gpu()) and \
            self.proposer is not None and self.proposer.drafts_ahead
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, max_batched, self.max_model_len, spec,
                                   state_pool=self.state_pool, kv_groups=self.kv_pages, proposer=self.proposer,
                                   draft_ahead=draft_ahead)
        if self.proposer is not None:
            self.proposer.attach(self.runner)
        jax.block_until_ready((self.runner.k_cache, self.runner.v_cache))
        self.startup_seconds["setup"] = time.perf_counter() - self._start_time - sum(self.startup_seconds.values())
        self.requests: dict[str, Request] = {}
        self._seq_request: dict[int, Request] = {}
        self._free_slots = list(range(cfg.max_num_seqs))
        self._slots: dict[int, int] = {}  # seq_id -> token-history slot (sequences with penalties)
        self._in_flight = None
        # Requests whose pages outlive their finish for another engine to read (disaggregated.py):
        # request id -> None until it finishes, then its pages, held by one more reference.
        self.kv_exports: dict[str, list[int] | None] = {}
        self._rng = np.random.default_rng(cfg.seed)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0
        self.spec_counts = dict(drafts=0, draft_tokens=0, accepted=0, ahead=0, discarded=0)
        self.spec_accepted_per_position = [0] * (spec.num_speculative_tokens if spec else 0)
        # Host seconds per phase of step(), for the benchmarks' breakdown. "wait_and_process"
        # includes waiting for the device to finish the previous step; "wait" is that wait alone (a part
        # of wait_and_process, not another phase), as "tier" is the host tier's sync within "schedule".
        self.step_seconds = dict.fromkeys(("schedule", "prepare", "launch", "wait_and_process", "wait", "tier"), 0.0)
        logger.info(startup.memory_plan(params, self.runner.k_cache, self.runner.v_cache, num_pages, cfg.page_size))
        self.warmup_seconds = self._warmup() if cfg.warmup and warmup else 0.0

    def _warmup(self, buckets=None, what: str = "") -> float:
        """Compile the step buckets (default: all of them) now, several at once, so serving never compiles;
        then say that the engine is ready. Returns the seconds spent compiling."""
        buckets = sorted(set(self.runner.buckets if buckets is None else buckets))
        runner, store = self.runner, self.runner.executable_store
        variants = runner.num_step_variants(buckets)
        seconds = self._compile_steps(buckets, what)
        if self.proposer is not None:
            seconds += self.proposer.warmup(buckets)
        if self.block_manager.host_tier is not None:
            self.block_manager.host_tier.warmup(self.runner)
        phases = self.startup_seconds
        seconds += phases.pop("measure", 0.0)  # the buckets compiled before the pool was sized
        stored = ""
        if store is not None:  # since the last count: the pool's measuring compiles included
            stored = f", {store.loaded - self._store_mark} of {variants} steps loaded compiled from the store"
            self._store_mark = store.loaded
            store.write_manifest(self._pool_sizes)
            if store.prefetch is not None:
                store.prefetch.close()
        logger.info("ready in %.1f s (loading %.1f s, preparing weights %.1f s, KV cache and set-up %.1f s, compiling %.1f s%s)",
                    time.perf_counter() - self._start_time, phases["load"], phases["prepare"], phases["setup"],
                    seconds, stored)
        return seconds

    def warmup_for_one_request(self, prompt_len: int) -> float:
        """Compile only the buckets that one request of prompt_len tokens, alone in the engine, runs:
        its prefill chunks (the scheduler cuts them at max_num_batched_tokens) and one-token decode
        steps. For an engine built with warmup=False (`jlight generate`). Returns seconds spent."""
        chunk = self.scheduler.max_num_batched_tokens
        steps = {min(chunk, prompt_len), prompt_len % chunk or chunk, 1}
        return self._warmup({self.runner.bucket_for(t) for t in steps}, " for this request")

    # ---- set-up helpers ---------------------------------------------------------------------
    def kv_bytes_per_page(self, kv_dtype) -> int:
        """Bytes of one page of the K and V pools together (all layers; int8 scales included)."""
        k_shape, v_shape = kv_groups.pool_shapes(self.family, self.model_config, 1, self.config.page_size, self.kv_layout)
        return sum(kv_pool_bytes(shape, self.config.kv_cache_dtype, kv_dtype) for shape in (k_shape, v_shape))

    def state_pool_bytes(self) -> int:
        """Bytes of a hybrid model's recurrent-state pools (0 for other models), taken from the KV budget."""
        fn = getattr(self.family, "state_shapes", None)
        return state_pool.bytes_for(fn, self.model_config, self.state_pool.total_slots) if fn else 0

    def _pool_bytes_per_page(self, kv_dtype, plan) -> int:
        """One page's bytes on one device: the model's K/V, a device proposer's K/V pool (it holds the same
        pages), split over the mesh."""
        bytes_per_page = self.kv_bytes_per_page(kv_dtype)
        if self.proposer is not None:
            bytes_per_page += self.proposer.kv_bytes_per_page(self.config.page_size, kv_dtype)
        if plan is not None:
            bytes_per_page //= max(1, plan.mesh.size)
        return bytes_per_page

    def _size_kv_pool(self, kv_dtype, plan, stats: dict | None = None) -> int:
        """The pool's pages by the config's share of memory alone (startup.kv_pool_pages; stats:
        startup.device_memory_stats(), read here when not given)."""
        stats = startup.device_memory_stats() if stats is None else stats
        return startup.kv_pool_pages(self.config, self._pool_bytes_per_page(kv_dtype, plan), self.kv_layout.windows,
                                     self.max_model_len, self.state_pool_bytes(), stats,
                                     self._last_pool_sizes())

    def _compile_steps(self, buckets, what: str = "") -> float:
        """Compile (or load from the store) the steps of `buckets` not compiled yet, several at once; the seconds
        it took. Those the pool's sizing compiled (_fit_pool_beside_step) are done."""
        runner = self.runner
        pending = [T for T in sorted(set(buckets)) if not runner.is_compiled(T)]
        if not pending:
            return 0.0
        threads = startup.compile_threads(self.config.compile_threads, runner.num_step_variants(pending))
        logger.info("compiling %s%s, %d at a time", startup.describe_buckets(pending), what, threads)
        with Progress(runner.num_step_variants(pending), "compiling step buckets", "bucket") as bar:
            return runner.warmup(progress=lambda T: bar.update(), buckets=pending, threads=threads)

    def _fit_pool_beside_step(self, p0: int, stats: dict, kv_dtype, plan, whole: int, all_buckets: bool) -> int:
        """The pool's pages once the largest step has its memory (startup.pool_beside_step). The step buckets
        compile now against the runner's abstract pools of p0 pages: with all_buckets (an engine that warms up)
        every bucket, side by side as the warm-up would compile them, which then finds them done; else the
        largest alone. They are kept when the pool keeps its p0 pages."""
        largest = self.runner.buckets[-1]
        buckets = self.runner.buckets if all_buckets else [largest]
        self.startup_seconds["measure"] = self._compile_steps(buckets, " before sizing the KV pool (the largest step's memory)")
        step_bytes = startup.step_memory_bytes(self.runner.compiled_steps(largest))
        return startup.pool_beside_step(self.config, p0, stats, self._pool_bytes_per_page(kv_dtype, plan), step_bytes,
                                        largest, self.state_pool_bytes(), whole, self._last_pool_sizes())

    def _last_pool_sizes(self) -> list[int]:
        """The pools the last start of this engine sized from memory (its store's manifest), or none."""
        return self._prefetch.pool_sizes if self._prefetch is not None else []

    # ---- requests ---------------------------------------------------------------------------
    def validate_request(self, prompt: str | None, sampling_params: SamplingParams | None = None,
                         prompt_token_ids: list[int] | None = None) -> tuple[list[int], SamplingParams]:
        """Check a request and tokenize it, touching no engine state (safe from any thread).

        Raises ValueError (PromptTooLongError for context overflows) naming the bad input.
        """
        params = (sampling_params or SamplingParams()).validate(self.model_config.vocab_size)
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError("prompt must be a string (or pass prompt_token_ids)")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer; pass prompt_token_ids instead of a text prompt")
            prompt_token_ids = self.tokenizer.encode(prompt)
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        if not prompt_token_ids:
            raise ValueError("prompt is empty; give at least one token")
        if any(not 0 <= t < self.model_config.vocab_size for t in prompt_token_ids):
            raise ValueError(f"prompt_token_ids must be in [0, {self.model_config.vocab_size})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(prompt_token_ids)} tokens but the context is {self.max_model_len}; shorten the prompt"
                " (or raise max_model_len if the model allows)")
        if params.max_tokens is not None and len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the context of"
                f" {self.max_model_len} tokens; lower max_tokens or shorten the prompt")
        self._check_fits_the_pool(len(prompt_token_ids), params.max_tokens)
        if len(params.logit_bias or {}) > 32:
            raise ValueError("logit_bias has more than 32 entries; jlight supports up to 32")
        if params.min_tokens > 0 and len(self._min_tokens_banned(params)) > NUM_BANNED:
            # The sampler bans at most NUM_BANNED ids a row; the rest would come out before min_tokens.
            raise ValueError(f"min_tokens with {len(params.stop_token_ids)} stop_token_ids is not supported: with the model's"
                             f" EOS ids at most {NUM_BANNED} can be held back; pass fewer stop_token_ids or min_tokens=0")
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)
        if params.kv_transfer_params is not None:
            raise ValueError("kv_transfer_params is for disaggregated serving: send it to a prefill or decode server "
                             "(jlight serve --disaggregated-role), or leave it out")
        return prompt_token_ids, params

    def _check_fits_the_pool(self, prompt_len: int, max_tokens: int | None) -> None:
        """Refuse a request whose prompt and max_tokens need more KV pages than the whole pool holds: alone in
        the engine it could still never run (it would preempt itself over and over)."""
        tokens = prompt_len + (max_tokens or 1)
        chunk = min(self.scheduler.max_num_batched_tokens, prompt_len)
        need = kv_groups.pages_per_sequence(self.kv_layout.windows, self.config.page_size, tokens, chunk)
        have = self.block_manager.num_pages - 1  # page 0 is scratch
        if need > have:
            what = f"prompt ({prompt_len} tokens)" + (f" + max_tokens ({max_tokens})" if max_tokens else "")
            raise PromptTooLongError(
                f"{what} needs {need} KV pages of {self.config.page_size} tokens, but the KV cache holds {have}; "
                "lower max_tokens or shorten the prompt, or give the engine more pages (num_pages, "
                "kv_cache_memory_fraction or gpu_memory_utilization)")

    def _min_tokens_banned(self, params: SamplingParams) -> list[int]:
        """Token ids banned until min_tokens are out: EOS (unless ignore_eos) and the stop token ids."""
        return sorted((set() if params.ignore_eos else self.eos_token_ids) | set(params.stop_token_ids))

    def add_request(self, request_id: str | None, prompt: str | None, sampling_params: SamplingParams | None = None,
                    prompt_token_ids: list[int] | None = None, arrival_time: float | None = None) -> str:
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use; give each request a unique id")
        prompt_token_ids, params = self.validate_request(prompt, sampling_params, prompt_token_ids)
        now = arrival_time or time.time()
        base_seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        seqs = []
        banned = self._min_tokens_banned(params)
        for i in range(params.n):
            matcher = self.grammars.matcher(params.structured_outputs) if params.structured_outputs is not None else None
            seqs.append(Sequence(request_id, i, prompt_token_ids, params, base_seed + i, now, eos_ids_for_min_tokens=banned,
                                 detokenizer=output_processor.make_detokenizer(self.tokenizer, params), matcher=matcher,
                                 parent=seqs[0] if i > 0 else None))
        req = Request(request_id, prompt, prompt_token_ids, params, seqs, now)
        self.requests[request_id] = req
        for seq in seqs:
            self._seq_request[seq.seq_id] = req
            self.scheduler.add(seq)
        self.prompt_tokens_total += len(prompt_token_ids)
        return request_id

    def adopt_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams, first_token: int,
                      arrival_time: float, pages: list[int] | None = None, logprobs: list | None = None,
                      cumulative_logprob: float = 0.0) -> RequestOutput:
        """Continue a request (n == 1) whose prompt another engine computed and whose first token it sampled
        (disaggregated.py). With `pages` (taken from this block manager, the prompt's K/V written into them)
        it decodes at once; without them its prompt and first token are recomputed here, as after a
        preemption. `logprobs`: the first token's entry, when asked. Returns the output with that token."""
        self.add_request(request_id, prompt, params, prompt_token_ids, arrival_time)
        req = self.requests[request_id]
        seq = req.seqs[0]
        self._append(seq, first_token, 0, None, None, None, False, time.time())
        if logprobs:
            seq.take_logprobs(logprobs, cumulative_logprob)
        if pages is not None:
            self.scheduler.resume(seq, pages, len(prompt_token_ids))
        req.first_token_time = seq.first_token_time
        if seq.finish_reason is not None:
            self._finish(seq)
        output = output_processor.make_request_output(req)
        if req.finished:
            self.requests.pop(request_id, None)
            self._seq_request.pop(seq.seq_id, None)
        return output

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request and free its pages. Returns its last output (every unfinished sample with
        finish_reason "abort"), or None for a request the engine does not hold."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        for seq in req.seqs:
            if not seq.finished:
                output_processor.abort(seq)
                self._finish(seq)
            self._seq_request.pop(seq.seq_id, None)
        return output_processor.make_request_output(req)

    def abort_all(self) -> list[str]:
        """Abort every request and drop the step in flight (after a failed step). Returns their ids."""
        ids = list(self.requests)
        for rid in ids:
            self.abort_request(rid)
        self._in_flight = None
        return ids

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or self._in_flight is not None

    def stats(self) -> EngineStats:
        bm = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_pages_total=bm.num_pages - 1, num_pages_used=bm.num_used_pages,
            prefix_cache_query_tokens=bm.prefix_query_tokens, prefix_cache_hit_tokens=bm.prefix_hit_tokens,
            num_preemptions=self.scheduler.num_preemptions, prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total, num_steps=self.num_steps,
            spec_num_drafts=self.spec_counts["drafts"], spec_num_draft_tokens=self.spec_counts["draft_tokens"],
            spec_num_accepted_tokens=self.spec_counts["accepted"],
            spec_accepted_per_position=tuple(self.spec_accepted_per_position),
            spec_num_ahead_rows=self.spec_counts["ahead"], spec_num_ahead_discarded=self.spec_counts["discarded"],
            device_cache_hit_tokens=bm.device_hit_pages * bm.page_size, host_cache_hit_tokens=bm.host_hit_pages * bm.page_size,
            **(_host_tier_stats(bm.host_tier) if bm.host_tier is not None else {}))

    # ---- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        timing = self.step_seconds
        if self._in_flight is not None and self.scheduler.waits_for_step():
            t0 = time.perf_counter()
            touched = self._read_back(self._in_flight, None)  # the drafts follow its tokens
            self._in_flight = None
            timing["wait_and_process"] += time.perf_counter() - t0
            self._in_flight = self._schedule_and_launch()
            t0 = time.perf_counter()
            outputs = self._outputs(touched)
            timing["wait_and_process"] += time.perf_counter() - t0
            return outputs
        launched = self._schedule_and_launch()
        t1 = time.perf_counter()
        outputs = self._outputs(self._read_back(self._in_flight, launched)) if self._in_flight is not None else []
        timing["wait_and_process"] += time.perf_counter() - t1
        self._in_flight = launched
        return outputs

    def _schedule_and_launch(self):
        """Schedule the next step and launch it; what _read_back needs of it, or None for an empty plan."""
        timing = self.step_seconds
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        if self.block_manager.host_tier is not None:  # evicted pages to host, hits back, before the launch
            t_tier = time.perf_counter()
            self.block_manager.host_tier.sync(self.runner)
            timing["tier"] += time.perf_counter() - t_tier
        for seq in plan.preempted:
            self._release_slot(seq)
        launched = None
        t1 = time.perf_counter()
        timing["schedule"] += t1 - t0
        if plan.rows:
            for r in plan.rows:
                self._ensure_slot(r.seq)
                if r.seq.restore_from:  # a prefix-cache hit of a hybrid model: its saved state into its slot first
                    self.runner.copy_state_slot(r.seq.restore_from, r.seq.state_slot)
                    r.seq.state_restored()
            inp, guide_mask = self.runner.prepare(plan, self._slots, self.grammars.fill_masks)
            t2 = time.perf_counter()
            timing["prepare"] += t2 - t1
            # Read back before the next launch: a step verifying drafts that no row will be drafted ahead of.
            serial = self.proposer is not None and any(r.drafts and not (self.scheduler.draft_ahead and r.seq.kept_all_drafts)
                                                       for r in plan.rows)
            out = self.runner.launch(inp, guide_mask, serial=serial)
            drafting = self.proposer.launch(plan, inp, out) if self.proposer is not None else None
            t1 = time.perf_counter()
            timing["launch"] += t1 - t2
            if self.state_pool is not None and self.state_pool.num_snapshots:
                self._save_states(plan)
            for row, r in enumerate(plan.rows):
                r.seq.launched(r.start + r.num_tokens, row if r.samples else None, r.drafts)
            if self.proposer is not None:
                self.spec_counts["ahead"] += sum(r.ahead for r in plan.rows)
            launched = (plan, out, bool(inp.sampling.want_logprobs), bool(inp.want_prompt_logprobs), drafting)
            self.num_steps += 1
        return launched

    def _save_states(self, plan) -> None:
        """Snapshot the state of each row whose chunk ended at its prompt's snapshot point (state_pool.py),
        enqueued after the step that computed it."""
        ps = self.config.page_size
        for r in plan.rows:
            seq = r.seq
            point = self.state_pool.snapshot_point(len(seq.prompt_token_ids), ps)
            if point and r.start + r.num_tokens == point:
                slot = self.state_pool.snapshot_slot(prefix_key(seq.prompt_token_ids, point // ps, ps))
                if slot:
                    self.runner.copy_state_slot(seq.state_slot, slot)

    def _ensure_slot(self, seq: Sequence) -> None:
        p = seq.params
        uses_penalties = p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
        if uses_penalties and seq.seq_id not in self._slots:
            slot = self._free_slots.pop()
            self._slots[seq.seq_id] = slot
            self.runner.write_history(slot, seq.all_token_ids)

    def _release_slot(self, seq: Sequence) -> None:
        slot = self._slots.pop(seq.seq_id, None)
        if slot is not None:
            self._free_slots.append(slot)

    def _finish(self, seq: Sequence) -> None:
        if seq.request_id in self.kv_exports and seq.finish_reason != "abort":
            self.block_manager.hold(seq.pages)
            self.kv_exports[seq.request_id] = list(seq.pages)
        self.scheduler.finish(seq)
        self._release_slot(seq)

    def _read_back(self, launched, next_launched) -> dict[str, Request]:
        """Wait for a launched step and take its tokens into their sequences (finishing those that end);
        returns the requests it touched, for _outputs. next_launched: the step launched after it (None
        when none is), whose rows drafted ahead of a rejected draft are discarded here."""
        plan, out, want_lp, want_plp, drafting = launched
        ahead = ({r.seq.seq_id: r for r in next_launched[0].rows if r.ahead}
                 if next_launched is not None and self.scheduler.draft_ahead else {})
        t0 = time.perf_counter()
        if any(r.drafts for r in plan.rows):  # both arrays in one wait
            tokens, accepted = (np.asarray(a) for a in jax.device_get((out.tokens, out.accepted)))
        else:
            tokens, accepted = np.asarray(out.tokens), None  # waits for the step
        self.step_seconds["wait"] += time.perf_counter() - t0
        lp = top_ids = top_lps = None
        if want_lp:
            lp, top_ids, top_lps = np.asarray(out.logprob), np.asarray(out.top_ids), np.asarray(out.top_logprobs)
        if want_plp:
            output_processor.record_prompt_logprobs(plan, out)
        now = time.time()
        touched: dict[str, Request] = {}
        j = 0  # the row's first sampled position
        for r in plan.rows:
            seq = r.seq
            if not r.samples:
                self._register_full_pages(seq)
                continue
            first, j = j, j + len(r.drafts) + 1
            if r.discarded:
                continue  # drafted ahead of a rejected draft: its token was never pending (discard_row_ahead)
            seq.fetched()
            if seq.finished or seq.seq_id not in self._seq_request:
                continue  # aborted, or finished by an earlier token: this one was a wasted step
            new_tokens = [int(tokens[first])]
            if r.drafts:
                new_tokens = speculative.kept_tokens(r.drafts, tokens[first:j], accepted[first:j])
                self._count_drafts(len(r.drafts), len(new_tokens) - 1)
                kept_all = len(new_tokens) == len(r.drafts) + 1
                seq.drafts_verified(kept_all)
                row_ahead = ahead.get(seq.seq_id)
                # The K/V past the kept drafts are the rejected drafts': not part of the sequence. A row drafted
                # ahead of them stands at the wrong positions; one drafted ahead of drafts all kept is the next.
                if row_ahead is None:
                    seq.roll_back_to(r.start + len(new_tokens))
                elif not kept_all:
                    seq.discard_row_ahead(r.start + len(new_tokens))
                    row_ahead.discarded = True
                    self.spec_counts["discarded"] += 1
            for i, token in enumerate(new_tokens):
                if seq.finish_reason is not None:
                    break
                self._append(seq, token, first + i, lp, top_ids, top_lps, want_lp, now)
            self._register_full_pages(seq)
            if seq.finish_reason is not None:
                self._finish(seq)
            req = self._seq_request[seq.seq_id]
            if req.first_token_time is None:
                req.first_token_time = now
            touched[req.request_id] = req
        if self.proposer is not None:
            self.proposer.collect(plan, drafting)
        return touched

    def _outputs(self, touched: dict[str, Request]) -> list[RequestOutput]:
        """The request outputs of the requests a read-back step touched; finished requests are dropped."""
        outputs = []
        for req in touched.values():
            if output_processor.wants_output(req):
                outputs.append(output_processor.make_request_output(req))
            if req.finished:
                self.requests.pop(req.request_id, None)
                for s in req.seqs:
                    self._seq_request.pop(s.seq_id, None)
        return outputs

    def _append(self, seq: Sequence, token: int, position: int, lp, top_ids, top_lps, want_lp: bool, now: float) -> None:
        """One sampled token (of sampled position `position`) into its sequence: text, logprobs, finish."""
        # A token the grammar refuses is not kept: grammar_accepts finished the sequence with "error".
        if seq.matcher is not None and not output_processor.grammar_accepts(seq, token):
            return
        if want_lp and seq.params.logprobs is not None:
            entry = output_processor.logprob_dict(token, lp[position], top_ids[position], top_lps[position], seq.params.logprobs)
            seq.append_token(token, now, entry, float(lp[position]))
        else:
            seq.append_token(token, now)
        self.generation_tokens_total += 1
        output_processor.append_token(seq, token, self.eos_token_ids, self.max_model_len)
        if seq.matcher is not None and seq.finish_reason is None and seq.matcher.is_stopped():
            output_processor.finish_grammar(seq)

    def _count_drafts(self, num_drafts: int, num_kept: int) -> None:
        self.spec_counts["drafts"] += 1
        self.spec_counts["draft_tokens"] += num_drafts
        self.spec_counts["accepted"] += num_kept
        for i in range(num_kept):
            self.spec_accepted_per_position[i] += 1

    def _register_full_pages(self, seq: Sequence) -> None:
        """Publish pages that are now full and whose tokens the host knows (prefix caching)."""
        if seq.pages:
            num_known = seq.num_tokens - seq.num_pending_tokens
            num_full = min(seq.num_computed_tokens, num_known) // self.block_manager.page_size
            if self.kv_pages is not None:
                self.kv_pages.publish(seq, num_full)
            else:
                seq.add_page_keys(self.block_manager.publish_full_pages(seq.pages, seq.page_keys, seq.token_slice, num_full))

    def run_to_completion(self) -> None:
        while self.has_unfinished_requests():
            self.step()


def _host_tier_stats(tier: HostTier) -> dict:
    return dict(host_cache_offloaded_pages=tier.offloaded_pages, host_cache_dropped_pages=tier.dropped_pages,
                host_cache_pages_used=tier.num_used, host_cache_pages_total=tier.capacity)

