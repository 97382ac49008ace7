"""NVIDIA Nemotron-H (NemotronHForCausalLM): a stack of single-mixer layers, each Mamba-2, attention or
an MLP, in the order the config's layer types (or hybrid_override_pattern: M, *, -) give.

A layer is `h + mixer(norm(h))`. Mamba-2 and attention are models/mamba2.py's (attention without RoPE,
scale head_dim ** -0.5; dt clamped below at time_step_min); the MLP is up_proj, relu2 (mlp_hidden_act),
down_proj. The final norm is norm_f. MoE layers (E, Nemotron-3's) are not supported yet.
The params tree: "mamba_layers", "attn_layers", "mlp_layers" groups (models/hybrid.py).
"""
from __future__ import annotations

from flax import nnx

from jlight.core.config import ModelConfig
from jlight.core.errors import UnsupportedModelError
from jlight.models.hybrid import HybridDecoder, hybrid_functions
from jlight.models.layers import activation, rms_norm, unstack_layers  # noqa: F401  (unstack_layers: the engine's)
from jlight.models.mamba2 import AttentionMixer, MambaMixer, mamba_state_shapes
from jlight.models.module import ParamMaker, Step, value

_KINDS = {"linear_attention": "mamba", "mamba": "mamba", "M": "mamba", "full_attention": "attention",
          "attention": "attention", "*": "attention", "mlp": "mlp", "-": "mlp"}


def layer_kinds(config: ModelConfig) -> list[str]:
    x = config.extra
    types = x.get("layer_types") or x.get("layers_block_type") or list(x.get("hybrid_override_pattern") or "")
    bad = sorted(set(types) - _KINDS.keys())
    if bad or len(types) != config.num_layers:
        raise UnsupportedModelError(
            f"layer types {bad or types} of {config.architecture} are not supported: each of the {config.num_layers} "
            "layers must be Mamba-2 (M), attention (*) or an MLP (-); MoE layers (E) are not supported yet")
    return [_KINDS[t] for t in types]


class Block(nnx.Module):
    """A layer's norm; the mixer (self.mix) adds its output to the residual stream."""

    def __init__(self, config: ModelConfig, stack: int | None):
        self.config = config
        self.norm = ParamMaker(stack)((config.hidden_size,), ("embed_norm",))

    def __call__(self, h, caches, index: int, step: Step):
        out, caches = self.mix(rms_norm(h, value(self, "norm"), self.config.rms_norm_eps), caches, index, step)
        return h + out, caches


class MambaLayer(MambaMixer, Block):
    def __init__(self, config: ModelConfig, stack: int | None):
        super().__init__(config, stack)
        self.declare_mamba(config, stack)


class AttentionLayer(AttentionMixer, Block):
    uses_rope = False

    def __init__(self, config: ModelConfig, stack: int | None):
        super().__init__(config, stack)
        self.declare_attention(config, stack)


class MlpLayer(Block):
    def __init__(self, config: ModelConfig, stack: int | None):
        super().__init__(config, stack)
        p, E, F = ParamMaker(stack), config.hidden_size, config.intermediate_size
        self.up_proj = p((E, F), ("embed", "mlp"))
        self.down_proj = p((F, E), ("mlp", "embed"))
        if config.extra.get("mlp_bias"):
            self.up_bias = p((F,), ("mlp",))
            self.down_bias = p((E,), ("embed_norm",))

    def mix(self, x, caches, index: int, step: Step):
        ops, mm = step.ops, step.kernels.matmul
        up = ops.column_linear(x, value(self, "up_proj"), mm)
        if hasattr(self, "up_bias"):
            up = up + value(self, "up_bias").astype(up.dtype)
        out = ops.row_linear(activation(self.config.extra.get("mlp_hidden_act", "relu2"))(up), value(self, "down_proj"), mm)
        if hasattr(self, "down_bias"):
            out = out + value(self, "down_bias").astype(out.dtype)
        return out, caches


class NemotronH(HybridDecoder):
    KINDS = {"mamba": ("mamba_layers", MambaLayer), "attention": ("attn_layers", AttentionLayer),
             "mlp": ("mlp_layers", MlpLayer)}
    layer_kinds = staticmethod(layer_kinds)


param_shapes, param_axes, init_params, forward, compute_logits, kv_cache_shapes = hybrid_functions(NemotronH)


def state_shapes(config: ModelConfig, num_slots: int) -> dict:
    """The Mamba layers' state pools (models/mamba2.py)."""
    return mamba_state_shapes(config, layer_kinds(config).count("mamba"), num_slots)
