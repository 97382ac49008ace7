"""Mixture-of-experts building blocks shared by the MoE families (mixtral.py, deepseek.py, gpt_oss.py, ...).

Two jobs, both pure functions:
  * routing: router logits -> (topk_ids [T, k], topk_weights [T, k]) under each model's rule
    (Mixtral/Qwen softmax-top-k, DeepSeek-V2 group-limited greedy, DeepSeek-V3 sigmoid + bias);
  * the routed expert FFN, `expert_ffn(..., impl, grouped)`, one of:
      "pallas"     sort the T*k (token, expert) pairs by expert and run the three expert matmuls
                   as grouped matmuls with the Pallas kernel (`grouped`: Kernels.grouped_matmul, from
                   pallas_kernels/dispatch.py): each row meets only its own expert's weights, experts
                   with no rows cost nothing;
      "ragged_dot" the same with `jax.lax.ragged_dot` (XLA pads every group: dense-sized FLOPs);
      "gathered"   gather the chosen experts' weights per pair (few pairs: decode);
      "dense"      every expert on every token (the baseline, and a cross-check);
      "auto"       "pallas" where the kernels carry the Pallas grouped matmul (dispatch gives it on GPU)
                   and it takes the shapes; elsewhere "gathered" when 3*T*k <= experts, else "ragged_dot".
    No token is ever dropped by any of them. Each of w_gate, w_up, w_down may be a BiasedExperts (gpt-oss's
    gate and up): the paths add its per-expert bias to the rows of that expert's matmul.

Model code reaches the expert FFN through `ops.expert_ffn(local_ffn, ..., num_tokens=md.query_start[-1])` (the
ParallelOps it is given, jlight/core/parallel_ops.py, which routes a step bucket's padding rows to no expert),
local_ffn being `expert_ffn` with the model's activation and the impl and grouped matmul from `Kernels`
(pallas_kernels/dispatch.py); the single-device ops call it, the expert-parallel ones
(sharding/tensor_parallel.py) call it on each device's experts.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from jlight.core.quantization import Mxfp4Weight, QuantizedWeight, dequantize, dequantize_mxfp4
from jlight.core.moe_impls import MOE_IMPLS


# ---------------------------------------------------------------------------------------------
# Routing. logits: [T, num_experts] float32. Returns (ids int32 [T, k], weights float32 [T, k]).
# ---------------------------------------------------------------------------------------------

def softmax_topk(logits, top_k: int, normalize: bool):
    """Mixtral (normalize=True), Qwen2/3-MoE (normalize=norm_topk_prob): softmax, then top-k."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


