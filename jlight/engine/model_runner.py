"""ModelRunner: owns the weights, the KV pools and the jitted step; runs what the scheduler planned.

One jitted step per token-count bucket (rows are bucketed with it), all compiled at
start-up; a bucket whose attention runs a cheaper path over a narrow page table
(Kernels.short_table_span: short contexts skip flash-decoding's combine) compiles a second
variant, which the steps whose rows all fit that table run; with `serial_steps` every variant compiles once more
without XLA's command buffers, for the steps the host waits for before it launches the next (verify steps:
their device work starts at the first kernel, not after the whole graph's update). The step embeds, runs the
model over the ragged batch, samples on device and
returns only the sampled ids (plus logprobs when asked). Decode tokens sampled by the
previous step never visit the host: the step reads them from the previous step's output
(`from_prev`), so the host can launch step N+1 before it has seen step N's tokens.
The step's host inputs travel packed in two buffers (step_packing.py says why).
The K/V pools start abstract (shapes, dtypes, shardings): the engine may compile the largest bucket
against them to learn its memory before it sizes the pool (startup.py), then `allocate_pools` makes them.

Rows and sampled positions: a row is one sequence's tokens in the step ([B] arrays: the page
table, the context lengths); a sampled position is a token whose logits the step samples from
([S] arrays: the sampling parameters, the draft each position verifies, the sampled tokens).
A row samples at its last token, or, verifying k drafts (speculative.py), at each of its k + 1
tokens; S is B plus room for the drafts of the rows the engine speculates for (`draft_slots`).
A device proposer (proposers/device.py) runs after the step on what the step `taps` for it: the step's
input tokens and the target's hidden states at every token.
"""
from __future__ import annotations

import concurrent.futures
import functools
import itertools
import logging
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jlight.core.batch_metadata import BatchMetadata
from jlight.core.parallel_ops import ParallelOps
from jlight.core.quantization import QuantizedKV, make_kv_pool, scales_sharding
from jlight.core.recurrent_state import PagesAndState, zeros_like_shapes
from jlight.engine import kv_groups, param_packing, sampler, step_packing
from jlight.engine.sequence import SequenceStateError
from jlight.engine.scheduler import SchedulePlan

logger = logging.getLogger(__name__)


class StepInputs(NamedTuple):
    tokens: jax.Array  # [T] int32 (ignored where from_prev >= 0)
    from_prev: jax.Array  # [T] int32 row of the previous step's sample to use as the token, or -1
    md: BatchMetadata  # its logits_indices are [S]: the flat token of each sampled position
    sampling: sampler.SamplingInputs  # [S]
    history_slot: jax.Array  # [S] int32 row of the token-history buffer (the dummy row if unused)
    prompt_len: jax.Array  # [S] int32
    history_len: jax.Array  # [S] int32 tokens known before this position's sample
    row_sample: jax.Array  # [B] int32 each row's last sampled position (its token for from_prev)
    next_token: jax.Array  # [T] int32 the following prompt token (prompt logprobs), -1 if none
    want_prompt_logprobs: jax.Array  # [] bool


class StepOutputs(NamedTuple):
    tokens: jax.Array  # [S]
    logprob: jax.Array  # [S]
    top_ids: jax.Array  # [S, N]
    top_logprobs: jax.Array  # [S, N]
    accepted: jax.Array  # [S] bool, the position kept the draft it verified
    prompt_logprob: jax.Array  # [T]
    prompt_top_ids: jax.Array  # [T, N]
    prompt_top_logprobs: jax.Array  # [T, N]
    # What the step taps for a device proposer (Taps), else None:
    input_tokens: jax.Array | None = None  # [T] int32, the tokens the step ran (from_prev ones resolved)
    hidden: jax.Array | None = None  # [T, embed] the final normed hidden states, or [T, n * embed] the tapped layers'
    # With prompt_logprobs_program: [T, embed] the final normed hidden states, the prompt-logprobs program's input
    final_hidden: jax.Array | None = None


class Taps(NamedTuple):
    """What a step returns beyond its samples for a device proposer: always its input tokens; with
    `hidden` the final normed hidden state of every token; with `layers` instead the residual stream
    entering each of those layers (num_layers: after the last), concatenated (EAGLE-3's fused features)."""
    hidden: bool = False
    layers: tuple[int, ...] = ()


def padded_pages(pages: list[int]) -> np.ndarray:
    """Page ids for read_pages / write_pages, padded with scratch page 0 to a power-of-two count (one
    compiled copy per count)."""
    out = np.zeros(1 << max(0, (len(pages) - 1).bit_length()), np.int32)
    out[: len(pages)] = pages
    return out


def _stacked_sharding(sharding):
    """The placement of a page stacked K over V (a new leading axis) from its pools': one device's, or a
    NamedSharding's with the new axis unsplit; None for other kinds (those pages stay pairs)."""
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(None, *sharding.spec),
                                          memory_kind=sharding.memory_kind)
    return None


def token_buckets(max_num_batched_tokens: int, smallest: int = 8, one_token: bool = False, extra=()) -> list[int]:
    """Powers of two from `smallest` up to max_num_batched_tokens (always the last), with one_token a 1-token
    bucket below them (batch-1 decode on the CPU, whose matmul time follows the rows), and the `extra` sizes
    (EngineConfig.extra_token_buckets) among them."""
    buckets, b = ([1] if one_token and smallest > 1 else []), smallest
    while b < max_num_batched_tokens:
        buckets.append(b)
        b *= 2
    buckets.append(max_num_batched_tokens)
    return sorted(set(buckets) | {e for e in extra if e < max_num_batched_tokens})


