"""Rotary position embeddings (HF "rotate half" layout) with the scaling schemes HF configs name."""
import math

import jax.numpy as jnp
import numpy as np


def inv_frequencies(head_dim: int, theta: float, scaling: dict | None) -> tuple[np.ndarray, float]:
    """Return (inv_freq [head_dim // 2] float32, attention_factor applied to cos/sin)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in ("default", None):
        return inv_freq.astype(np.float32), 1.0
    if rope_type == "linear":
        return (inv_freq / scaling["factor"]).astype(np.float32), 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling).astype(np.float32), 1.0
    raise ValueError(f"rope_scaling type {rope_type!r} is not supported; supported: default, linear, llama3")


def _llama3(inv_freq: np.ndarray, s: dict) -> np.ndarray:
    factor, low, high = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
    old_len = s.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(is_medium, smoothed, scaled)


def apply_rope(x, positions, inv_freq, attention_factor: float = 1.0):
    """x: [T, heads, head_dim]; positions: [T]. Rotates pairs (i, i + d/2) of x's first
    d = 2 * len(inv_freq) dimensions (the rest pass through: partial rotary); inv_freq is [d/2]
    or per token [T, d/2]."""
    d = 2 * inv_freq.shape[-1]
    freqs = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)  # [T, d/2]
    cos = (jnp.cos(freqs) * attention_factor)[:, None, :]
    sin = (jnp.sin(freqs) * attention_factor)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2, rest = x32[..., : d // 2], x32[..., d // 2: d], x32[..., d:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)
    return out.astype(x.dtype)