def _keep_best_groups(scores, group_scores, topk_group: int, fill):
    """Mask the experts outside the `topk_group` best groups with `fill`.

    scores: [T, num_experts]; group_scores: [T, num_groups] -> [T, num_experts].
    """
    num_tokens, num_experts = scores.shape
    num_groups = group_scores.shape[-1]
    _, best_groups = jax.lax.top_k(group_scores, topk_group)  # [T, topk_group]
    group_mask = jnp.zeros((num_tokens, num_groups), bool).at[jnp.arange(num_tokens)[:, None], best_groups].set(True)
    expert_mask = jnp.repeat(group_mask, num_experts // num_groups, axis=-1)  # [T, num_experts]
    return jnp.where(expert_mask, scores, fill)


def deepseek_v2_topk(logits, top_k: int, *, method: str, num_groups: int | None, topk_group: int | None,
                     normalize: bool, scaling: float):
    """DeepSeek-V2: softmax scores; "greedy" top-k, or "group_limited_greedy": top-k only within the
    `topk_group` groups whose best expert scores highest."""
    scores = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if method == "group_limited_greedy":
        num_tokens, num_experts = scores.shape
        group_best = scores.reshape(num_tokens, num_groups, num_experts // num_groups).max(-1)  # [T, groups]
        scores = _keep_best_groups(scores, group_best, topk_group, 0.0)
    elif method != "greedy":
        raise ValueError(f"topk_method={method!r} is not supported for DeepSeek-V2; use greedy or group_limited_greedy")
    weights, ids = jax.lax.top_k(scores, top_k)
    if normalize and top_k > 1:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * scaling


def deepseek_v3_topk(logits, bias, top_k: int, *, num_groups: int, topk_group: int, normalize: bool, scaling: float):
    """DeepSeek-V3 "noaux_tc": sigmoid scores; the load-balancing `bias` (e_score_correction_bias)
    only steers which experts are chosen, the weights are the unbiased scores. Groups are ranked
    by the sum of their two best biased scores."""
    scores = jax.nn.sigmoid(logits.astype(jnp.float32))  # [T, num_experts]
    choice = scores + bias.astype(jnp.float32)[None, :]
    num_tokens, num_experts = scores.shape
    grouped = choice.reshape(num_tokens, num_groups, num_experts // num_groups)
    group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [T, groups]
    choice = _keep_best_groups(choice, group_scores, topk_group, -jnp.inf)
    _, ids = jax.lax.top_k(choice, top_k)
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return ids.astype(jnp.int32), weights * scaling


# ---------------------------------------------------------------------------------------------
# Expert FFN. x: [T, E]; topk ids/weights: [T, k]; w_gate, w_up: [X, E, F]; w_down: [X, F, E]
# (arrays, int8 QuantizedWeights with scales [X, out], or Mxfp4Weights, expanded to the rows' dtype where
# they are read: the gathered path expands only the chosen experts). Returns [T, E] in x's dtype.
# ---------------------------------------------------------------------------------------------

EXPERT_IMPLS = MOE_IMPLS  # the engine's moe_impl values (EngineConfig, --moe-impl)


class BiasedExperts(NamedTuple):
    """Expert weights with a bias each expert adds to its rows' output (gpt-oss's gate and up projections):
    every expert_ffn path takes them where it takes weights, and adds bias[expert] after the matmul, so the
    weights keep the shapes the grouped matmul's tiles take. A sharded mlp splits gate's and up's biases with
    their columns; w_down's output is a partial sum under tensor parallelism, so a down bias belongs after
    the sum over devices (gpt-oss adds it there)."""
    weight: object  # [X, in, out]: a float array, QuantizedWeight or Mxfp4Weight
    bias: jax.Array  # [X, out] float


class GatedUnit(NamedTuple):
    """An expert activation that reads both projections: fn(gate, up) -> hidden (gpt-oss's clamped
    swiglu), where a plain activation `act` computes act(gate) * up."""
    fn: Callable


def gated(act, gate, up):
    """The experts' hidden activations from their gate and up projections."""
    return act.fn(gate, up) if isinstance(act, GatedUnit) else act(gate) * up


def ragged_dot(rows, values, group_sizes, *, preferred_element_type=None):
    """XLA's grouped matmul (jax.lax.ragged_dot), int8 weights converted to the rows' dtype first, MXFP4 ones
    (every expert's) expanded to it."""
    values = dequantize_mxfp4(values, rows.dtype) if isinstance(values, Mxfp4Weight) else values.astype(rows.dtype)
    return jax.lax.ragged_dot(rows, values, group_sizes, preferred_element_type=preferred_element_type)


def _grouped_matmul(rows, w, group_sizes, row_expert, matmul):
    """rows [R, in] sorted by expert; w [X, in, out] -> [R, out] float32 (row r uses w[row_expert[r]]).

    matmul: a callable with ragged_dot's contract (rows, values, group_sizes, preferred_element_type=...):
    `ragged_dot`, the Pallas kernel (Kernels.grouped_matmul.matmul), or one a benchmark compares. Float
    weights reach it in the rows' dtype, int8 values and MXFP4 weights as they are (the Pallas kernel
    expands both in registers; `ragged_dot` expands MXFP4 before XLA's dot); the int8 scales are applied here.
    """
    if isinstance(w, BiasedExperts):  # rows of the "no local expert" id take any expert's bias: their weight is 0
        bias = w.bias.astype(jnp.float32)[jnp.minimum(row_expert, w.bias.shape[0] - 1)]
        return _grouped_matmul(rows, w.weight, group_sizes, row_expert, matmul) + bias
    if isinstance(w, Mxfp4Weight):
        return matmul(rows, w, group_sizes, preferred_element_type=jnp.float32).astype(jnp.float32)
    quantized = isinstance(w, QuantizedWeight)
    values = _values(w) if quantized else w.astype(rows.dtype)
    y = matmul(rows, values, group_sizes, preferred_element_type=jnp.float32).astype(jnp.float32)
    if not quantized:
        return y
    num_experts = values.shape[0]  # rows of the "no local expert" id (see expert_ffn) are zeros: any scale will do
    return y * w.scales.astype(jnp.float32)[jnp.minimum(row_expert, num_experts - 1)]


# Largest gathered weight tensor ([rows, in, out]) one einsum may index: on the H200 the gathered
# path's logits went wrong (max |dlogit| 3.17 against dense) at 64 tokens, where that tensor holds
# 7.5e9 elements, past int32 indexing; at 1 token they matched. So larger gathers run in chunks.
MAX_GATHER_ELEMENTS = 2 ** 31 - 1


def _gathered_matmul(rows, w, ids, max_elements: int):
    """rows [R, in]; row r times w[ids[r]] ([X, in, out]) -> [R, out] float32, reading only those experts,
    in chunks of rows whose gathered weights hold at most max_elements."""
    if isinstance(w, BiasedExperts):
        return _gathered_matmul(rows, w.weight, ids, max_elements) + w.bias.astype(jnp.float32)[ids]
    shape = _shape(w)
    per_row = shape[1] * shape[2]
    chunk = max(1, max_elements // per_row)
    if rows.shape[0] > chunk:
        return jnp.concatenate([_gathered_matmul(rows[i:i + chunk], w, ids[i:i + chunk], max_elements)
                                for i in range(0, rows.shape[0], chunk)])
    gathered = (dequantize_mxfp4(Mxfp4Weight(*(field[ids] for field in w)), rows.dtype) if isinstance(w, Mxfp4Weight)
                else _values(w)[ids].astype(rows.dtype))
    y = jnp.einsum("ri,rio->ro", rows, gathered, preferred_element_type=jnp.float32)
    return y * w.scales[ids].astype(jnp.float32) if isinstance(w, QuantizedWeight) else y


def gathered_expert_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, act,
                        max_gather_elements: int = MAX_GATHER_ELEMENTS):
    """Few (token, expert) pairs (decode): gather just the chosen experts' weights, so a step reads
    T*k experts instead of all of them (XLA's ragged_dot pads every group to a dense contraction).
    max_gather_elements: the most weight elements one gather holds (MAX_GATHER_ELEMENTS)."""
    num_tokens, k = topk_ids.shape
    # The "no local expert" id (see expert_ffn) has weight 0: any expert's weights will do for it.
    flat_ids = jnp.minimum(topk_ids.reshape(-1), _num_experts(w_gate) - 1)  # [T*k]
    rows = jnp.repeat(x, k, axis=0)  # [T*k, E], row t*k + j is token t
    mm = lambda r, w: _gathered_matmul(r, w, flat_ids, max_gather_elements)
    hidden = gated(act, mm(rows, w_gate), mm(rows, w_up)).astype(x.dtype)
    out_rows = mm(hidden, w_down) * topk_weights.reshape(-1, 1).astype(jnp.float32)
    return out_rows.reshape(num_tokens, k, -1).sum(axis=1).astype(x.dtype)


def grouped_expert_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, act, grouped_matmul=ragged_dot):
    """Each token's k experts, computed as grouped matmuls (`grouped_matmul`: a callable with ragged_dot's
    contract, see _grouped_matmul) over the T*k (token, expert) rows sorted by expert."""
    num_tokens, k = topk_ids.shape
    num_experts = _num_experts(w_gate)
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    order = jnp.argsort(flat_ids, stable=True)  # [T*k] rows grouped by expert
    row_expert = flat_ids[order]
    row_token = order // k
    # Ids == num_experts ("no local expert") are not counted, so their rows sort last, past every
    # group: ragged_dot and the Pallas kernel return zeros there, the kernel without any work.
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)  # [X]
    rows = x[row_token]  # [T*k, E]
    mm = lambda r, w: _grouped_matmul(r, w, group_sizes, row_expert, grouped_matmul)
    gate = mm(rows, w_gate)  # [T*k, F] float32
    up = mm(rows, w_up)
    hidden = gated(act, gate, up).astype(x.dtype)
    out_rows = mm(hidden, w_down)  # [T*k, E] float32
    out_rows = out_rows * topk_weights.reshape(-1)[order][:, None].astype(jnp.float32)
    out = jnp.zeros((num_tokens, out_rows.shape[-1]), jnp.float32).at[row_token].add(out_rows)  # [T, E]
    return out.astype(x.dtype)


def _values(w):
    """The weight array of a plain or int8 expert weight ([X, in, out])."""
    return w.values if isinstance(w, QuantizedWeight) else w


def _unbiased(w):
    """An expert weight without its bias, if it has one."""
    return w.weight if isinstance(w, BiasedExperts) else w


def _shape(w) -> tuple:
    """[X, in, out] of an expert weight of any form."""
    w = _unbiased(w)
    return w.shape if isinstance(w, Mxfp4Weight) else _values(w).shape


def _num_experts(w):
    return _shape(w)[0]


def _grouped_fits(grouped, w_gate) -> bool:
    embed, mlp = _shape(w_gate)[1:]
    return grouped.fits(embed, mlp) and grouped.fits(mlp, embed)


def resolve_expert_impl(impl: str, num_pairs: int, w_gate, w_down, grouped=None) -> str:
    """The implementation "auto" stands for, for this many (token, expert) pairs and these weights.

    `grouped`: the Pallas grouped matmul (Kernels.grouped_matmul: `matmul` and `fits(k, n)`), or None
    where dispatch gives none (moe_impl "auto" off the GPU, or another impl forced).
    Where it is given and takes the shapes, the Pallas grouped matmul. In full steps on the H200 (benchmarks/moe.py,
    random weights, ms; docs/BENCHMARKS.md) it is the fastest at batch-1 decode (Mixtral-shaped 3.35 vs 5.59
    gathered, 6.34 dense; DeepSeek-V3-shaped 5.01 vs 5.23 gathered, 14.40 dense), at batch-64
    decode on DeepSeek (9.24 vs 18.21 dense) and at 2048-token prefill (33.6 vs 82.1 dense
    Mixtral; 325.8 vs 454.6 dense DeepSeek; XLA's ragged_dot pads every group to a dense
    contraction: 123.6 and 1303.5). It loses one case: Mixtral batch-64 decode, 8.74 vs 7.57 dense.
    Elsewhere (CPU): the gathered path when the pairs are few next to the experts (it reads only
    the chosen experts' weights; a gather copies what it reads, hence the factor 3), else ragged_dot.
    MXFP4 experts as well: the Pallas kernel expands them in registers, reading only the experts that have
    rows; where it is not given, the gathered path expands the chosen experts only, ragged_dot every expert's
    weights each step.
    """
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"moe_impl={impl!r} is not one of {', '.join(EXPERT_IMPLS)}")
    if impl == "pallas" and grouped is None:
        raise ValueError("moe_impl='pallas' needs the Pallas grouped matmul: pass the kernels of "
                         "pallas_kernels.dispatch.get_kernels(moe_impl='pallas') (Kernels.grouped_matmul)")
    if impl != "auto":
        return impl
    if grouped is not None and _grouped_fits(grouped, w_gate):
        return "pallas"
    if 3 * num_pairs <= _num_experts(w_gate):
        return "gathered"
    return "ragged_dot"


