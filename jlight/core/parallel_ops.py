"""Parallel building blocks the model calls. `ParallelOps()` is the plain single-device version.

The caller hands a model its ParallelOps as an argument, as it hands it its kernels: the engine's
step passes `ParallelOps()` without a mesh, and the sharding plan (sharding/plan.py) passes the
tensor-parallel version (sharding/tensor_parallel.py, explicit collectives inside `shard_map`).
"""
from __future__ import annotations

import jax
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

    def expert_ffn(self, local_ffn, x, topk_ids, topk_weights, w_gate, w_up, w_down, num_tokens=None):
        """Routed experts. x: [T, embed]; topk_ids/topk_weights: [T, k]; w_gate, w_up:
        [num_experts, embed, mlp]; w_down: [num_experts, mlp, embed] -> [T, embed].

        `local_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down)` computes the experts of one
        device (models/moe.expert_ffn with the model's activation and kernels, passed in by the
        model: the computation lives with the models). Single device: local_ffn itself.
        num_tokens: the step's real tokens (a traced scalar: BatchMetadata.query_start[-1]); the rows
        past it, a step bucket's padding, take no expert (the id num_experts, weight 0), so a padded
        decode step reads only its real tokens' experts. None: every row is real.
        """
        real = real_rows(topk_ids.shape[0], num_tokens)
        if real is not None:
            num_experts = jax.tree_util.tree_leaves(w_gate)[0].shape[0]
            topk_ids, topk_weights = jnp.where(real, topk_ids, num_experts), jnp.where(real, topk_weights, 0)
        return local_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down)


def real_rows(rows: int, num_tokens):
    """[rows, 1] bool: which of a step's rows are real tokens (below num_tokens); None when num_tokens is None."""
    return None if num_tokens is None else (jnp.arange(rows) < num_tokens)[:, None]