# XLA options of the jitted step. Without CUB's radix sort, XLA:GPU sorts with its own kernels, which its
# CUDA graphs can hold. A CUB sort is a custom call outside them, and the sampler's sorts (top-k/top-p, the
# logprobs' top_k) sit under lax.conds: a conditional whose branch holds one runs as a host-side thunk that
# copies its predicate to the host and waits for it, i.e. for the whole forward pass. So the host could not
# queue the next step while the device ran this one: at 64 decoding sequences on the H200 the option
# takes the host's wait inside a step from most of the step to a small part of it (docs/BENCHMARKS.md).
# (The flag is XLA:GPU's; other backends accept and ignore it.)
# Without the rematerialization pass: XLA:GPU's remat pass counts the step's parameters (the weights and
# the donated K/V pools, which the engine sizes to fill the device) as memory the step uses, against a
# limit from which the sizes of those same parameters and outputs were already subtracted (the scheduler's
# limit: the allocator's bytes less the inputs and outputs). So every step whose pools fill the GPU looks
# over budget: the pass recomputes what it can, which cannot bring the parameters down, and warns "Can't
# reduce memory use below 88.45GiB ... only reduced to 152.40GiB", which users read as an out-of-memory.
# An inference step's own temporaries are small next to the pools the engine planned for it; nothing is
# worth recomputing. (The CPU compiler has no such pass; the option is harmless there.)
STEP_COMPILER_OPTIONS = {"xla_gpu_enable_cub_radix_sort": False, "xla_disable_hlo_passes": "rematerialization"}
# Prompt logprobs: the tokens whose full-vocabulary float32 logits exist at once, a chunk after the other. Every
# token of an 8192-token step at once would be the step's largest buffer (4 GiB of logits for a 128k vocabulary,
# and as much again for their log-softmax), and the compiled step keeps room for it whether a step asks for
# prompt logprobs or not.
PROMPT_LOGPROB_CHUNK = 256
# A step's kernels launched one by one as the host enqueues them, not as XLA:GPU's command buffers (CUDA graphs):
# the options of the serial variant (ModelRunner's serial_steps; EngineConfig.verify_step_command_buffers says when).
SERIAL_STEP_COMPILER_OPTIONS = {**STEP_COMPILER_OPTIONS, "xla_gpu_enable_command_buffer": ""}


def kv_pool_dtype(compute_dtype, gpu: bool):
    """The dtype of a float KV pool (kv_cache_dtype "auto"): the model's compute dtype on a GPU, float32 on the
    CPU. XLA:CPU computes 16-bit floats in float32 and widens a whole operand to do so, so each layer's in-place
    write into a bfloat16 pool converted the whole pool: SmolLM2-135M's shape in bfloat16 with the CPU's
    default 2 GiB pool decoded at 14 s a token, against 120 ms with float32 pages."""
    return compute_dtype if gpu else np.dtype(np.float32)


def matmul_precision(compute_dtype) -> str | None:
    """The step's matmul precision: full float32 for a float32 model, else XLA's default.

    XLA:GPU multiplies float32 matrices in TF32 unless told otherwise (a 10-bit mantissa: a tiny float32
    Llama's logprobs land ~1e-4 off transformers' float32 ones, past the tests' bar). Whoever runs
    a model in float32 wants the reference's numbers, as torch gives them (TF32 off for matmuls by
    default). No effect on CPU, whose float32 dots are exact, or on bf16 operands."""
    return "highest" if jnp.dtype(compute_dtype) == jnp.float32 else None