def expert_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, act, impl: str = "auto", grouped=None):
    """The routed experts' output [T, E] by `impl` (see the module docstring); all give the same answer.
    `grouped`: Kernels.grouped_matmul, the Pallas grouped matmul "pallas" runs (and "auto" may).

    A pair whose id equals the number of experts in w_* (with weight 0) is computed by no expert
    here: expert parallelism marks so the pairs routed to other devices' experts.
    """
    impl = resolve_expert_impl(impl, topk_ids.size, w_gate, w_down, grouped)
    if impl == "dense":
        return dense_expert_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, act)
    if impl == "gathered":
        return gathered_expert_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, act)
    matmul = grouped.matmul if impl == "pallas" else ragged_dot
    return grouped_expert_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, act, grouped_matmul=matmul)


def _dense(w, dtype):
    """All experts' weights [X, in, out] in `dtype` (without a BiasedExperts' bias)."""
    w = _unbiased(w)
    if isinstance(w, Mxfp4Weight):
        return dequantize_mxfp4(w, dtype)
    return dequantize(w, dtype) if isinstance(w, QuantizedWeight) else w.astype(dtype)


def dense_expert_ffn(x, topk_ids, topk_weights, w_gate, w_up, w_down, act):
    """Every expert on every token, then a weighted sum over the chosen ones (baseline, O(X) work)."""
    num_tokens = x.shape[0]
    wg, wu, wd = _dense(w_gate, x.dtype), _dense(w_up, x.dtype), _dense(w_down, x.dtype)
    num_experts = wg.shape[0]
    bias = lambda w: w.bias.astype(jnp.float32)[:, None, :] if isinstance(w, BiasedExperts) else 0.0  # [X, 1, F]
    gate = jnp.einsum("te,xef->xtf", x, wg, preferred_element_type=jnp.float32) + bias(w_gate)  # [X, T, F]
    up = jnp.einsum("te,xef->xtf", x, wu, preferred_element_type=jnp.float32) + bias(w_up)
    out = jnp.einsum("xtf,xfe->xte", gated(act, gate, up).astype(x.dtype), wd, preferred_element_type=jnp.float32) + bias(w_down)
    combine = jnp.zeros((num_tokens, num_experts), jnp.float32).at[jnp.arange(num_tokens)[:, None], topk_ids].add(
        topk_weights.astype(jnp.float32))  # [T, X]
    return jnp.einsum("xte,tx->te", out, combine).astype(x.dtype)
