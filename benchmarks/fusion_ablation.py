"""A timing-only ablation of the Llama decoder: the same forward with some small ops left out, to measure
how much a step could gain at most from fusing them into the matmuls (the question behind issue #5's
int8-vs-bf16 target). The outputs are WRONG by design; nothing but step times may be read from it.

What each name removes from every layer (the final norm, attention and the matmuls stay):
- "norm": both RMSNorms (the matmuls read the residual stream as it is), as if each norm were folded
  into the prologue of the matmul after it;
- "silu": SiLU(gate) x up (the down matmul reads `up`; `gate` is kept alive through an optimization
  barrier, so the gate/up matmul still computes its whole output), as if the activation were the
  gate/up matmul's epilogue;
- "residual": both residual adds (the stream is the branch's output), as if each add were the epilogue
  of the matmul before it; XLA's scale multiply of an int8 matmul then fuses into whatever reads it;
- "fold_norm" (not a removal): each RMSNorm is split into its row factor r = rsqrt(mean(h^2) + eps), computed
  from the stream, and its weight, which is taken as folded into the next matmuls' weights (diag(g) W): the
  matmuls read the stream itself and their outputs are multiplied by r. With unit norm weights (the
  random models') this is the same function; it asks whether XLA then computes r inside the residual
  add's kernel, so that a norm costs no kernel of its own.

benchmarks/decode_latency.py --ablate installs it (patching jlight.models.llama.forward before the
engine traces its step).
"""
import jax
import jax.numpy as jnp

from jlight.models import llama
from jlight.models.layers import column_projections, rms_norm, run_layers
from jlight.models.rope import inv_frequencies
from jlight.sharding import ops as parallel_ops

ABLATIONS = ("norm", "silu", "residual", "fold_norm")


def _row_factor(h, eps):
    """RMSNorm's per-row factor, [T, 1] float32."""
    h32 = h.astype(jnp.float32)
    return jax.lax.rsqrt(jnp.mean(h32 * h32, axis=-1, keepdims=True) + eps)


def _scaled(y, r):
    return (y.astype(jnp.float32) * r).astype(y.dtype)


def _scaling_matmul(matmul, r, weights):
    """`matmul` whose outputs for the weights in `weights` (identity) are multiplied by r."""
    ids = {id(w) for w in weights}

    def mm(x, w, out_dtype=None, **kw):
        y = matmul(x, w, out_dtype, **kw)
        return _scaled(y, r) if id(w) in ids else y
    return mm


def make_forward(ablate: set):
    """llama.forward's signature and work, minus the ops named in `ablate`."""
    unknown = set(ablate) - set(ABLATIONS)
    if unknown:
        raise ValueError(f"unknown ablations {sorted(unknown)}; choose from {', '.join(ABLATIONS)}")

    def forward(params, config, tokens, k_cache, v_cache, md, kernels):
        ops = parallel_ops.current()
        c, mm = config, kernels.matmul
        act = llama.activation(c.hidden_act)
        inv_freq, rope_factor = inv_frequencies(c.head_dim, c.rope_theta, c.rope_scaling)

        def norm(h, weight):
            return h if "norm" in ablate else rms_norm(h, weight, c.rms_norm_eps)

        def add(h, branch):
            return branch if "residual" in ablate else h + branch

        def layer(carry, xs):
            h, k_cache, v_cache = carry
            lp, layer_idx = xs
            layer_kernels = kernels
            if "fold_norm" in ablate:
                qkv = [lp[n] for n in ("wq", "wk", "wv") if n in lp] + ([lp["wqkv"].weight] if "wqkv" in lp else [])
                layer_kernels = kernels._replace(matmul=_scaling_matmul(mm, _row_factor(h, c.rms_norm_eps), qkv))
                x = h
            else:
                x = norm(h, lp["attn_norm"])
            attn, k_cache, v_cache = llama.attention(c, lp, x, k_cache, v_cache, layer_idx, md, layer_kernels,
                                                     inv_freq, rope_factor)
            h = add(h, attn)
            if "fold_norm" in ablate:
                r = _row_factor(h, c.rms_norm_eps)
                gate, up = (_scaled(y, r) for y in column_projections(ops, h, lp, ("w_gate", "w_up"), mm))
            else:
                gate, up = column_projections(ops, norm(h, lp["mlp_norm"]), lp, ("w_gate", "w_up"), mm)
            if "silu" in ablate:
                gate, up = jax.lax.optimization_barrier((gate, up))  # gate stays computed, unused
                mlp_in = up
            else:
                mlp_in = act(gate) * up
            return (add(h, ops.row_linear(mlp_in, lp["w_down"], mm)), k_cache, v_cache), None

        h = ops.embed(params["embed"], tokens).astype(params["final_norm"].dtype)
        h, k_cache, v_cache = run_layers(layer, (h, k_cache, v_cache), params["layers"])
        h = rms_norm(h, params["final_norm"], c.rms_norm_eps)
        return ops.gather_sequence(h), k_cache, v_cache

    return forward


def install(ablate: set):
    """Patch llama.forward with the ablated one; returns a function that restores it."""
    original = llama.forward
    llama.forward = make_forward(ablate)

    def restore():
        llama.forward = original
    return restore
