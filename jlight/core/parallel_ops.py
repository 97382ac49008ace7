"""Parallel building blocks the model calls. With no mesh active they are plain ops.

The sharding code swaps in tensor-parallel versions (with explicit collectives inside
`shard_map`) by setting the active `ParallelOps` while the step function is traced.
"""
from __future__ import annotations

import contextlib
import contextvars

import jax.numpy as jnp


class ParallelOps:
    """Single-device behaviour; subclasses add the collectives of a mesh."""

    def column_linear(self, x, w, matmul):
        """x replicated, w split on its output dim: y split on its last dim."""
        return matmul(x, w)

    def row_linear(self, x, w, matmul):
        """x split on its last dim, w split on its input dim: y = sum over shards."""
        return matmul(x, w)

    def embed(self, table, tokens):
        """table: [vocab, embed]; tokens: [T] -> [T, embed]."""
        return jnp.take(table, tokens, axis=0)

    def gather_sequence(self, h):
        """Activations [T, ...] made whole on tokens if the tensor-parallel ops split the residual
        stream on tokens (sequence parallelism): the hidden states after the last layer, or the
        output of a replicated weight applied to the split stream (MLA's KV latent). Identity here."""
        return h

    def lm_head(self, x, w, matmul):
        """x: [N, embed]; w: [embed, vocab] -> full [N, vocab] float32 logits."""
        return matmul(x, w, out_dtype=jnp.float32)

    def expert_ffn(self, local_ffn, x, topk_ids, topk_weights, w_gate, w_up, w_down, act, matmul, impl="auto"):
        """Routed experts. x: [T, embed]; topk_ids/topk_weights: [T, k]; w_gate, w_up:
        [num_experts, embed, mlp]; w_down: [num_experts, mlp, embed] -> [T, embed].

        `local_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, act, impl)` computes the experts
        of one device (models/moe.expert_ffn, passed in by the model: the computation lives with the
        models). Single device: local_ffn with `impl` (Kernels.moe_impl: "auto", "pallas",
        "ragged_dot", "gathered", "dense"). `matmul` (the dense kernel) is unused here; it is in
        the signature for expert-parallel versions.
        """
        return local_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, act, impl)


_active: contextvars.ContextVar[ParallelOps] = contextvars.ContextVar("jlight_parallel_ops", default=ParallelOps())


def current() -> ParallelOps:
    return _active.get()


@contextlib.contextmanager
def use(ops: ParallelOps):
    token = _active.set(ops)
    try:
        yield ops
    finally:
        _active.reset(token)
