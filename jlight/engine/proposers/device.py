"""Device proposers: a model of the proposer's own (a draft model, an EAGLE head, a DeepSeek MTP layer)
run on the device right after each target step, over that step's ragged batch.

The proposer's K/V pool has the target pool's pages (the same page ids, sized from the same memory
budget: the engine counts its bytes in each page), so the target's page tables serve it unchanged.
Each step it runs two programs:
- the first pass, over the step's T tokens with the target step's own batch metadata. It writes the
  proposer's K/V of every token the target computed in that step, so its pool holds, page for page,
  the same tokens as the target's: prefix-cache hits, pages shared by n > 1 samples and preemption
  need nothing more. A head (EAGLE, MTP) reads each token's successor and the target's hidden state
  there (`shifted`) and gives each row its first draft.
- the chain, when some row may speculate next: one token a row per draft, each row at the position
  after its last kept token, each draft fed back in. A verified row's kept count and bonus token come
  from the sampler's flags on the device, so the host waits for nothing before launching it.
The first pass writes past the kept tokens (a verified row's rejected drafts) and the chain writes
past the sequence's computed tokens: those K/V lie beyond num_computed_tokens, no attention reads them
before the next step writes over them, and only full pages of kept tokens reach the prefix cache,
as for the target's own rejected drafts (speculative.py). The chain's positions past a row's pages
land on the scratch page (the scheduler reserves `lookahead` pages when it can).

The drafts come back to the host with the step's tokens (`collect`) and wait on their sequences for
its next verify row. Every draft is the proposer's argmax: a point-mass proposal, which the sampler's
acceptance rule verifies exactly (a sampled draft would need its probabilities and the residual
max(0, p - q)).
"""
from __future__ import annotations

import abc

import functools
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jlight.core.batch_metadata import BatchMetadata
from jlight.core.parallel_ops import ParallelOps
from jlight.engine import step_packing
from jlight.engine.model_runner import STEP_COMPILER_OPTIONS, StepInputs, StepOutputs, Taps, matmul_precision
from jlight.engine.proposers.base import Proposer
from jlight.engine.scheduler import SchedulePlan, speculates
from jlight.engine.sequence import Sequence
from jlight.engine.speculative import SpeculativeConfig


class DraftInputs(NamedTuple):
    """The host side of a proposer's first pass: the target step's batch and where its rows sampled."""
    md: BatchMetadata  # the target step's own
    first_sample: np.ndarray  # [B] int32 each sampling row's first sampled position
    num_drafts: np.ndarray  # [B] int32 drafts the row verified
    wants: np.ndarray  # [B] bool the row samples and its sequence may speculate next: draft for it
    flat_sample: np.ndarray  # [T] int32 the sampled position of each token, -1 for none
    next_token: np.ndarray  # [T] int32 the token after each token where the host knows it (heads), else 0


class ChainStart(NamedTuple):
    """Where each row's chain starts (device arrays the first pass returns)."""
    token: jax.Array  # [B] int32 the first token the chain reads
    hidden: jax.Array | None  # [B, embed] the hidden state it reads with it (heads), or None
    position: jax.Array  # [B] int32 its position
    wants: jax.Array  # [B] bool
    page_table: jax.Array  # [B, max_pages]


class KeptRows(NamedTuple):
    token: jax.Array  # [B] int32 the token sampled after the row's kept tokens (its next input)
    flat: jax.Array  # [B] int32 the flat index of the last token the row kept
    position: jax.Array  # [B] int32 the position of `token`


def kept_rows(x: DraftInputs, sampled, accepted, max_drafts: int) -> KeptRows:
    """Each row's kept tokens as the engine will read them (speculative.kept_tokens), on the device:
    its drafts up to the first rejection, then the token sampled there."""
    i = jnp.arange(max_drafts, dtype=jnp.int32)
    idx = jnp.minimum(x.first_sample[:, None] + i[None, :], sampled.shape[0] - 1)  # [B, k]
    ok = accepted[idx] & (i[None, :] < x.num_drafts[:, None])
    num_kept = jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1)
    j = x.first_sample + num_kept
    flat = x.md.logits_indices[j]
    return KeptRows(sampled[j], flat, x.md.positions[flat] + 1)


