"""SmoothQuant (Xiao et al. 2022, arXiv:2211.10438) for jlight's W8A8: move activation outliers
into the weights before quantizing.

W8A8 quantizes activations per token, so one outlier channel (common after RMSNorm) sets the
token's scale and rounds the other channels to a few levels. SmoothQuant divides each input
channel j of a linear layer's activations by s_j and multiplies row j of its weight by s_j:
X W = (X / s)(s W), exact in real arithmetic, with s_j = amax(|X_j|)^alpha / amax(|W_j|)^(1 - alpha)
taken over calibration tokens. The division is folded into whatever produces X, so nothing is
added at run time and the checkpoint format does not change:
  q/k/v and gate/up inputs -> the RMSNorm weight before them (attn_norm, mlp_norm);
  wo's input (the attention output) -> wv's output columns (attention is linear in V; the
    q heads of one KV head share V, so they share s);
  w_down's input (act(gate) * up) -> w_up's output columns;
  the lm_head's input -> final_norm.
Offline, like GPTQ (jlight/quantization/gptq.py, whose calibration forward this reuses): plain
Llama family only.

    smoothed = smooth_params(params, config, segments, alpha=0.5)   # then quantize_params(smoothed, "w8a8")
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jlight.models.layers import rms_norm
from jlight.quantization import gptq


def activation_amax(params: dict, config, segments) -> dict:
    """Per-channel max |x| of every linear layer's input over `segments` (token-id lists, each its
    own sequence from position 0), one pass over the model: {"qkv", "gate_up": [L, E],
    "wo": [L, heads * head_dim], "w_down": [L, mlp], "lm_head": [E]} float64."""
    gptq._check_family(config)
    L = config.num_layers
    amax = {n: [None] * L for n in ("qkv", "wo", "gate_up", "w_down")}
    head = None
    layers = [gptq._layer(params, i) for i in range(L)]

    def peak(old, x):
        m = np.max(np.abs(np.asarray(x, np.float64)), axis=0)
        return m if old is None else np.maximum(old, m)

    for seg in segments:
        h = params["embed"][jnp.asarray(seg)].astype(jnp.float32)
        for i, lp in enumerate(layers):
            x = gptq._attn_inputs(config, h, lp)
            amax["qkv"][i] = peak(amax["qkv"][i], x)
            attn = gptq._attention(config, x, lp["wq"], lp["wk"], lp["wv"])
            amax["wo"][i] = peak(amax["wo"][i], attn)
            h, x = gptq._mlp_inputs(config, h, attn, lp["wo"], lp)
            amax["gate_up"][i] = peak(amax["gate_up"][i], x)
            a = gptq._down_inputs(config, x, lp["w_gate"], lp["w_up"])
            amax["w_down"][i] = peak(amax["w_down"][i], a)
            h = gptq._residual(h, a, lp["w_down"])
        head = peak(head, rms_norm(h, params["final_norm"].astype(jnp.float32), config.rms_norm_eps))
    out = {k: np.stack(v) for k, v in amax.items()}
    out["lm_head"] = head
    return out


def smoothing_scales(x_amax, w_amax, alpha: float) -> np.ndarray:
    """s = x_amax^alpha / w_amax^(1 - alpha), 1 where either is 0 (a channel that never fires)."""
    x_amax, w_amax = np.asarray(x_amax, np.float64), np.asarray(w_amax, np.float64)
    live = (x_amax > 0) & (w_amax > 0)
    s = np.ones_like(x_amax)
    s[live] = x_amax[live] ** alpha / w_amax[live] ** (1.0 - alpha)
    return np.clip(s, 1e-5, 1e5)


def _rows_amax(*weights) -> np.ndarray:
    """max |w| over the outputs of weights sharing one input: [..., in] (on the device, no copies)."""
    return np.max([np.asarray(jnp.max(jnp.abs(w), axis=-1), np.float64) for w in weights], axis=0)


def _scaled(w, factor) -> jax.Array:
    """w * factor (broadcast) in float32, back in w's dtype: one weight's float32 copy at a time,
    not the whole model's (a Llama-3-8B checkpoint is converted on ordinary hosts)."""
    return (w.astype(jnp.float32) * jnp.asarray(factor, jnp.float32)).astype(w.dtype)


def smooth_params(params: dict, config, segments, alpha: float = 0.5) -> dict:
    """A copy of a Llama-family params tree (stacked layers, unquantized) that computes the same
    function with its linear layers' input outliers moved into their weights (module docstring).
    alpha: how much of the activation range moves (SmoothQuant's migration strength)."""
    gptq._check_family(config)
    stats = activation_amax(params, config, segments)
    lay = dict(params["layers"])
    L = config.num_layers
    kvh, rep, d = config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim

    for norm, names, key in (("attn_norm", ("wq", "wk", "wv"), "qkv"), ("mlp_norm", ("w_gate", "w_up"), "gate_up")):
        s = smoothing_scales(stats[key], _rows_amax(*(lay[n] for n in names)), alpha)  # [L, embed]
        lay[norm] = _scaled(lay[norm], 1.0 / s)
        for n in names:
            lay[n] = _scaled(lay[n], s[:, :, None])

    # wo's input channel (q head h, dim j) is V's channel (KV head h // rep, j): one s per V channel.
    x_amax = stats["wo"].reshape(L, kvh, rep, d).max(axis=2)
    w_amax = _rows_amax(lay["wo"]).reshape(L, kvh, rep, d).max(axis=2)
    s_v = smoothing_scales(x_amax, w_amax, alpha).reshape(L, kvh * d)  # [L, kv_heads * head_dim]
    lay["wv"] = _scaled(lay["wv"], 1.0 / s_v[:, None, :])
    s_o = np.repeat(s_v.reshape(L, kvh, 1, d), rep, axis=2).reshape(L, kvh * rep * d)
    lay["wo"] = _scaled(lay["wo"], s_o[:, :, None])

    s = smoothing_scales(stats["w_down"], _rows_amax(lay["w_down"]), alpha)  # [L, mlp]
    lay["w_up"] = _scaled(lay["w_up"], 1.0 / s[:, None, :])
    lay["w_down"] = _scaled(lay["w_down"], s[:, :, None])

    out = dict(params, layers=lay)
    if "lm_head" in params:
        s = smoothing_scales(stats["lm_head"], _rows_amax(params["lm_head"]), alpha)  # [embed]
        out["final_norm"] = _scaled(params["final_norm"], 1.0 / s)
        out["lm_head"] = _scaled(params["lm_head"], s[:, None])
    return out