class ModelRunner:
    def __init__(self, family, config, params, kernels, *, num_pages, page_size, max_num_seqs, max_num_batched_tokens,
                 max_model_len, kv_dtype, kv_cache_dtype="auto", sharding_plan=None, collective_matmul=False,
                 int8_all_reduce=False, min_token_bucket=8, one_token_bucket=False, extra_token_buckets=(), guide_mask_words=1,
                 draft_slots=0, num_state_slots=0, executable_store=None, kv_layout=None, taps: Taps | None = None,
                 serial_steps: bool = False, pack_small_params: bool = False, prompt_logprobs_program: bool = False):
        """draft_slots: sampled positions each step holds beyond one a row, for speculative drafts.
        serial_steps: compile every step variant a second time with SERIAL_STEP_COMPILER_OPTIONS, for the steps
        launched with serial=True (those the host waits for before it launches the next); False: those run the
        same executables as the others.
        taps: what each step returns for a device proposer (Taps); None: nothing beyond its samples.
        pack_small_params: the steps take params' small vectors grouped into one array a dtype (param_packing.py).
        prompt_logprobs_program: a step that wants prompt logprobs gets them from a second program launched after it
        over its final hidden states (_prompt_logprobs_program); False: from a branch of the step under a lax.cond.
        num_state_slots: a hybrid model's recurrent-state slots (state_pool.StatePool.total_slots).
        executable_store: an executable_store.ExecutableStore the warm-up loads compiled buckets from and
        saves them to; None: every bucket is traced and compiled.
        kv_layout: the pool's jlight/core/kv_layout.KVGroups (layers grouped by attention kind; a step
        then carries every group's page table); None: one group."""
        self.executable_store = executable_store
        self.warmup_timings: list[dict] = []  # a dict a step variant warm-up made: its bucket, seconds lowering and compiling, or loading
        self.family, self.config, self.params, self.kernels = family, config, params, kernels
        # The params as the step's calls pass them: params itself, or (pack_small_params) its large arrays beside
        # its small vectors grouped, which the step unpacks (param_packing.py).
        self._pack_plan = param_packing.plan(params) if pack_small_params else None
        self.step_params = params if self._pack_plan is None else param_packing.pack(params, self._pack_plan)
        self.draft_slots = draft_slots
        self.page_size, self.num_pages = page_size, num_pages
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.max_pages_per_seq = -(-max_model_len // page_size)
        self.buckets = token_buckets(max_num_batched_tokens, min(min_token_bucket, max_num_batched_tokens), one_token_bucket,
                                     extra_token_buckets)
        # bucket -> the narrower page-table width (pages) of its second variant, where the kernels offer one
        self.short_tables = {}
        if kernels.short_table_span is not None:
            for T in self.buckets:
                pages = kernels.short_table_span(T, min(T, max_num_seqs), config.num_kv_heads) // page_size
                if 0 < pages < self.max_pages_per_seq:
                    self.short_tables[T] = pages
        self.num_kv_groups = 1 if kv_layout is None else kv_layout.num_groups
        self.group_windows = (None,) if kv_layout is None else kv_layout.windows
        self._kv_layout, self._sharding_plan = kv_layout, sharding_plan
        self.kv_cache_dtype, self.kv_dtype = kv_cache_dtype, kv_dtype
        # A hybrid model's recurrent layers keep their state pools (one slot a running sequence, state_pool.py)
        # beside its attention layers' K pages (jlight/core/recurrent_state.py); allocated here (no page axis).
        self.stateful = hasattr(family, "state_shapes")
        self._state = None
        if self.stateful:
            self._state = zeros_like_shapes(family.state_shapes(config, num_state_slots))
            if sharding_plan is not None and sharding_plan.mesh is not None:  # replicated: every device runs them whole
                self._state = jax.device_put(self._state, jax.sharding.NamedSharding(sharding_plan.mesh, jax.sharding.PartitionSpec()))
            self._copy_slot = jax.jit(lambda state, src, dst: {n: a.at[:, dst].set(a[:, src]) for n, a in state.items()},
                                      donate_argnums=(0,))
        # The K/V pools of num_pages pages, abstract (shapes, dtypes and shardings) until allocate_pools: the
        # engine may compile the largest step against them first, to size the pool beside its memory.
        self.k_cache, self.v_cache = self._pools(num_pages, abstract=True)
        self.history_dummy_slot = max_num_seqs
        self.history = jnp.zeros((max_num_seqs + 1, max_model_len + 1), jnp.int32)  # [slots + dummy, tokens]
        self.prev_sampled = jnp.zeros((max_num_seqs,), jnp.int32)
        # Structured outputs: each step takes a [B, W] allowed-token bitmask. Steps without constrained
        # rows pass this bucket's all-ones mask, made once here on the device (under a data-parallel
        # replica's default device), so they copy nothing; a step with constrained rows passes its own.
        self.guide_mask_words = guide_mask_words
        self._no_guide = {self.num_samples(T): jnp.full((self.num_samples(T), guide_mask_words), -1, jnp.int32)
                          for T in self.buckets}
        # Under a mesh both kinds of mask are replicated over it (a host array would be another jit cache
        # key than the committed all-ones one: a compile at the first constrained step).
        self._mask_sharding = None
        if sharding_plan is not None and sharding_plan.mesh is not None:
            self._mask_sharding = jax.sharding.NamedSharding(sharding_plan.mesh, jax.sharding.PartitionSpec())
            self._no_guide = {B: jax.device_put(m, self._mask_sharding) for B, m in self._no_guide.items()}

        self.taps = taps
        # jit's own cache holds its compiled forms, one a bucket, each compiled at its bucket's first use
        self._prompt_logprobs = jax.jit(self._prompt_logprobs_program) if prompt_logprobs_program else None

        def model_fn(params, k_cache, v_cache, tokens, md, ops):
            if taps is not None and taps.layers:
                hidden, tapped, k_cache, v_cache = family.forward_tapping(params, config, tokens, k_cache, v_cache, md,
                                                                          kernels, ops, taps.layers)
            else:
                hidden, k_cache, v_cache = family.forward(params, config, tokens, k_cache, v_cache, md, kernels, ops)
                tapped = hidden if taps is not None and taps.hidden else None
            logits = family.compute_logits(params, config, hidden[md.logits_indices], kernels, ops)  # [B, V] float32
            return (hidden, logits, tapped), k_cache, v_cache

        # The parallel ops reach the model as an argument: the plan's tensor-parallel ones under a mesh.
        if sharding_plan is not None:
            self._model_fn = sharding_plan.wrap(model_fn, collective_matmul=collective_matmul, int8_all_reduce=int8_all_reduce)
        else:
            self._model_fn = functools.partial(model_fn, ops=ParallelOps())
        self._precision = matmul_precision(params["final_norm"].dtype)  # the model's compute dtype
        jit_step = functools.partial(jax.jit, self._packed_step, donate_argnums=(1, 2, 3), static_argnums=(8,))
        self._step = jit_step(compiler_options=STEP_COMPILER_OPTIONS)
        # The serial variant (serial_steps): the same program under SERIAL_STEP_COMPILER_OPTIONS, or None.
        self._serial_step = jit_step(compiler_options=SERIAL_STEP_COMPILER_OPTIONS) if serial_steps else None
        self._write_history = jax.jit(lambda h, slot, row: h.at[slot].set(row), donate_argnums=(0,))
        self._executables = {}  # step_packing.Layout -> the bucket's step compiled ahead of time (warmup)
        self._serial_executables = {}  # the same, of the serial variant
        # Whole pages in and out of the pools (host_tier.py, disaggregated.py); a pool without a page axis
        # (MLA's unused V pool) passes through as None.
        paged = lambda a: a.shape[1] == self.num_pages  # read while tracing
        self._read_pages = jax.jit(lambda pools, pages: jax.tree.map(lambda a: a[:, pages] if paged(a) else None, pools))
        self._write_pages = jax.jit(
            lambda pools, pages, data: jax.tree.map(lambda a, d: a.at[:, pages].set(d) if paged(a) else a, pools, data,
                                                    is_leaf=lambda x: x is None),
            donate_argnums=(0,))
        # The same, one page at a time (the host tier's unit of storage): the gather of n pages as n outputs,
        # and the scatter of n such pages in one call, the pools donated. A page is one array [2, layers, 1, ...]
        # (K over V) where the two pools are plain arrays of one shape, dtype and placement (`_stacked_pages`),
        # else its leaves' pytree (k, v); every array a page costs the tier's sync a host call each way.
        def read_page_list(pools, pages):
            one = lambda i: jax.tree.map(lambda a: a[:, pages[i:i + 1]] if paged(a) else None, pools)
            return [jnp.stack(one(i)) if self._stacked_pages() else one(i) for i in range(pages.shape[0])]

        def write_page_list(pools, pages, data):
            if self._stacked_pages():
                return tuple(a.at[:, pages].set(jnp.concatenate([d[j] for d in data], axis=1))
                             for j, a in enumerate(pools))
            return jax.tree.map(lambda a, *d: a.at[:, pages].set(jnp.concatenate(d, axis=1)) if paged(a) else a,
                                pools, *data, is_leaf=lambda x: x is None)
        self._read_page_list_fn, self._write_page_list_fn = read_page_list, write_page_list
        self._read_page_list = jax.jit(read_page_list)
        self._write_page_list = jax.jit(write_page_list, donate_argnums=(0,))
        self._stacked = None  # _stacked_pages' answer, once the pools exist
        # ("read" | "write" | "read_list" | "write_list" | "read_list_host" | "write_list_host", page count) ->
        # compiled ahead of time (warmup_page_copies); the _host kinds move the pages to and from pinned host
        # memory inside the program (read_page_list / write_page_list with host=True)
        self._page_copies = {}

    # ---- the K/V pools --------------------------------------------------------------------
    def _pools(self, num_pages: int, abstract: bool):
        """(k_cache, v_cache) of num_pages pages: zeroed on the devices, or (abstract) as ShapeDtypeStructs
        with the shardings the zeroed ones get. A hybrid model's K pool carries the recurrent state."""
        if self._kv_layout is None:
            k_shape, v_shape = self.family.kv_cache_shapes(self.config, num_pages, self.page_size)
        else:
            k_shape, v_shape = kv_groups.pool_shapes(self.family, self.config, num_pages, self.page_size, self._kv_layout)
        plan = self._sharding_plan
        k_shard, v_shard = plan.kv_cache_shardings(k_shape, v_shape) if plan is not None else (None, None)
        make = _abstract_kv_pool if abstract else make_kv_pool
        # [layers, pages, page_size, kv_heads, head_dim] each: arrays of kv_dtype, or int8 QuantizedKV pools
        k_cache = make(k_shape, self.kv_cache_dtype, self.kv_dtype, k_shard)
        v_cache = make(v_shape, self.kv_cache_dtype, self.kv_dtype, v_shard)
        return (PagesAndState(k_cache, self._state), v_cache) if self.stateful else (k_cache, v_cache)

    def size_pools(self, num_pages: int) -> None:
        """Give the K/V pools num_pages pages, still abstract (steps compile against them, nothing is allocated).
        Steps compiled before against pools of another size are dropped (the warm-up compiles them again); those
        compiled against this size are kept."""
        if num_pages != self.num_pages:
            self._executables.clear()
            self._serial_executables.clear()
            self._page_copies.clear()
            self.num_pages = num_pages
            self.k_cache, self.v_cache = self._pools(num_pages, abstract=True)

    def allocate_pools(self, num_pages: int) -> None:
        """Allocate the K/V pools with num_pages pages (zeroed), keeping the steps compiled against that size
        (size_pools)."""
        self.size_pools(num_pages)
        self.k_cache, self.v_cache = self._pools(num_pages, abstract=False)

    def _layouts(self, T: int) -> list:
        """The step_packing layouts of the T-token bucket's variants (the keys of its compiled steps)."""
        return [step_packing.pack(self.padding_inputs(T, width))[2] for _, width in self.step_variants([T])]

    def is_compiled(self, T: int) -> bool:
        """Whether warmup made or loaded every compiled step of the T-token bucket (each variant, each kind)."""
        tables = [self._executables] + ([self._serial_executables] if self._serial_step is not None else [])
        return all(layout in table for layout in self._layouts(T) for table in tables)

    def compiled_steps(self, T: int) -> list:
        """The compiled steps of the T-token bucket (each of its variants) that warmup made or loaded."""
        return [self._executables[layout] for layout in self._layouts(T) if layout in self._executables]

    # ---- the device function ------------------------------------------------------------
    def _packed_step(self, params, k_cache, v_cache, history, prev_sampled, ints, floats, guide_mask,
                     layout: step_packing.Layout):
        inp = step_packing.unpack(layout, ints, floats)
        if self._pack_plan is not None:
            params = param_packing.unpack(*params, self._pack_plan)
        with jax.default_matmul_precision(self._precision):  # read while tracing: part of the compiled step
            return self._step_impl(params, k_cache, v_cache, history, prev_sampled, inp, guide_mask)

    def _step_impl(self, params, k_cache, v_cache, history, prev_sampled, inp: StepInputs, guide_mask):
        tokens = jnp.where(inp.from_prev >= 0, prev_sampled[jnp.maximum(inp.from_prev, 0)], inp.tokens)
        (hidden, logits, tapped), k_cache, v_cache = self._model_fn(params, k_cache, v_cache, tokens, inp.md)
        hist = (history[inp.history_slot], inp.prompt_len, inp.history_len)
        toks, lp, top_ids, top_lps, accepted = sampler.sample(logits, inp.sampling, history=hist, guide_mask=guide_mask)
        history = history.at[inp.history_slot, inp.history_len].set(toks)
        num_tokens, n = tokens.shape[0], sampler.NUM_TOP_LOGPROBS
        final_hidden = None
        if self._prompt_logprobs is not None:  # the prompt-logprobs program runs over them when a step asks
            final_hidden, p_lp, p_ids, p_vals = hidden, None, None, None
        else:
            none = (jnp.zeros((num_tokens,), jnp.float32), jnp.zeros((num_tokens, n), jnp.int32),
                    jnp.zeros((num_tokens, n), jnp.float32))
            p_lp, p_ids, p_vals = jax.lax.cond(inp.want_prompt_logprobs,
                                               lambda h: self._prompt_logprobs_of(params, h, inp.next_token),
                                               lambda h: none, hidden)
        row_tokens = toks[inp.row_sample]  # [B]
        sampled_full = jnp.zeros((self.max_num_seqs,), jnp.int32).at[: row_tokens.shape[0]].set(row_tokens)
        out = StepOutputs(toks, lp, top_ids, top_lps, accepted, p_lp, p_ids, p_vals,
                          tokens if self.taps is not None else None, tapped, final_hidden)
        return k_cache, v_cache, history, sampled_full, out

    def _prompt_logprobs_of(self, params, hidden, next_token):
        """hidden [T, embed] the final normed hidden states, next_token [T] int32 (-1: none) -> (the logprob of each
        next token [T], the top NUM_TOP_LOGPROBS ids [T, N] and logprobs [T, N]): PROMPT_LOGPROB_CHUNK tokens'
        full-vocabulary logits at a time, the chunks one after the other."""
        num_tokens, n = hidden.shape[0], sampler.NUM_TOP_LOGPROBS
        chunk = min(num_tokens, PROMPT_LOGPROB_CHUNK)
        pad = -num_tokens % chunk
        h_chunks = jnp.pad(hidden, ((0, pad), (0, 0))).reshape(-1, chunk, hidden.shape[-1])
        next_chunks = jnp.pad(jnp.maximum(next_token, 0), (0, pad)).reshape(-1, chunk)

        def one_chunk(args):
            h_c, next_c = args
            # Outside shard_map (plain ops over the global arrays): a sharded LM head may carry vocab padding, cut here.
            logits = self.family.compute_logits(params, self.config, h_c, self.kernels, ParallelOps())[:, : self.config.vocab_size]
            lse = jax.nn.logsumexp(logits, axis=-1)  # [chunk]: log-probabilities are logits - lse
            target = jnp.take_along_axis(logits, next_c[:, None], axis=-1)[:, 0] - lse
            vals, ids = jax.lax.top_k(logits, n)
            return target, ids.astype(jnp.int32), vals - lse[:, None]

        target, ids, vals = jax.lax.map(one_chunk, (h_chunks, next_chunks))
        return target.reshape(-1)[:num_tokens], ids.reshape(-1, n)[:num_tokens], vals.reshape(-1, n)[:num_tokens]

    def _prompt_logprobs_program(self, params, hidden, next_token):
        if self._pack_plan is not None:
            params = param_packing.unpack(*params, self._pack_plan)
        with jax.default_matmul_precision(self._precision):  # the step's
            return self._prompt_logprobs_of(params, hidden, next_token)

    # ---- host side ----------------------------------------------------------------------
    def copy_state_slot(self, src: int, dst: int) -> None:
        """Copy recurrent-state slot src into dst in every pool (a snapshot taken or restored), after the
        steps already launched and before the next."""
        pages, state = self.k_cache
        self.k_cache = PagesAndState(pages, self._copy_slot(state, np.int32(src), np.int32(dst)))

    def num_samples(self, T: int) -> int:
        """Sampled positions of the T-token bucket: one a row (B = min(T, max_num_seqs)) and the draft slots."""
        return min(T, min(T, self.max_num_seqs) + self.draft_slots)

    def bucket_for(self, num_tokens: int) -> int:
        for b in self.buckets:
            if b >= num_tokens:
                return b
        raise ValueError(f"{num_tokens} tokens exceed max_num_batched_tokens={self.buckets[-1]}")

    def table_width(self, T: int, plan: SchedulePlan) -> int:
        """The page table's width (pages) for a step of the T-token bucket: the bucket's narrow variant
        where it has one and every row's pages fit it, else max_model_len's."""
        short = self.short_tables.get(T)
        if short is not None and all(len(r.seq.pages) <= short and all(len(t) <= short for t in (r.seq.group_pages or ()))
                                     for r in plan.rows):
            return short
        return self.max_pages_per_seq

    def num_step_variants(self, buckets) -> int:
        """Compiled steps that `buckets` make (a bucket with a narrow-table variant makes two; the serial
        variant doubles them)."""
        return len(self.step_variants(buckets)) * (2 if self._serial_step is not None else 1)

    def write_history(self, slot: int, token_ids: list[int]) -> None:
        row = np.zeros((self.max_model_len + 1,), np.int32)
        row[: len(token_ids)] = token_ids
        self.history = self._write_history(self.history, np.int32(slot), row)

    def prepare(self, plan: SchedulePlan, slots: dict[int, int], fill_masks=None) -> tuple[StepInputs, np.ndarray | None]:
        """Build the step's host arrays. `slots` maps seq_id -> history slot (penalty users only).

        Returns them with the step's allowed-token bitmask when a sampled position has a grammar matcher
        (`fill_masks([(matcher, position), ...], bitmask)` writes their rows), else None."""
        num_tokens = plan.num_tokens
        T = self.bucket_for(max(num_tokens, 1))
        B, S = min(T, self.max_num_seqs), self.num_samples(T)
        width = self.table_width(T, plan)
        tokens = np.zeros(T, np.int32)
        from_prev = np.full(T, -1, np.int32)
        positions = np.zeros(T, np.int32)
        slot_mapping = np.zeros(T, np.int32)  # padding writes to scratch page 0
        token_seq = np.zeros(T, np.int32)
        next_token = np.full(T, -1, np.int32)
        page_table = np.zeros((B, width), np.int32)
        context_lens = np.zeros(B, np.int32)
        query_start = np.full(B + 1, num_tokens, np.int32)
        row_sample = np.zeros(B, np.int32)
        state_slots = np.zeros(B, np.int32) if self.stateful else None  # padding rows: the scratch slot
        G = self.num_kv_groups
        group_tables = np.zeros((G - 1, B, width), np.int32) if G > 1 else None
        group_slots = np.zeros((G - 1, T), np.int32) if G > 1 else None
        sp = _SampledPositions(S, self.history_dummy_slot)
        want_plp = False
        guided = []  # (matcher, position) of the positions whose token is held to a grammar

        t = j = 0
        ps = self.page_size
        for row, r in enumerate(plan.rows):
            seq, n, start = r.seq, r.num_tokens, r.start
            num_known = seq.num_tokens - seq.num_pending_tokens
            end = start + n
            pos = np.arange(start, end, dtype=np.int32)
            positions[t:t + n] = pos
            if r.ahead:  # drafted ahead: the token the row in flight samples after its drafts, then the drafts
                assert start == num_known + len(seq.in_flight_drafts) and seq.last_row is not None and n == 1 + len(r.drafts)
                from_prev[t] = seq.last_row
                tokens[t + 1:t + n] = r.drafts
            elif r.drafts:  # its last known token, then the drafts it verifies
                assert start == num_known - 1 and n == 1 + len(r.drafts)
                tokens[t] = seq.token_slice(start, start + 1)[0]
                tokens[t + 1:t + n] = r.drafts
            elif end <= num_known:
                tokens[t:t + n] = seq.token_slice(start, end)
            else:  # the last token was sampled by the previous step and is still on device
                assert end == num_known + 1 and seq.last_row is not None and n == 1
                from_prev[t] = seq.last_row
            token_seq[t:t + n] = row
            if len(seq.pages) * ps < end:  # the slots below are read from the tables: they must cover the row
                raise SequenceStateError(f"seq {seq.seq_id}: {len(seq.pages)} pages cannot hold its {end} tokens")
            tables = seq.page_tables()
            page_table[row, : len(seq.pages)] = tables[0]
            if G > 1:  # a window group's entries before its window are null (kv_groups.py): the zeros already there
                for g, table in enumerate(tables[1:]):
                    w = self.group_windows[g + 1]
                    lo = 0 if w is None else max(0, start - w + 1) // ps
                    group_tables[g, row, lo:len(table)] = table[lo:]
            context_lens[row] = end
            query_start[row] = t
            if state_slots is not None:
                state_slots[row] = seq.state_slot
            p = seq.params
            if p.prompt_logprobs is not None and start < len(seq.prompt_token_ids):
                want_plp = True
                nxt = seq.prompt_token_ids[start + 1:min(end + 1, len(seq.prompt_token_ids))]
                next_token[t:t + len(nxt)] = nxt
            if r.samples:
                first = t + n - 1 - len(r.drafts)  # the row's first sampled token
                skip = len(seq.in_flight_drafts) if r.ahead else 0  # output tokens the row in flight adds before it
                for i in range(len(r.drafts) + 1):
                    sp.fill(j + i, first + i, seq, self.config.vocab_size, slots, draft=r.drafts[i] if i < len(r.drafts) else -1,
                            index_offset=skip + i)
                if seq.matcher is not None:
                    guided.append((seq.matcher, j))
                j += len(r.drafts) + 1
                row_sample[row] = j - 1
            t += n
        query_start[len(plan.rows):] = t
        # Every token's slot in the pool, from its row's table (group g's for group_slots[g]); padding keeps slot 0
        # (the scratch page). A row's tables cover its tokens' pages, a window group's from lo on.
        pages_of, offsets = (token_seq[:t], positions[:t] // ps), positions[:t] % ps
        slot_mapping[:t] = page_table[pages_of] * ps + offsets
        if G > 1:
            group_slots[:, :t] = group_tables[(slice(None),) + pages_of] * ps + offsets
        md = BatchMetadata(positions, slot_mapping, token_seq, page_table, context_lens, query_start, sp.logits_indices, state_slots,
                           group_tables, group_slots)
        inp = StepInputs(tokens, from_prev, md, sp.sampling_inputs(bool(guided)), sp.history_slot, sp.prompt_len,
                         sp.history_len, row_sample, next_token, np.bool_(want_plp))
        guide_mask = None
        if guided:
            guide_mask = np.full((S, self.guide_mask_words), -1, np.int32)  # unconstrained positions: every token
            fill_masks(guided, guide_mask)
        return inp, guide_mask

    def read_pages(self, pages: np.ndarray):
        """The K/V of `pages` ([n] int32) as new device arrays: a (k, v) pair of the pools' pytrees, each leaf
        [layers, n, ...]. Dispatched in order with the steps, so it reads what the steps before it wrote."""
        compiled = self._page_copies.get(("read", len(pages)))
        return (compiled or self._read_pages)((self.k_cache, self.v_cache), pages)

    def page_shapes(self, num_pages: int):
        """read_pages' result for num_pages page ids, as ShapeDtypeStructs (None for a pool without pages)."""
        return jax.eval_shape(self._read_pages, (self.k_cache, self.v_cache), jax.ShapeDtypeStruct((num_pages,), np.int32))

    def write_pages(self, pages: np.ndarray, data) -> None:
        """Write `data` (read_pages' form, on this runner's devices) into `pages` ([n] int32; repeats of the
        scratch page 0 are padding), before any step launched after this call."""
        compiled = self._page_copies.get(("write", len(pages)))
        self.k_cache, self.v_cache = (compiled or self._write_pages)((self.k_cache, self.v_cache), pages, data)

    def _stacked_pages(self) -> bool:
        """Whether read_page_list gives a page as one array (K over V): both pools plain paged arrays of one
        shape, dtype and placement (one device, or a NamedSharding, which the stacked page extends by its new axis)."""
        if self._stacked is None:
            k, v = self.k_cache, self.v_cache
            self._stacked = (isinstance(k, jax.Array) and isinstance(v, jax.Array) and k.shape == v.shape
                             and k.dtype == v.dtype and k.shape[1] == self.num_pages and k.sharding == v.sharding
                             and _stacked_sharding(k.sharding) is not None)
        return self._stacked

    def read_page_list(self, pages: np.ndarray, host: bool = False) -> list:
        """read_pages one page at a time: n arrays [2, layers, 1, ...] (K over V) where `_stacked_pages`, else n
        (k, v) pairs of leaves [layers, 1, ...], from one call; host=True: in pinned host memory, copied there by
        the same program."""
        kind = "read_list_host" if host else "read_list"
        compiled = self._page_copies.get((kind, len(pages))) or self._page_list_copy(kind, len(pages))
        return compiled((self.k_cache, self.v_cache), pages)

    def write_page_list(self, pages: np.ndarray, data: list, host: bool = False) -> None:
        """write_pages from read_page_list's form (on this runner's devices; host=True: in pinned host memory,
        copied to the devices by the same program): one call, the pools donated."""
        kind = "write_list_host" if host else "write_list"
        compiled = self._page_copies.get((kind, len(pages))) or self._page_list_copy(kind, len(pages))
        self.k_cache, self.v_cache = compiled((self.k_cache, self.v_cache), pages, data)

    def _page_list_copy(self, kind: str, n: int):
        """The callable of read_page_list / write_page_list for `kind` and n pages: the jitted function of the
        device kinds, or the host kinds' compiled ahead of time (their placements are part of the program)."""
        if kind in ("read_list", "write_list"):
            return self._read_page_list if kind == "read_list" else self._write_page_list
        pools, pages = (self.k_cache, self.v_cache), np.zeros(n, np.int32)
        if self._stacked_pages():
            page_sharding = _stacked_sharding(self.k_cache.sharding)
            out_host, on_device = page_sharding.with_memory_kind("pinned_host"), page_sharding
        else:
            out_host = jax.tree.map(lambda a: a.sharding.with_memory_kind("pinned_host") if a.shape[1] == self.num_pages
                                    else None, pools)
            on_device = jax.tree.map(lambda a: a.sharding if a.shape[1] == self.num_pages else None, pools)
        read = jax.jit(self._read_page_list_fn, out_shardings=[out_host] * n)
        if kind == "read_list_host":
            self._page_copies[kind, n] = read.lower(pools, pages).compile()
        else:
            data = jax.eval_shape(read, pools, pages)
            data = jax.tree.map(lambda d, s: jax.ShapeDtypeStruct(d.shape, d.dtype, sharding=s), data, [out_host] * n)
            # The pages move to the pools' devices first, by an explicit device_put inside the program: XLA:GPU
            # refuses a program that computes on operands in host memory.
            write = jax.jit(lambda pools, pages, data: self._write_page_list_fn(
                pools, pages, [jax.device_put(d, on_device) for d in data]), donate_argnums=(0,))
            self._page_copies[kind, n] = write.lower(pools, pages, data).compile()
        return self._page_copies[kind, n]

    def warmup_page_copies(self, max_pages: int, kinds=("read", "write")) -> None:
        """Compile the page copies of `kinds` (read_pages / write_pages: "read", "write"; read_page_list /
        write_page_list: "read_list", "write_list", and through pinned host memory "read_list_host",
        "write_list_host") ahead of time for every power-of-two page count up to max_pages (as the steps are:
        the pools a step gives back carry another form of the same sharding, a jit cache miss)."""
        pools, n = (self.k_cache, self.v_cache), 1
        while True:
            pages = np.zeros(n, np.int32)
            for kind in ("read_list_host", "write_list_host"):
                if kind in kinds and (kind, n) not in self._page_copies:
                    self._page_list_copy(kind, n)
            for read_kind, write_kind, reader, writer in (("read", "write", self._read_pages, self._write_pages),
                                                          ("read_list", "write_list", self._read_page_list,
                                                           self._write_page_list)):
                if read_kind not in kinds and write_kind not in kinds:
                    continue
                read = self._page_copies.get((read_kind, n)) or reader.lower(pools, pages).compile()
                if read_kind in kinds:
                    self._page_copies[read_kind, n] = read
                if write_kind in kinds and (write_kind, n) not in self._page_copies:
                    self._page_copies[write_kind, n] = writer.lower(pools, pages, read(pools, pages)).compile()
            if n >= max_pages:
                return
            n *= 2

    def unconstrained_mask(self, inp: StepInputs):
        """The device-resident all-ones mask of inp's bucket: what a step without constrained rows takes."""
        return self._no_guide[inp.md.logits_indices.shape[0]]

    def launch(self, inp: StepInputs, guide_mask: np.ndarray | None = None, serial: bool = False) -> StepOutputs:
        """Dispatch one step (returns at once; outputs are device arrays). serial: the host waits for this step
        before it launches the next: it runs the serial variant where there is one (serial_steps)."""
        if guide_mask is None:
            guide_mask = self.unconstrained_mask(inp)
        elif self._mask_sharding is not None:
            guide_mask = jax.device_put(guide_mask, self._mask_sharding)
        ints, floats, layout = step_packing.pack(inp)
        args = (self.step_params, self.k_cache, self.v_cache, self.history, self.prev_sampled, ints, floats, guide_mask)
        step, executables = self._step, self._executables
        if serial and self._serial_step is not None:
            step, executables = self._serial_step, self._serial_executables
        compiled = executables.get(layout)  # warmed-up buckets; others compile through jit on first use
        self.k_cache, self.v_cache, self.history, self.prev_sampled, out = (
            compiled(*args) if compiled is not None else step(*args, layout))
        if self._prompt_logprobs is not None:
            out = self._with_prompt_logprobs(out, inp)
        return out

    def _with_prompt_logprobs(self, out: StepOutputs, inp: StepInputs) -> StepOutputs:
        """out without its final hidden states, and with the prompt logprobs of its tokens when inp asks for them:
        the prompt-logprobs program, launched behind the step (prompt_logprobs_program)."""
        if not bool(inp.want_prompt_logprobs):
            return out._replace(final_hidden=None)
        next_token = np.asarray(inp.next_token, np.int32)
        if self._mask_sharding is not None:  # replicated over the mesh, as the step's other host inputs
            next_token = jax.device_put(next_token, self._mask_sharding)
        p_lp, p_ids, p_vals = self._prompt_logprobs(self.step_params, out.final_hidden, next_token)
        return out._replace(prompt_logprob=p_lp, prompt_top_ids=p_ids, prompt_top_logprobs=p_vals, final_hidden=None)

    def warmup(self, progress=None, buckets=None, threads: int = 1) -> float:
        """Compile every bucket (or those given) now so serving never compiles. Returns seconds spent.

        Each bucket's step is traced and lowered here, one after the other (Python), and compiled ahead
        of time on `threads` threads: XLA compiles outside Python's lock, so the buckets compile side
        by side. `launch` then runs the compiled executables themselves (`_executables`, by layout),
        whatever the arrays' commitment: no jit cache key can miss. A bucket the executable store holds
        is loaded instead (no tracing; the loads side by side on the same threads), and each one compiled
        here is saved to it. progress(T) follows each compiled step (num_step_variants of them)."""
        t0 = time.perf_counter()
        order = self.buckets if buckets is None else sorted(set(buckets))
        store = self.executable_store
        pending = {}
        kinds = [(self._step, STEP_COMPILER_OPTIONS, self._executables)]
        if self._serial_step is not None:
            kinds.append((self._serial_step, SERIAL_STEP_COMPILER_OPTIONS, self._serial_executables))
        with concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="jlight-compile") as pool:
            wanted = []  # (T, layout, the jitted step, its executables, its arguments, its store key) to make
            # The largest buckets first: their compiles take longest, and each starts once the ones before it
            # are lowered (a 2-core host's first answer: the 64-token bucket's 8.7 s then the 1-token's 7.8 s
            # end 0.9 s sooner than the other way round).
            variants = sorted(self.step_variants(order), key=lambda v: -v[0])
            for (T, width), (step, options, executables) in itertools.product(variants, kinds):
                inp = self.padding_inputs(T, width)
                ints, floats, layout = step_packing.pack(inp)
                if layout in executables:
                    if progress is not None:
                        progress(T)
                    continue
                args = (self.step_params, self.k_cache, self.v_cache, self.history, self.prev_sampled, ints, floats,
                        self.unconstrained_mask(inp))
                key = store.key(args, (self._precision, options, layout)) if store is not None else None
                wanted.append((T, layout, step, executables, args, key))
            # Stored steps load side by side (deserializing one runs outside Python's lock).
            loads = [pool.submit(timed, store.load, key, args) if key is not None else None
                     for _, _, _, _, args, key in wanted]
            for (T, layout, step, executables, args, key), load in zip(wanted, loads):
                stored, seconds = load.result() if load is not None else (None, 0.0)
                if stored is not None:
                    executables[layout] = stored
                    self.warmup_timings.append(dict(tokens=T, loaded_s=seconds))
                    if progress is not None:
                        progress(T)
                    continue
                start = time.perf_counter()
                lowered = step.lower(*args, layout)
                lower_s = time.perf_counter() - start
                pending[pool.submit(timed, self._compile, lowered, key, lower_s)] = (T, layout, executables, lower_s)
            for done in concurrent.futures.as_completed(pending):
                T, layout, executables, lower_s = pending[done]
                executables[layout], compile_s = done.result()
                self.warmup_timings.append(dict(tokens=T, lowered_s=lower_s, compiled_s=compile_s,
                                                done_s=time.perf_counter() - t0))
                if progress is not None:
                    progress(T)
        self.write_history(self.history_dummy_slot, [])
        jax.block_until_ready(self.history)
        return time.perf_counter() - t0

    def step_variants(self, buckets) -> list[tuple[int, int]]:
        """(bucket, page-table width) of every compiled step that `buckets` make."""
        return [(T, w) for T in sorted(set(buckets)) for w in (self.max_pages_per_seq, self.short_tables.get(T)) if w]

    def padding_inputs(self, T: int, width: int | None = None) -> StepInputs:
        """An all-padding step of the T-token bucket with page tables `width` pages wide (default: max_model_len's):
        the shapes and dtypes `prepare` gives that bucket."""
        inp, _ = self.prepare(SchedulePlan([], []), {})
        return _pad_to_bucket(inp, T, min(T, self.max_num_seqs), self.num_samples(T), width or self.max_pages_per_seq, self)

    def _compile(self, lowered, key, lower_seconds: float):
        if self.executable_store is None:
            return lowered.compile()
        return self.executable_store.compile(key, lowered, lower_seconds)


def timed(fn, *args):
    """(fn(*args), seconds it took)."""
    start = time.perf_counter()
    return fn(*args), time.perf_counter() - start


def _abstract_kv_pool(shape, kv_cache_dtype: str, kv_dtype, sharding):
    """make_kv_pool's pool as ShapeDtypeStructs carrying the shardings the zeroed pool gets: `sharding` (and
    scales_sharding's for an int8 pool's scales), or, unsharded, the default device's (where jnp.zeros lands)."""
    structs = jax.eval_shape(functools.partial(make_kv_pool, tuple(shape), kv_cache_dtype, kv_dtype))
    if sharding is None:
        where = jnp.zeros((), jnp.int8).sharding
        shardings = jax.tree.map(lambda _: where, structs)
    elif isinstance(structs, QuantizedKV):
        shardings = QuantizedKV(sharding, scales_sharding(sharding, len(shape)))
    else:
        shardings = sharding
    return jax.tree.map(lambda s, where: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), structs, shardings)


