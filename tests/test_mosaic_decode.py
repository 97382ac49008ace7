"""The transposed Mosaic GPU fp8 decode kernel (pallas_kernels/paged_decode_mosaic.py) on the CPU.

As for the other Mosaic GPU kernels: interpret mode runs its TMA copies, barriers and slots against the
XLA reference on fresh random inputs (buffers start as NaN), the race detector checks the slot protocol,
and the wgmma path (K from registers, V converted, the transposed operands, the 32-byte swizzles) is
lowered for CUDA at the H200's shapes.
"""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from kernel_batches import (check_attention_output, cuda_lowering_text, random_attention_inputs,
                            reference_attention)
from jlight.core.quantization import FP8_KV_DTYPE
from jlight.pallas_kernels import paged_decode_mosaic, pallas_mode

S = jax.ShapeDtypeStruct

# (name, group, head_dim, q_lens, context_lens, num_tokens, page_size, kinds, num_items, kv_per_step)
CASES = [
    # page boundaries (16, 17, 64, 65, 128, 129), an empty row, work items over ragged rows, GQA 4
    ("items_ragged", 4, 128, [1, 1, 1, 0, 1, 1, 1, 1], [1, 16, 17, 0, 64, 65, 129, 700], 8, 16, {}, 12, 128),
    ("one_program_per_row_gqa8_d64", 8, 64, [1, 1, 1], [33, 1, 150], 4, 32, {}, 0, 64),
    ("batch1_items", 4, 128, [1], [1500], 8, 16, {}, 12, 128),  # one long row (and 7 padding blocks) on 12 items
    ("window_sinks_softcap", 8, 64, [1, 1, 1], [900, 40, 300], 4, 16, dict(sliding_window=128, sinks=True, soft_cap=30.0),
     9, 128),
    ("gqa3_pages8_window", 3, 64, [1, 1], [70, 130], 2, 8, dict(sliding_window=64), 0, 64),
]



# batch1_items (one long row on 12 items) runs with -m extended: two other cases take items too.
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.extended) if c[0] == "batch1_items" else c
                                  for c in CASES], ids=[c[0] for c in CASES])
def test_matches_reference(case, monkeypatch):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call, params

    if pallas_mode.default_interpret():
        monkeypatch.setattr(paged_decode_mosaic, "interpret_params", lambda: params.InterpretGPUParams(detect_races=True))
    name, group, head_dim, q_lens, ctx_lens, num_tokens, page_size, kinds, num_items, kv_per_step = case
    rng = np.random.default_rng(sum(map(ord, name)))
    q, k, v, md = random_attention_inputs(rng, group, head_dim, q_lens, ctx_lens, num_tokens, page_size, pools="fp8")
    kw = dict(kinds, scale=head_dim ** -0.5)
    if kw.pop("sinks", False):  # large enough to matter
        kw["sinks"] = jnp.asarray(rng.standard_normal(q.shape[1]) * 2 + 5, jnp.float32)
    assert paged_decode_mosaic.supports(q, k, md)
    want = reference_attention(q.astype(jnp.float32), k, v, jnp.int32(1), md, **kw)  # the reference reads fp8 as float32
    got = paged_decode_mosaic.paged_attention(q, k, v, jnp.int32(1), md, num_items=num_items, kv_per_step=kv_per_step,
                                              **kw)
    check_attention_output(got, want, md, jnp.bfloat16)
    if pallas_mode.default_interpret():
        assert not interpret_pallas_call.get_races().races_found


@pytest.mark.parametrize("page_size,head_dim,group,cfg", [
    (16, 128, 4, {}), (16, 128, 8, dict(kv_per_step=64)), (16, 128, 4, dict(num_items=0)),
    (64, 128, 8, dict(num_items=0)), (8, 64, 3, {}), (32, 128, 8, dict(sliding_window=128, sinks=True, soft_cap=30.0)),
])
def test_cuda_lowering_at_h200_shapes(page_size, head_dim, group, cfg):
    """The wgmma path (not the interpreter's dots) lowers for CUDA, layout inference included."""
    cfg = dict(cfg, sinks=jnp.zeros(8 * group, jnp.float32) if cfg.get("sinks") else None)
    text = cuda_lowering_text(paged_decode_mosaic.paged_attention, [1] * 8, [4096] * 8, 8, page_size=page_size,
                              num_heads=8 * group, head_dim=head_dim,
                              pool=lambda shape: S(shape, FP8_KV_DTYPE), **cfg)
    assert "mosaic_gpu" in text


def test_mosaic_routes_fp8_decode_steps_of_16_rows_here(monkeypatch):
    """attention_impl "mosaic": one-token blocks over fp8 pools in steps of paged_decode_mosaic.MIN_BLOCKS or
    more to this kernel with every attention kind; smaller fp8 decode steps, 16-bit pools and prefill-shaped
    steps as before (the Mosaic decode and prefill kernels)."""
    from jlight.pallas_kernels import dispatch, paged_attention_mosaic, paged_prefill_mosaic

    rng = np.random.default_rng(5)
    calls = []
    for module, name in ((paged_decode_mosaic, "transposed"), (paged_prefill_mosaic, "prefill"),
                         (paged_attention_mosaic, "mosaic")):
        monkeypatch.setattr(module, "paged_attention", lambda *a, name=name, **kw: calls.append((name, kw)))
    attention = dispatch.get_kernels("mosaic").paged_attention
    sinks = jnp.zeros(8, jnp.float32)
    fp8 = lambda x: x.astype(FP8_KV_DTYPE)
    for q_lens, tokens in (([1] * 16, 16), ([1, 1], 8), ([40, 1], 48)):
        q, k, v, md = random_attention_inputs(rng, 4, 64, q_lens, [300, 20] * (len(q_lens) // 2), tokens, 16)
        attention(q, fp8(k), fp8(v), jnp.int32(0), md, scale=0.125, sliding_window=64, soft_cap=30.0, sinks=sinks)
        attention(q, k, v, jnp.int32(0), md, scale=0.125, sliding_window=None)
    # the prefill-shaped fp8 step's 64-token window is under PREFILL_KERNEL_MIN_WINDOW: the decode kernel's blocks
    assert [c[0] for c in calls] == ["transposed", "mosaic", "mosaic", "mosaic", "mosaic", "prefill"]
    assert calls[0][1]["soft_cap"] == 30.0 and calls[0][1]["sinks"] is sinks and calls[0][1]["sliding_window"] == 64
    with pytest.raises(ValueError, match="mosaic, triton"):
        dispatch.get_kernels("mosaic-t")
