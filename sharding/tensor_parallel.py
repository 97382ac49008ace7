"""The tensor-parallel ParallelOps the model runs with inside shard_map.

Weights arrive already split by the rules (column-parallel: output dim; row-parallel:
input dim; embedding and LM head: vocab), so each op is the local matmul plus the one
collective that makes the result whole:

  row_linear  psum over tp (or int8 all-reduce, or a reduce-scatter collective matmul)
  embed       masked lookup in the local vocab slice + psum
  lm_head     local logits + all-gather on vocab, padding columns dropped
  expert_ffn  this device's experts (ep) and mlp slice (tp) on the tokens routed to them + psum

With `sequence_parallel` the residual stream between layers is split on tokens: the
row-parallel output is reduce-scattered and the next column-parallel input all-gathered,
both as ring collective matmuls, instead of one all-reduce. The model returns its hidden
states through `gather_sequence`, which makes them whole again.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jlight.core.parallel_ops import ParallelOps, real_rows
from jlight.sharding.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jlight.sharding.int8_all_reduce import int8_all_reduce


@dataclasses.dataclass(frozen=True)
class TensorParallelOps(ParallelOps):
    axis_name: str  # the mesh axis weights are split on ("tp")
    tp: int  # its size
    vocab_size: int  # the true vocab; the LM head's columns beyond it are padding
    sequence_parallel: bool = False  # residual stream split on tokens (collective matmuls)
    int8_all_reduce: bool = False  # row_linear's all-reduce moves int8 (when not sequence-parallel)
    ep: int = 1  # size of the expert-parallel mesh axis
    ep_axis_name: str = "ep"

    def _all_reduce(self, y):
        if self.int8_all_reduce and y.shape[-1] % self.tp == 0:
            return int8_all_reduce(y, axis_name=self.axis_name, n=self.tp)
        return jax.lax.psum(y, self.axis_name)

    def column_linear(self, x, w, matmul):
        # x: [T, in] replicated, or [T/tp, in] under sequence parallelism; w: [in, out/tp].
        if self.sequence_parallel:
            return all_gather_matmul(x, w, matmul, axis_name=self.axis_name, n=self.tp)
        return matmul(x, w)  # [T, out/tp]

    def row_linear(self, x, w, matmul):
        # x: [T, in/tp]; w: [in/tp, out]. Out: [T, out] replicated, or [T/tp, out].
        if self.sequence_parallel:
            return matmul_reduce_scatter(x, w, matmul, axis_name=self.axis_name, n=self.tp)
        return self._all_reduce(matmul(x, w))

    def embed(self, table, tokens):
        # table: [vocab_padded/tp, embed], this device's vocab rows; tokens: [T] global ids.
        rows = table.shape[0]
        local = tokens - jax.lax.axis_index(self.axis_name) * rows
        mine = (local >= 0) & (local < rows)
        h = jnp.take(table, jnp.clip(local, 0, rows - 1), axis=0)  # [T, embed]
        h = jnp.where(mine[:, None], h, jnp.zeros((), h.dtype))
        if self.sequence_parallel:
            return jax.lax.psum_scatter(h, self.axis_name, scatter_dimension=0, tiled=True)  # [T/tp, embed]
        return jax.lax.psum(h, self.axis_name)

    def gather_sequence(self, h):
        if self.sequence_parallel:
            return jax.lax.all_gather(h, self.axis_name, axis=0, tiled=True)  # [T, embed]
        return h

    def lm_head(self, x, w, matmul):
        # x: [N, embed] replicated; w: [embed, vocab_padded/tp].
        local = matmul(x, w, out_dtype=jnp.float32)  # [N, vocab_padded/tp]
        logits = jax.lax.all_gather(local, self.axis_name, axis=1, tiled=True)  # [N, vocab_padded]
        return logits[:, : self.vocab_size]

    def expert_ffn(self, local_ffn, x, topk_ids, topk_weights, w_gate, w_up, w_down, num_tokens=None):
        """Expert parallelism. w_*: [num_experts/ep, ...] this device's experts, their mlp dim
        split on tp; x: [T, embed] ([T/tp, embed] under sequence parallelism); topk: [T, k].

        Each device runs its experts on the (token, expert) pairs routed to them; pairs of
        other devices' experts get weight 0 and the id `local_experts` ("no local expert"), so
        shapes stay static. The grouped paths sort those rows past every group, where the Pallas
        grouped matmul does no work for them, so ep splits expert FLOPs as well as memory there
        (ragged_dot pads them like every row). The partial sums are then added over ep and tp.
        Every device still gathers and sorts all T*k rows: an all-to-all dispatch that sends
        only routed rows is not implemented. `local_ffn` computes one device's experts (models/moe.expert_ffn
        with the model's activation and kernels). num_tokens: as ParallelOps.expert_ffn's.
        """
        if self.sequence_parallel:  # experts' mlp slices need every token
            x = jax.lax.all_gather(x, self.axis_name, axis=0, tiled=True)  # [T, embed]
            topk_ids = jax.lax.all_gather(topk_ids, self.axis_name, axis=0, tiled=True)  # [T, k]
            topk_weights = jax.lax.all_gather(topk_weights, self.axis_name, axis=0, tiled=True)
        local_experts = jax.tree_util.tree_leaves(w_gate)[0].shape[0]  # every form of expert weight leads with them
        local_ids = topk_ids - jax.lax.axis_index(self.ep_axis_name) * local_experts
        mine = (local_ids >= 0) & (local_ids < local_experts)
        real = real_rows(topk_ids.shape[0], num_tokens)  # a bucket's padding rows take no expert (ParallelOps)
        mine = mine if real is None else mine & real
        y = local_ffn(
            x, jnp.where(mine, local_ids, local_experts), jnp.where(mine, topk_weights, 0.0), w_gate, w_up, w_down
        )  # [T, embed], a partial sum over this device's experts and mlp slice
        if self.ep > 1:
            y = jax.lax.psum(y, self.ep_axis_name)
        if self.sequence_parallel:
            return jax.lax.psum_scatter(y, self.axis_name, scatter_dimension=0, tiled=True)  # [T/tp, embed]
        return jax.lax.psum(y, self.axis_name)