def chain_metadata(page_table, position, wants, page_size: int, max_model_len: int) -> BatchMetadata:
    """One token a row at `position` over the row's pages. Rows that do not draft (and positions past
    the context or past the table, which a step of short rows narrows) write to the scratch page and are
    read by no one."""
    num_rows, max_pages = page_table.shape
    live = wants & (position < max_model_len) & (position // page_size < max_pages)
    pos = jnp.where(live, position, 0).astype(jnp.int32)
    page = jnp.take_along_axis(page_table, jnp.minimum(pos // page_size, max_pages - 1)[:, None], axis=1)[:, 0]
    slot = jnp.where(live, page * page_size + pos % page_size, 0).astype(jnp.int32)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    return BatchMetadata(pos, slot, rows, page_table, pos + 1, jnp.arange(num_rows + 1, dtype=jnp.int32), rows)


class DeviceProposer(Proposer):
    """The machinery every device proposer shares. A subclass sets `num_first_drafts` (drafts its first
    pass makes: 0 or 1) and `shifted`, and gives `pool_shapes`, `first_pass` and `chain_step`."""
    num_first_drafts = 0
    shifted = False  # the first pass reads each token's successor (a head), not the token (a draft model)
    taps = Taps()  # the step's input tokens; a head asks for hidden states too

    def __init__(self, config: SpeculativeConfig, params, dtype):
        self.config = config
        self.params = params
        self.dtype = dtype  # the proposer's compute dtype; its K/V pools take the target's (runner.kv_dtype)
        self.lookahead = config.num_speculative_tokens
        self.ops = ParallelOps()
        self.runner = self.kernels = None
        self._first_compiled: dict = {}  # step_packing.Layout -> the first pass compiled for that bucket
        self._chain_compiled: dict = {}  # (rows, page-table width) -> the chain compiled for them

    # ---- what a subclass gives ------------------------------------------------------------
    @abc.abstractmethod
    def pool_shapes(self, num_pages: int, page_size: int) -> tuple[tuple, tuple]:
        """The shapes of the proposer's own K and V pools."""

    @abc.abstractmethod
    def first_pass(self, params, k_cache, v_cache, tokens, hidden, md: BatchMetadata, kept: KeptRows):
        """-> (k_cache, v_cache, first drafts [B] or None, chain hidden [B, embed] or None)."""

    @abc.abstractmethod
    def chain_step(self, params, k_cache, v_cache, tokens, hidden, md: BatchMetadata):
        """One draft for every row: -> (k_cache, v_cache, drafts [B] int32, hidden [B, embed] or None)."""

    # ---- the Proposer interface -----------------------------------------------------------
    def drafts(self, seq: Sequence, max_drafts: int) -> list[int]:
        if seq.drafts_follow != len(seq.prompt_token_ids) + len(seq.output_token_ids):
            return []  # none made after its latest token
        return seq.draft_tokens[:max_drafts]

    def kv_bytes_per_page(self, page_size: int, kv_dtype) -> int:
        return sum(int(np.prod(s)) for s in self.pool_shapes(1, page_size)) * jnp.dtype(kv_dtype).itemsize

    def attach(self, runner) -> None:
        self.runner, self.kernels = runner, runner.kernels
        k_shape, v_shape = self.pool_shapes(runner.num_pages, runner.page_size)
        self.k_cache = jnp.zeros(k_shape, runner.kv_dtype)  # [layers, pages, page_size, kv_heads, head_dim] as the family's
        self.v_cache = jnp.zeros(v_shape, runner.kv_dtype)
        self._precision = matmul_precision(self.dtype)
        self._first = jax.jit(self._first_fn, donate_argnums=(1, 2), static_argnums=(9,), compiler_options=STEP_COMPILER_OPTIONS)
        self._chain = jax.jit(self._chain_fn, donate_argnums=(1, 2), compiler_options=STEP_COMPILER_OPTIONS)

    def launch(self, plan: SchedulePlan, inp: StepInputs, out: StepOutputs):
        x = self.inputs(plan, inp)
        ints, floats, layout = step_packing.pack(x)
        args = (self.params, self.k_cache, self.v_cache, ints, floats, out.tokens, out.accepted, out.input_tokens, out.hidden)
        compiled = self._first_compiled.get(layout)
        self.k_cache, self.v_cache, start = compiled(*args) if compiled is not None else self._first(*args, layout)
        if not x.wants.any():
            return None
        compiled = self._chain_compiled.get((len(x.wants), x.md.page_table.shape[1]))
        self.k_cache, self.v_cache, drafts = (compiled or self._chain)(self.params, self.k_cache, self.v_cache, start)
        return drafts, x.wants

    def collect(self, plan: SchedulePlan, launched) -> None:
        drafts = np.asarray(launched[0]) if launched is not None else None
        for row, r in enumerate(plan.rows):
            if not r.samples:
                continue
            r.seq.set_drafts(drafts[row].tolist() if drafts is not None and launched[1][row] else None)

    def warmup(self, buckets) -> float:
        """Compile the first pass of each step bucket and the chain of its rows, ahead of time."""
        t0 = time.perf_counter()
        for T, width in self.runner.step_variants(buckets):
            inp = self.runner.padding_inputs(T, width)
            x = self.inputs(SchedulePlan([], []), inp)
            ints, floats, layout = step_packing.pack(x)
            S = inp.md.logits_indices.shape[0]
            taps = self.runner.taps
            hidden = None
            if taps is not None and (taps.hidden or taps.layers):
                width = self.runner.config.hidden_size * (len(taps.layers) or 1)
                hidden = jax.ShapeDtypeStruct((T, width), self.runner.params["final_norm"].dtype)
            args = (self.params, self.k_cache, self.v_cache, ints, floats, jax.ShapeDtypeStruct((S,), jnp.int32),
                    jax.ShapeDtypeStruct((S,), jnp.bool_), jax.ShapeDtypeStruct((T,), jnp.int32), hidden)
            if layout not in self._first_compiled:
                self._first_compiled[layout] = self._first.lower(*args, layout).compile()
            rows = len(x.wants)
            if (rows, width) not in self._chain_compiled:
                _, _, start = jax.eval_shape(functools.partial(self._first_fn, layout=layout), *args)
                self._chain_compiled[rows, width] = self._chain.lower(self.params, self.k_cache, self.v_cache, start).compile()
        return time.perf_counter() - t0

    # ---- host inputs ----------------------------------------------------------------------
    def inputs(self, plan: SchedulePlan, inp: StepInputs) -> DraftInputs:
        T, B = inp.tokens.shape[0], inp.md.page_table.shape[0]
        first_sample = np.zeros(B, np.int32)
        num_drafts = np.zeros(B, np.int32)
        wants = np.zeros(B, np.bool_)
        flat_sample = np.full(T, -1, np.int32)
        next_token = np.zeros(T, np.int32)
        t = j = 0
        for row, r in enumerate(plan.rows):
            seq, n = r.seq, r.num_tokens
            if self.shifted:  # the known successors of the row's tokens (a prompt chunk's last one: the next chunk's first)
                known = len(seq.prompt_token_ids) + len(seq.output_token_ids)
                end = min(r.start + n + 1, known)
                if end > r.start + 1:
                    next_token[t:t + end - r.start - 1] = seq.token_slice(r.start + 1, end)
            if r.samples:
                k = len(r.drafts)
                first_sample[row], num_drafts[row] = j, k
                wants[row] = plan.speculating and speculates(seq)
                flat_sample[t + n - 1 - k:t + n] = np.arange(j, j + k + 1)
                j += k + 1
            t += n
        return DraftInputs(inp.md, first_sample, num_drafts, wants, flat_sample, next_token)

    # ---- the device programs ------------------------------------------------------------------
    def _first_fn(self, params, k_cache, v_cache, ints, floats, sampled, accepted, in_tokens, hidden, layout):
        x = step_packing.unpack(layout, ints, floats)
        with jax.default_matmul_precision(self._precision):
            kept = kept_rows(x, sampled, accepted, self.config.num_speculative_tokens)
            tokens = in_tokens
            if self.shifted:  # each token's successor: the sampled token where the step sampled, else the known one
                tokens = jnp.where(x.flat_sample >= 0, sampled[jnp.maximum(x.flat_sample, 0)], x.next_token)
            k_cache, v_cache, first, chain_hidden = self.first_pass(params, k_cache, v_cache, tokens, hidden, x.md, kept)
        token = kept.token if first is None else first
        return k_cache, v_cache, ChainStart(token, chain_hidden, kept.position, x.wants, x.md.page_table)

    def _chain_fn(self, params, k_cache, v_cache, start: ChainStart):
        ps, max_len = self.runner.page_size, self.runner.max_model_len

        def body(carry, i):
            k_cache, v_cache, token, hidden = carry
            md = chain_metadata(start.page_table, start.position + i, start.wants, ps, max_len)
            k_cache, v_cache, token, hidden = self.chain_step(params, k_cache, v_cache, token, hidden, md)
            return (k_cache, v_cache, token, hidden), token

        num_steps = self.config.num_speculative_tokens - self.num_first_drafts
        with jax.default_matmul_precision(self._precision):
            (k_cache, v_cache, _, _), drafts = jax.lax.scan(
                body, (k_cache, v_cache, start.token, start.hidden), jnp.arange(num_steps, dtype=jnp.int32))
        drafts = drafts.T  # [B, steps]
        if self.num_first_drafts:
            drafts = jnp.concatenate([start.token[:, None], drafts], axis=1)
        return k_cache, v_cache, drafts