class _SampledPositions:
    """The [S] arrays of a step's sampled positions, filled one position at a time by `prepare`."""

    def __init__(self, S: int, dummy_slot: int):
        self.logits_indices = np.zeros(S, np.int32)
        self.temperature = np.zeros(S, np.float32)
        self.top_k = np.zeros(S, np.int32)
        self.top_p = np.ones(S, np.float32)
        self.min_p = np.zeros(S, np.float32)
        self.rep = np.ones(S, np.float32)
        self.presence = np.zeros(S, np.float32)
        self.frequency = np.zeros(S, np.float32)
        self.seed = np.zeros(S, np.uint32)
        self.token_index = np.zeros(S, np.int32)
        self.banned = np.full((S, sampler.NUM_BANNED), -1, np.int32)
        self.bias_ids = np.full((S, sampler.NUM_BIAS), -1, np.int32)
        self.bias_vals = np.zeros((S, sampler.NUM_BIAS), np.float32)
        self.draft = np.full(S, -1, np.int32)
        self.history_slot = np.full(S, dummy_slot, np.int32)
        self.prompt_len = np.zeros(S, np.int32)
        self.history_len = np.zeros(S, np.int32)
        self.use_pen = self.use_filt = self.want_lp = False

    def fill(self, j: int, token: int, seq, vocab_size: int, slots: dict[int, int], draft: int, index_offset: int):
        """Position j samples after flat token `token` for seq's output token index_offset ahead of its next."""
        p = seq.params
        self.logits_indices[j] = token
        self.temperature[j] = p.temperature
        self.top_k[j] = min(p.top_k, vocab_size) if p.top_k > 0 else 0
        self.top_p[j] = p.top_p
        self.min_p[j] = p.min_p
        self.rep[j], self.presence[j], self.frequency[j] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        self.use_filt |= (p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0) and p.temperature > 0
        self.seed[j] = seq.seed & 0xFFFFFFFF
        index = seq.num_output_tokens + index_offset
        self.token_index[j] = index
        if index < p.min_tokens:
            ban = list(seq.eos_ids_for_min_tokens)[: sampler.NUM_BANNED]
            self.banned[j, : len(ban)] = ban
        if p.logit_bias:
            items = list(p.logit_bias.items())[: sampler.NUM_BIAS]
            self.bias_ids[j, : len(items)] = [int(k) for k, _ in items]
            self.bias_vals[j, : len(items)] = [float(v) for _, v in items]
        self.want_lp |= p.logprobs is not None
        self.draft[j] = draft
        if seq.seq_id in slots:  # penalties (a sequence with penalties does not speculate: one position)
            self.use_pen = True
            self.history_slot[j] = slots[seq.seq_id]
            self.prompt_len[j] = len(seq.prompt_token_ids)
            self.history_len[j] = seq.num_tokens

    def sampling_inputs(self, guided: bool) -> sampler.SamplingInputs:
        return sampler.SamplingInputs(
            self.temperature, self.top_k, self.top_p, self.min_p, self.rep, self.presence, self.frequency, self.seed,
            self.token_index, self.banned, self.bias_ids, self.bias_vals, np.bool_(self.use_pen), np.bool_(self.use_filt),
            np.bool_(self.want_lp), np.bool_(guided), self.draft)


