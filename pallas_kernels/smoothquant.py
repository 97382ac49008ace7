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
Offline, like GPTQ (pallas_kernels/gptq.py, whose calibration forward this reuses): plain
Llama family only.

    smoothed = smooth_params(params, config, segments, alpha=0.5)   # then quantize_params(smoothed, "w8a8")
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jlight.models.layers import rms_norm
from jlight.pallas_kernels import gptq


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
    """max |w| over the outputs of weights sharing one input: [..., in]."""
    return np.max(np.concatenate([np.abs(np.asarray(w, np.float64)) for w in weights], axis=-1), axis=-1)


def smooth_params(params: dict, config, segments, alpha: float = 0.5) -> dict:
    """A copy of a Llama-family params tree (stacked layers, unquantized) that computes the same
    function with its linear layers' input outliers moved into their weights (module docstring).
    alpha: how much of the activation range moves (SmoothQuant's migration strength)."""
    gptq._check_family(config)
    stats = activation_amax(params, config, segments)
    lay = {k: np.asarray(v, np.float64) for k, v in params["layers"].items()}
    L, E = config.num_layers, config.hidden_size
    kvh, rep, d = config.num_kv_heads, config.num_heads // config.num_kv_heads, config.head_dim

    s = smoothing_scales(stats["qkv"], _rows_amax(lay["wq"], lay["wk"], lay["wv"]), alpha)  # [L, E]
    lay["attn_norm"] = lay["attn_norm"] / s
    for n in ("wq", "wk", "wv"):
        lay[n] = lay[n] * s[:, :, None]

    s = smoothing_scales(stats["gate_up"], _rows_amax(lay["w_gate"], lay["w_up"]), alpha)
    lay["mlp_norm"] = lay["mlp_norm"] / s
    for n in ("w_gate", "w_up"):
        lay[n] = lay[n] * s[:, :, None]

    # wo's input channel (q head h, dim j) is V's channel (KV head h // rep, j): one s per V channel.
    x_amax = stats["wo"].reshape(L, kvh, rep, d).max(axis=2)
    w_amax = np.abs(lay["wo"]).max(axis=-1).reshape(L, kvh, rep, d).max(axis=2)
    s_v = smoothing_scales(x_amax, w_amax, alpha).reshape(L, kvh * d)  # [L, kv_heads * head_dim]
    lay["wv"] = lay["wv"] / s_v[:, None, :]
    s_o = np.repeat(s_v.reshape(L, kvh, 1, d), rep, axis=2).reshape(L, kvh * rep * d)
    lay["wo"] = lay["wo"] * s_o[:, :, None]

    s = smoothing_scales(stats["w_down"], np.abs(lay["w_down"]).max(axis=-1), alpha)  # [L, mlp]
    lay["w_up"] = lay["w_up"] / s[:, None, :]
    lay["w_down"] = lay["w_down"] * s[:, :, None]

    out = dict(params, layers={k: jnp.asarray(v, params["layers"][k].dtype) for k, v in lay.items()})
    if "lm_head" in params:
        head = np.asarray(params["lm_head"], np.float64)
        s = smoothing_scales(stats["lm_head"], np.abs(head).max(axis=-1), alpha)  # [E]
        out["final_norm"] = jnp.asarray(np.asarray(params["final_norm"], np.float64) / s, params["final_norm"].dtype)
        out["lm_head"] = jnp.asarray(head * s[:, None], params["lm_head"].dtype)
    assert all(v.shape[0] == L for v in lay.values()) and lay["attn_norm"].shape == (L, E)
    return out
