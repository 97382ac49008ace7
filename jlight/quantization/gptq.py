"""GPTQ (Frantar et al. 2022, arXiv:2210.17323) into jlight's existing int8 weight format.

The format does not change: a QuantizedWeight holds int8 values [in, out] and one float32 scale
per output channel, and the scales are exactly the round-to-nearest ones (amax / 127 over the
whole output column, quantization.quantize_int8). GPTQ only chooses the int8 values differently:
it goes over the `in` dimension one input row at a time, rounds that row, and spreads the
rounding error over the rows not yet rounded, weighted by the inverse Hessian H^-1 of the
layer's reconstruction error ||X W - X W_q||^2 (H = 2 X^T X, X the layer's inputs on
calibration tokens). Since the scales are fixed up front, the running error compensation can
push a value past +-127; it is clipped there, as RTN clips.

Everything here is host-side numpy (float64) plus a small dense float32 JAX forward of the
Llama family (models/llama.py's math without the paged cache: RMSNorm, RoPE, causal GQA
attention, SwiGLU) to collect each linear layer's inputs. It is an offline tool: the engine's
loading path does not call it.

    values, scales = gptq_quantize(w, H)                       # one [in, out] weight
    hessians = collect_hessians(params, config, segments)      # one pass over the unquantized model
    qparams = gptq_quantize_params(params, config, segments)   # the whole tree, layer by layer
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jlight.core.quantization import LINEAR_WEIGHTS, QUANTIZABLE, QuantizedWeight, quantize_int8
from jlight.models.layers import activation, rms_norm
from jlight.models.rope import apply_rope, inv_frequencies


def rtn_scales(w) -> np.ndarray:
    """Per-output-channel scales [out] float32 of a [in, out] weight: quantize_int8's own (XLA
    may compute amax / 127 as a multiply by the reciprocal, 1 ulp from numpy's division)."""
    return np.asarray(quantize_int8(jnp.asarray(w, jnp.float32)).scales)


def gptq_quantize(w, H, *, damp: float = 0.01, block_size: int = 128, act_order: bool = True):
    """GPTQ of one weight w [in, out] given the Hessian H [in, in] of its inputs.

    Returns (values int8 [in, out], scales float32 [out]); the scales are rtn_scales(w).
    damp: added to H's diagonal as a fraction of its mean (numerical stability).
    block_size: rows rounded per lazy batch (the result does not depend on it, up to rounding).
    act_order: round the inputs with the largest H diagonal first (GPTQ's "act-order" /
      "desc_act"). With one scale per output channel it costs nothing at run time: the rows are
      put back in their order afterwards. On SmolLM2 it was the one setting that mattered
      (docs/BENCHMARKS.md: 96.15% -> 96.81% top-1 agreement with bf16).
    Inputs that never fire (H diagonal 0) are rounded to nearest and receive no compensation.
    """
    W = np.array(w, dtype=np.float64)  # [in, out], updated in place
    H = np.array(H, dtype=np.float64)  # [in, in]
    n_in, n_out = W.shape
    if H.shape != (n_in, n_in):
        raise ValueError(f"H has shape {H.shape}; expected {(n_in, n_in)} for a weight of shape {W.shape}")
    scales = rtn_scales(w)
    s = scales.astype(np.float64)[None, :]  # [1, out]

    diag = np.diag(H).copy()
    dead = diag <= 0
    H[dead, :] = 0.0
    H[:, dead] = 0.0
    H[dead, dead] = 1.0  # decoupled: a dead row is rounded to nearest, no error is passed on
    live = ~dead
    mean_diag = np.mean(diag[live]) if live.any() else 1.0
    H[np.arange(n_in), np.arange(n_in)] += damp * mean_diag

    perm = np.argsort(-np.diag(H), kind="stable") if act_order else np.arange(n_in)
    W, H = W[perm], H[np.ix_(perm, perm)]
    # Upper Cholesky factor U of H^-1 (H^-1 = U^T U): row i of U gives the error propagation of
    # input i onto the later inputs, U[i, i] its weight (the OBS update, done sequentially).
    U = np.linalg.cholesky(np.linalg.inv(H)).T
    Q = np.zeros((n_in, n_out), np.float64)
    for i1 in range(0, n_in, block_size):
        i2 = min(i1 + block_size, n_in)
        W1 = W[i1:i2].copy()  # [b, out]
        E1 = np.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            q = np.clip(np.round(W1[i] / s[0]), -127, 127)
            Q[i1 + i] = q
            err = (W1[i] - q * s[0]) / U1[i, i]  # [out]
            W1[i:] -= np.outer(U1[i, i:], err)
            E1[i] = err
        W[i2:] -= U[i1:i2, i2:].T @ E1  # lazy batch: the block's errors onto all later rows
    values = np.empty_like(Q)
    values[perm] = Q
    return values.astype(np.int8), scales