def _pad_to_bucket(inp: StepInputs, T: int, B: int, S: int, width: int, runner: ModelRunner) -> StepInputs:
    """An all-padding batch of exactly T tokens, B rows, S sampled positions and page tables `width` pages
    wide (for warm-up). Its leaves have the shapes and dtypes of `prepare`'s for the bucket, so it packs to
    the same layout: the same compiled step."""
    def tok(a, fill=0):
        return np.full((T,) + a.shape[1:], fill, a.dtype)

    def row(a, fill=0):
        return np.full((B,) + a.shape[1:], fill, a.dtype)

    def pos(a, fill=0):
        return np.full((S,) + a.shape[1:], fill, a.dtype)

    md = inp.md
    md = BatchMetadata(tok(md.positions), tok(md.slot_mapping), tok(md.token_seq), np.zeros((B, width), np.int32),
                       row(md.context_lens), np.zeros(B + 1, np.int32), pos(md.logits_indices),
                       None if md.state_slots is None else row(md.state_slots),
                       None if md.group_page_tables is None else np.zeros((md.group_page_tables.shape[0], B, width), np.int32),
                       None if md.group_slot_mappings is None else np.zeros((md.group_slot_mappings.shape[0], T), np.int32))
    s = inp.sampling
    s = sampler.SamplingInputs(*(pos(a, 1 if i in (2, 4) else 0) if np.ndim(a) else a for i, a in enumerate(s)))
    s = s._replace(banned_ids=pos(s.banned_ids, -1), bias_ids=pos(s.bias_ids, -1), draft_tokens=pos(s.draft_tokens, -1))
    return StepInputs(tok(inp.tokens), tok(inp.from_prev, -1), md, s, pos(inp.history_slot, runner.history_dummy_slot),
                      pos(inp.prompt_len), pos(inp.history_len), row(inp.row_sample), tok(inp.next_token, -1),
                      inp.want_prompt_logprobs)
