"""Per-layer attention kinds of the Llama-shaped families, read from the HF config.

A layer's `AttentionKind` says which positions it attends to and how it encodes them:
  * sliding_window: a token sees the last `sliding_window` positions, itself included (HF's
    `kv_idx > q_idx - sliding_window`); None sees the whole context. Gemma 2/3, gpt-oss and SmolLM3
    name each layer "sliding_attention" or "full_attention" (`layer_types`, or older configs'
    `sliding_window_pattern`); other configs give every layer `sliding_window` (Mistral) or none.
  * rope: which of the family's RoPE tables (`rope_tables`) rotates q and k; None for a layer
    without positional encoding (SmolLM3's `no_rope_layers` entries that are 0). Table 0 is the
    config's RoPE (rope_theta, rope_scaling); Gemma 3's local layers use table 1
    (rope_local_base_freq, 10,000).
The whole model shares its softmax scale (`softmax_scale`: head_dim^-0.5, Gemma's
query_pre_attn_scalar^-0.5) and attention soft-capping (`attention_soft_cap`, Gemma 2).

A layer whose kind is known while tracing (unrolled layers, or a scanned stack whose layers are
all alike) passes a static window to the attention kernels; a scanned stack of mixed layers reads
its layer's window and table from per-layer arrays (`resolve`), and the kernels' dispatch sends a
traced window to the XLA reference (pallas_kernels/dispatch.kernel_takes_kinds).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from jlight.core.config import ModelConfig
from jlight.core.errors import UnsupportedModelError
from jlight.models.rope import apply_rope, inv_frequencies
from jlight.models.rope_yarn import yarn_inv_frequencies

WHOLE_CONTEXT = 1 << 30  # a traced window this large sees every position


class AttentionKind(NamedTuple):
    sliding_window: int | None = None  # positions a token sees (itself included); None: all
    rope: int | None = 0  # index into rope_tables(config); None: no positional encoding


class RopeTable(NamedTuple):
    """One RoPE: (inv_freq [rotary_dim // 2] float32 numpy, attention factor on cos/sin). LongRoPE
    (Phi-3) also has `long_inv_freq`, which tokens of a sequence longer than `original_max` use."""
    inv_freq: np.ndarray
    factor: float = 1.0
    long_inv_freq: np.ndarray | None = None
    original_max: int | None = None


def layer_types(config: ModelConfig) -> tuple[str, ...] | None:
    """Each layer's "sliding_attention" / "full_attention", or None when the config names none."""
    x = config.extra
    if x.get("layer_types"):
        types = tuple(x["layer_types"])
        if len(types) != config.num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {config.num_layers} layers; fix config.json")
        unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
        if unknown:
            raise UnsupportedModelError(f"layer_types {unknown} are not supported; jlight runs sliding_attention and full_attention layers")
        return types
    pattern = x.get("sliding_window_pattern") or {"gemma2": 2, "gemma3_text": 6}.get(x.get("model_type"))
    if pattern:  # older Gemma configs: every pattern-th layer is global
        return tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(config.num_layers))
    return None


def layer_kinds(config: ModelConfig) -> tuple[AttentionKind, ...]:
    """The AttentionKind of every layer."""
    x, n = config.extra, config.num_layers
    types = layer_types(config)
    if types is None:
        windows = [config.sliding_window] * n
    else:
        windows = [config.sliding_window if t == "sliding_attention" else None for t in types]
    local_rope = 1 if len(rope_tables(config)) > 1 else 0
    ropes = [local_rope if w is not None else 0 for w in windows]
    no_rope = x.get("no_rope_layers")
    if no_rope is not None:
        if len(no_rope) != n:
            raise ValueError(f"no_rope_layers has {len(no_rope)} entries for {n} layers; fix config.json")
        ropes = [r if use else None for r, use in zip(ropes, no_rope)]
    return tuple(AttentionKind(w, r) for w, r in zip(windows, ropes))


def softmax_scale(config: ModelConfig) -> float:
    scalar = config.extra.get("query_pre_attn_scalar")
    return float(scalar) ** -0.5 if scalar else config.head_dim ** -0.5


def attention_soft_cap(config: ModelConfig) -> float | None:
    cap = config.extra.get("attn_logit_softcapping")
    return float(cap) if cap else None


def rotary_dim(config: ModelConfig) -> int:
    """The leading head dimensions RoPE rotates (Phi-4-mini's partial_rotary_factor < 1)."""
    dim = int(config.head_dim * config.extra.get("partial_rotary_factor", 1.0))
    if dim % 2 or dim <= 0:
        raise ValueError(f"partial_rotary_factor={config.extra.get('partial_rotary_factor')} gives an odd rotary dimension {dim}")
    return dim


def _table(config: ModelConfig, theta: float, scaling: dict | None) -> RopeTable:
    dim = rotary_dim(config)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type == "yarn":
        return RopeTable(*yarn_inv_frequencies(dim, theta, scaling, config.max_position_embeddings))
    if rope_type in ("longrope", "su"):
        return _longrope(config, dim, theta, scaling)
    return RopeTable(*inv_frequencies(dim, theta, scaling))


def _longrope(config: ModelConfig, dim: int, theta: float, s: dict) -> RopeTable:
    """LongRoPE (Phi-3/3.5/4): inv_freq divided by per-dimension short or long factors; cos/sin
    scaled by sqrt(1 + log(factor) / log(original_max)), factor = max / original context."""
    original = s.get("original_max_position_embeddings") or config.extra.get("original_max_position_embeddings")
    if not original:
        raise ValueError("rope_scaling longrope needs original_max_position_embeddings; fix config.json")
    factor = s.get("factor") or config.max_position_embeddings / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    base = theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    for name in ("short_factor", "long_factor"):
        if len(s.get(name) or ()) != dim // 2:
            raise ValueError(f"rope_scaling {name} must have {dim // 2} entries (rotary dim / 2); fix config.json")
    inv = lambda f: (1.0 / (np.asarray(f, np.float64) * base)).astype(np.float32)
    return RopeTable(inv(s["short_factor"]), float(attention_factor), inv(s["long_factor"]), int(original))


def rope_tables(config: ModelConfig) -> tuple[RopeTable, ...]:
    """The family's RoPE tables: the config's own, then Gemma 3's local one if it has one."""
    tables = (_table(config, config.rope_theta, config.rope_scaling),)
    local_theta = config.extra.get("rope_local_base_freq")
    if local_theta is not None:
        tables += (_table(config, float(local_theta), config.extra.get("rope_local_scaling")),)
    return tables


def apply_table(x, md, table: RopeTable):
    """x: [T, heads, head_dim] rotated by one table at md.positions. LongRoPE: a token whose
    sequence holds more than original_max positions after this step uses the long factors
    (HF picks them per forward call by its longest position; this is the same per sequence)."""
    inv = jnp.asarray(table.inv_freq)
    if table.long_inv_freq is not None:
        long_seq = md.context_lens[md.token_seq] > table.original_max  # [T]
        inv = jnp.where(long_seq[:, None], jnp.asarray(table.long_inv_freq)[None, :], inv[None, :])
    return apply_rope(x, md.positions, inv, table.factor)


def resolve(config: ModelConfig, kind: AttentionKind | None, layer_idx):
    """(sliding window, rope index) of a layer: its static kind, or, for kind None (a scanned stack
    of mixed layers), traced values read from the per-layer kinds at layer_idx (rope -1: none)."""
    if kind is not None:
        return kind.sliding_window, kind.rope
    kinds = layer_kinds(config)
    windows = np.array([k.sliding_window or WHOLE_CONTEXT for k in kinds], np.int32)
    ropes = np.array([-1 if k.rope is None else k.rope for k in kinds], np.int32)
    return jnp.asarray(windows)[layer_idx], jnp.asarray(ropes)[layer_idx]


def apply_rope_kind(x, md, tables: tuple[RopeTable, ...], rope):
    """x rotated by table `rope`: a static index or None (unchanged), or a traced one (-1: none)."""
    if rope is None:
        return x
    if isinstance(rope, int):
        return apply_table(x, md, tables[rope])
    out = x
    for i, table in enumerate(tables):
        out = jnp.where(rope == i, apply_table(x, md, table), out)
    return out


def static_kind(kinds: tuple[AttentionKind, ...]) -> AttentionKind | None:
    """The kind a scanned stack of these layers can hold statically: theirs if all alike, else None."""
    return kinds[0] if len(set(kinds)) == 1 else None