def rtn_values(w, scales) -> np.ndarray:
    """Round-to-nearest int8 values of w [in, out] with the given scales (quantize_int8's)."""
    return np.clip(np.round(np.asarray(w, np.float32) / scales[None, :]), -127, 127).astype(np.int8)


# ---- calibration: the inputs of every linear layer of a Llama-family model ------------------

def _dequant(w):
    if isinstance(w, QuantizedWeight):
        return w.values.astype(jnp.float32) * w.scales[..., None, :]
    return w.astype(jnp.float32)


@functools.partial(jax.jit, static_argnames=("config",))
def _attn_inputs(config, h, lp):
    """Residual stream h [T, E] -> normed x [T, E] (the input of wq, wk, wv)."""
    return rms_norm(h, lp["attn_norm"].astype(jnp.float32), config.rms_norm_eps)


@functools.partial(jax.jit, static_argnames=("config",))
def _attention(config, x, wq, wk, wv):
    """x [T, E] -> the attention output before wo [T, heads * head_dim], causal, GQA."""
    c = config
    T = x.shape[0]
    q = (x @ _dequant(wq)).reshape(T, c.num_heads, c.head_dim)
    k = (x @ _dequant(wk)).reshape(T, c.num_kv_heads, c.head_dim)
    v = (x @ _dequant(wv)).reshape(T, c.num_kv_heads, c.head_dim)
    inv_freq, factor = inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)
    pos = jnp.arange(T, dtype=jnp.int32)
    q, k = apply_rope(q, pos, inv_freq, factor), apply_rope(k, pos, inv_freq, factor)
    rep = c.num_heads // c.num_kv_heads
    k, v = jnp.repeat(k, rep, axis=1), jnp.repeat(v, rep, axis=1)  # [T, heads, D]
    scores = jnp.einsum("thd,shd->hts", q, k) * c.head_dim ** -0.5
    mask = pos[:, None] >= pos[None, :]
    if c.sliding_window:
        mask &= pos[:, None] - pos[None, :] < c.sliding_window
    scores = jnp.where(mask[None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("hts,shd->thd", probs, v).reshape(T, -1)


@functools.partial(jax.jit, static_argnames=("config",))
def _mlp_inputs(config, h, attn, wo, lp):
    """-> (h after attention [T, E], normed x [T, E] (input of w_gate, w_up))."""
    h = h + attn @ _dequant(wo)
    return h, rms_norm(h, lp["mlp_norm"].astype(jnp.float32), config.rms_norm_eps)


@functools.partial(jax.jit, static_argnames=("config",))
def _down_inputs(config, x, w_gate, w_up):
    return activation(config.hidden_act)(x @ _dequant(w_gate)) * (x @ _dequant(w_up))


@jax.jit
def _residual(h, a, w_down):
    return h + a @ _dequant(w_down)


@jax.jit
def _gram(x):
    x = x.astype(jnp.float32)
    return x.T @ x


def _check_family(config):
    if config.family != "llama" or config.attention_bias or config.qk_norm:
        raise NotImplementedError("GPTQ calibration here covers the plain Llama family (no QKV bias, no QK-norm)")


class _Hessians:
    """2 X^T X summed over all calibration tokens, float64 on the host."""

    def __init__(self):
        self.H, self.n = None, 0

    def add(self, x):
        g = np.asarray(_gram(x), np.float64)
        self.H = g if self.H is None else self.H + g
        self.n += x.shape[0]

    def value(self):
        return 2.0 * self.H / max(self.n, 1)


def _layer(params, i):
    return jax.tree.map(lambda a: a[i], params["layers"])


def collect_hessians(params: dict, config, segments) -> dict:
    """One pass of the unquantized model over `segments` (lists of token ids, each its own
    sequence from position 0): {name: H [L, in, in] float64} for each linear weight of
    models/llama.py, plus "lm_head": H [E, E]. wq/wk/wv share one H, as do w_gate/w_up."""
    _check_family(config)
    L = config.num_layers
    acc = {n: [_Hessians() for _ in range(L)] for n in ("qkv", "wo", "gate_up", "w_down")}
    head = _Hessians()
    layers = [_layer(params, i) for i in range(L)]
    for seg in segments:
        h = params["embed"][jnp.asarray(seg)].astype(jnp.float32)
        for i, lp in enumerate(layers):
            x = _attn_inputs(config, h, lp)
            acc["qkv"][i].add(x)
            attn = _attention(config, x, lp["wq"], lp["wk"], lp["wv"])
            acc["wo"][i].add(attn)
            h, x = _mlp_inputs(config, h, attn, lp["wo"], lp)
            acc["gate_up"][i].add(x)
            a = _down_inputs(config, x, lp["w_gate"], lp["w_up"])
            acc["w_down"][i].add(a)
            h = _residual(h, a, lp["w_down"])
        head.add(rms_norm(h, params["final_norm"].astype(jnp.float32), config.rms_norm_eps))
    stack = lambda k: np.stack([a.value() for a in acc[k]])
    out = {"wq": stack("qkv"), "wo": stack("wo"), "w_gate": stack("gate_up"), "w_down": stack("w_down")}
    out.update(wk=out["wq"], wv=out["wq"], w_up=out["w_gate"], lm_head=head.value())
    return out


def _gptq_joint(weights, H, **kw):
    """GPTQ of several weights sharing one input (and H), as one [in, sum(out)] problem."""
    w = np.concatenate([np.asarray(x, np.float32) for x in weights], axis=1)
    values, scales = gptq_quantize(w, H, **kw)
    out, start = [], 0
    for x in weights:
        n = x.shape[1]
        out.append(QuantizedWeight(jnp.asarray(values[:, start:start + n]), jnp.asarray(scales[start:start + n])))
        start += n
    return out


def gptq_quantize_params(params: dict, config, segments, *, keep=(), sequential: bool = True, log=None, **kw) -> dict:
    """A copy of a Llama-family params tree with its linear weights GPTQ-quantized to int8
    (QuantizedWeight, the layout quantize_params(params, "int8") gives), calibrated on
    `segments` (lists of token ids). keep: names from QUANTIZABLE left unquantized.

    sequential=True (GPTQ's own order, "true-sequential"): the inputs of each weight are
    computed with every weight before it already quantized: layer by layer, and inside a layer
    wq/wk/wv, then wo, then w_gate/w_up, then w_down; the lm_head sees the quantized model's
    final hidden states. sequential=False: every H from the unquantized model (collect_hessians).
    **kw: gptq_quantize's damp, block_size, act_order.
    """
    _check_family(config)
    keep = (keep,) if isinstance(keep, str) else tuple(keep)
    unknown = [n for n in keep if n not in QUANTIZABLE]
    if unknown:
        raise ValueError(f"keep={keep!r}: {unknown} not in {QUANTIZABLE}")
    log = log or (lambda s: None)
    L = config.num_layers
    layers_in = [_layer(params, i) for i in range(L)]
    hess = None if sequential else collect_hessians(params, config, segments)
    segs = [list(s) for s in segments]
    hs = [params["embed"][jnp.asarray(s)].astype(jnp.float32) for s in segs]  # residual streams
    new_layers = []

    def quantize(names, i, inputs_of):
        """GPTQ of weights `names` of layer i (kept ones returned as they are)."""
        lp = layers_in[i]
        todo = [n for n in names if n not in keep]
        if not todo:
            return {n: lp[n] for n in names}
        if hess is not None:
            H = hess[todo[0]][i]
        else:
            acc = _Hessians()
            for x in inputs_of:
                acc.add(x)
            H = acc.value()
        q = dict(zip(todo, _gptq_joint([np.asarray(lp[n].astype(jnp.float32)) for n in todo], H, **kw)))
        return {n: q.get(n, lp[n]) for n in names}

    for i in range(L):
        lp = dict(layers_in[i])
        xs = [_attn_inputs(config, h, lp) for h in hs]
        lp.update(quantize(("wq", "wk", "wv"), i, xs))
        attns = [_attention(config, x, lp["wq"], lp["wk"], lp["wv"]) for x in xs]
        lp.update(quantize(("wo",), i, attns))
        hx = [_mlp_inputs(config, h, a, lp["wo"], lp) for h, a in zip(hs, attns)]
        xs = [x for _, x in hx]
        lp.update(quantize(("w_gate", "w_up"), i, xs))
        acts = [_down_inputs(config, x, lp["w_gate"], lp["w_up"]) for x in xs]
        lp.update(quantize(("w_down",), i, acts))
        hs = [_residual(h, a, lp["w_down"]) for (h, _), a in zip(hx, acts)]
        new_layers.append(lp)
        log(f"layer {i}: done")

    out = dict(params)
    layers = dict(params["layers"])
    for name in LINEAR_WEIGHTS:
        if name in layers and name not in keep:
            layers[name] = QuantizedWeight(jnp.stack([lp[name].values for lp in new_layers]),
                                           jnp.stack([lp[name].scales for lp in new_layers]))
    out["layers"] = layers
    if "lm_head" in params and "lm_head" not in keep:
        if hess is not None:
            H = hess["lm_head"]
        else:
            acc = _Hessians()
            for h in hs:
                acc.add(rms_norm(h, params["final_norm"].astype(jnp.float32), config.rms_norm_eps))
            H = acc.value()
        (out["lm_head"],) = _gptq_joint([np.asarray(params["lm_head"].astype(jnp.float32))], H, **kw)
        log("lm_head: done")
    return out
