"""YaRN RoPE scaling as DeepSeek-V2/V3 configure it (rope_scaling type "yarn", with mscale).

YaRN keeps the high-frequency RoPE dimensions as trained (extrapolation), divides the
low-frequency ones by `factor` (interpolation) and ramps linearly between the two. DeepSeek
also rescales attention: cos/sin by mscale(factor, mscale) / mscale(factor, mscale_all_dim),
and the softmax scale by mscale(factor, mscale_all_dim)^2.
"""
import math

import numpy as np


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _factor(s: dict, max_position_embeddings: int) -> float:
    # Without an explicit factor HF uses the context extension ratio.
    return s.get("factor") or max_position_embeddings / s["original_max_position_embeddings"]


def yarn_inv_frequencies(dim: int, theta: float, s: dict, max_position_embeddings: int) -> tuple[np.ndarray, float]:
    """Return (inv_freq [dim // 2] float32, attention factor applied to cos/sin)."""
    factor = _factor(s, max_position_embeddings)
    original_len = s.get("original_max_position_embeddings", max_position_embeddings)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(num_rotations):
        # The dimension whose wavelength fits `num_rotations` times into the original context.
        return dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # 1: keep the trained frequency, 0: interpolate
    inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq.astype(np.float32), float(attention_factor)


def softmax_scale_multiplier(s: dict | None, max_position_embeddings: int) -> float:
    """DeepSeek multiplies the softmax scale by mscale(factor, mscale_all_dim)^2 under YaRN."""
    if not s or s.get("rope_type", s.get("type", "default")) == "default":
        return 1.0
    mscale_all_dim = s.get("mscale_all_dim", 0)
    if not mscale_all_dim:
        return 1.0
    m = yarn_mscale(_factor(s, max_position_embeddings), mscale_all_dim)
    return m * m
