"""The warp-specialized Mosaic GPU prefill attention (pallas_kernels/paged_prefill_mosaic.py) on the CPU.

As for the decode kernel (tests/test_mosaic_attention.py): Mosaic GPU's interpret mode runs the three
warpgroups, the TMA copies and every barrier against the XLA reference on fresh random inputs (its
buffers start as NaN, so a row the kernel forgets to write fails), its race detector checks the
slot protocol between the memory and the compute warpgroups, and the wgmma path is lowered for CUDA
at the H200's shapes. The cases cover a block split across both compute warpgroups and one that
fills only the first, decode rows and empty rows in a mixed step, causal masks that cross K/V steps
and pages, a chunk over earlier context, GQA groups that do not divide the 128 rows, padding tokens;
then the same over fp8 pools and with the attention kinds (sliding windows, soft-capping, sinks).
"""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from kernel_batches import check_attention_output, cuda_lowering_text, random_attention_inputs, random_batch, reference_attention
from jlight.core.quantization import FP8_KV_DTYPE, to_fp8
from jlight.pallas_kernels import dispatch, paged_attention_mosaic, paged_prefill_mosaic, pallas_mode

S = jax.ShapeDtypeStruct

# (name, group, head_dim, q_lens, context_lens, num_tokens incl. padding, page_size, kv_heads)
CASES = [
    # 32-token blocks: a chunk over 260 earlier positions, a decode row, a 20-token prompt; 4 padding tokens
    ("mixed_gqa4", 4, 64, [40, 1, 20], [300, 65, 20], 64, 16, 1),
    # 128-token blocks of one head: a block whose rows span both warpgroups and steps of 8 pages of 16
    ("mha_two_warpgroups", 1, 128, [150, 1], [150, 300], 160, 16, 1),
    # SmolLM2's 9/3 heads (group 3: 42 tokens, 126 of 128 rows), pages of 32, an empty row, two KV heads
    ("gqa3_pages32", 3, 64, [50, 0, 7], [50, 0, 130], 64, 32, 2),
]



# The first case runs by default; the others (two warpgroups' rows, group 3 with two KV heads) with -m extended.
@pytest.mark.parametrize("case", [CASES[0]] + [pytest.param(c, marks=pytest.mark.extended) for c in CASES[1:]],
                         ids=[c[0] for c in CASES])
def test_matches_reference(case, monkeypatch):
    """Against the reference; interpreted, under the race detector too: the K/V slots that the memory
    warpgroup refills once both compute warpgroups have released them (the chunk's 300 positions are three
    steps through two slots)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call, params

    interpreting = pallas_mode.default_interpret()
    if interpreting:
        monkeypatch.setattr(paged_prefill_mosaic, "interpret_params", lambda: params.InterpretGPUParams(detect_races=True))
    name, group, head_dim, q_lens, ctx_lens, num_tokens, page_size, kv_heads = case
    rng = np.random.default_rng(sum(map(ord, name)))
    q, k, v, md = random_attention_inputs(rng, group, head_dim, q_lens, ctx_lens, num_tokens, page_size, kv_heads)
    assert paged_prefill_mosaic.takes(q, k, md, None)
    f32 = lambda a: a.astype(jnp.float32)
    want = reference_attention(f32(q), f32(k), f32(v), jnp.int32(1), md, scale=head_dim ** -0.5)
    got = paged_prefill_mosaic.paged_attention(q, k, v, jnp.int32(1), md, scale=head_dim ** -0.5)
    check_attention_output(got, want, md, jnp.bfloat16)
    assert not (interpreting and interpret_pallas_call.get_races().races_found)


# (name, group, head_dim, q_lens, context_lens, num_tokens, page_size, kv_heads, pools, window, soft_cap, sinks,
#  kv_per_step)
KIND_CASES = [
    # Group 3 (42-token blocks; a warpgroup's rows are not a multiple of the group), a window of 200 over
    # steps of 64 (two pages of 32): the first block's second warpgroup starts a step later than its
    # first (it skips step 0), each has unmasked steps inside its window between masked ones; fp8 pools
    # (the memory warpgroup's conversions); sinks; a decode row and an empty row beside the chunk.
    ("fp8_window_sinks_gqa3", 3, 64, [100, 1, 0], [350, 90, 0], 104, 32, 1, "fp8", 200, None, True, 64),
    # A window narrower than a step (48 of 128) and soft-capping, GQA 4 over a chunk of earlier context,
    # a decode row, a 20-token prompt, padding tokens.
    ("window_softcap_gqa4", 4, 128, [40, 1, 20], [300, 65, 20], 64, 16, 1, "bf16", 48, 2.0, False, 128),
    # fp8 alone: SmolLM2's group 3 over pages of 32, two KV heads, an empty row.
    ("fp8_gqa3_pages32", 3, 64, [50, 0, 7], [50, 0, 130], 64, 32, 2, "fp8", None, None, False, 128),
    # Every kind over fp8 pools at head_dim 128, group 8 (16-token blocks), two KV heads, pages of 64.
    ("fp8_all_kinds_gqa8", 8, 128, [40, 1], [700, 200], 48, 64, 2, "fp8", 300, 5.0, True, 128),
]


def _kind_case(case, monkeypatch):
    """(q, K and V pools, md, the kernel's keywords, kv_per_step, races() -> whether the interpreter's race
    detector found any) of a KIND_CASES case; interpreted, under the race detector."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call, params

    interpreting = pallas_mode.default_interpret()
    if interpreting:
        monkeypatch.setattr(paged_prefill_mosaic, "interpret_params", lambda: params.InterpretGPUParams(detect_races=True))
    name, group, head_dim, q_lens, ctx_lens, num_tokens, page_size, kv_heads, pools, window, cap, sinks, kv_per_step = case
    rng = np.random.default_rng(sum(map(ord, name)))
    q, k, v, md = random_attention_inputs(rng, group, head_dim, q_lens, ctx_lens, num_tokens, page_size, kv_heads, pools=pools)
    kw = dict(scale=head_dim ** -0.5, sliding_window=window, soft_cap=cap,
              sinks=jnp.asarray(rng.standard_normal(kv_heads * group) * 2 + 5, jnp.float32) if sinks else None)  # they matter
    return q, k, v, md, kw, kv_per_step, lambda: interpreting and interpret_pallas_call.get_races().races_found


# The first two run by default (fp8, windows, sinks and soft-capping between them); the others with -m extended.
@pytest.mark.parametrize("case", KIND_CASES[:2] + [pytest.param(c, marks=pytest.mark.extended) for c in KIND_CASES[2:]],
                         ids=[c[0] for c in KIND_CASES])
def test_fp8_pools_and_attention_kinds_match_reference(case, monkeypatch):
    """Against the reference; interpreted, under the race detector too: over fp8 pools the memory
    warpgroup also writes the slots (its conversions) and refills the landing tiles, and a window
    starts a block's steps past 0 (other slots than step 0's first). On a GPU: the compiled kernel."""
    q, k, v, md, kw, kv_per_step, races = _kind_case(case, monkeypatch)
    window = kw["sliding_window"]
    assert paged_prefill_mosaic.takes(q, k, md, window)
    want = reference_attention(q.astype(jnp.float32), k, v, jnp.int32(1), md, **kw)  # the reference reads fp8 as float32
    got = paged_prefill_mosaic.paged_attention(q, k, v, jnp.int32(1), md, kv_per_step=kv_per_step, **kw)
    check_attention_output(got, want, md, jnp.bfloat16)
    assert not races()


@pytest.mark.extended  # test_matches_reference's default case runs the same slot protocol under the detector
def test_no_races_between_the_warpgroups(monkeypatch):
    """The interpreter's race detector over the K/V slots that the memory warpgroup refills once both
    compute warpgroups have released them (three steps through two slots)."""
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call, params

    monkeypatch.setattr(paged_prefill_mosaic, "interpret_params", lambda: params.InterpretGPUParams(detect_races=True))
    q, k, v, md = random_attention_inputs(np.random.default_rng(5), 4, 64, [40, 1], [300, 1], 48, 16, 1, num_layers=1)
    jax.block_until_ready(paged_prefill_mosaic.paged_attention(q, k, v, jnp.int32(0), md, scale=0.125, interpret=True))
    assert not interpret_pallas_call.get_races().races_found


@pytest.mark.parametrize("page_size,head_dim,group,pools,kinds", [
    (16, 128, 4, "bf16", {}), (64, 128, 4, "bf16", {}), (8, 128, 1, "bf16", {}), (16, 64, 3, "bf16", {}),
    (16, 128, 4, "fp8", {}), (64, 64, 3, "fp8", dict(sliding_window=1000)),
    (16, 128, 4, "bf16", dict(sliding_window=512, soft_cap=50.0, sinks=True)),
    (32, 128, 8, "fp8", dict(sliding_window=128, sinks=True)),  # gpt-oss's local layers over an fp8 cache
])
def test_cuda_lowering_at_h200_shapes(page_size, head_dim, group, pools, kinds):
    """The wgmma path (not the interpreter's dots) lowers for CUDA, layout inference included."""
    kw = dict(kinds, sinks=jnp.zeros(8 * group, jnp.float32) if kinds.get("sinks") else None)
    text = cuda_lowering_text(paged_prefill_mosaic.paged_attention, [256, 1], [3000, 700], 264, page_size=page_size,
                              num_heads=8 * group, head_dim=head_dim,
                              pool=lambda shape: S(shape, FP8_KV_DTYPE if pools == "fp8" else jnp.bfloat16), **kw)
    assert "mosaic_gpu" in text


def test_takes_prefill_steps_and_dispatch_routes_them(monkeypatch):
    rng = np.random.default_rng(2)
    prefill = random_attention_inputs(rng, 4, 64, [40, 1], [300, 1], 48, 16, 2)
    decode = random_attention_inputs(rng, 4, 64, [1, 1], [300, 1], 8, 16, 2)  # one token a block: the decode kernel
    q, k, _, md = prefill
    assert paged_prefill_mosaic.takes(q, k, md, None)
    assert paged_prefill_mosaic.takes(q, k, md, 64)  # a static sliding window
    assert not paged_prefill_mosaic.takes(q, k, md, jnp.int32(64))  # a traced one: its steps are cut while tracing
    assert paged_prefill_mosaic.takes(q, k.astype(FP8_KV_DTYPE), md, None)  # fp8 pages
    assert not paged_prefill_mosaic.takes(q, k.astype(jnp.float16), md, None)  # 16-bit pages of another dtype
    assert not paged_prefill_mosaic.takes(q.astype(jnp.float32), k.astype(jnp.float32), md, None)
    assert not paged_prefill_mosaic.takes(*decode[:2], decode[3], None)
    with pytest.raises(ValueError, match="paged_attention_mosaic"):
        paged_prefill_mosaic.paged_attention(*decode[:3], jnp.int32(0), decode[3], scale=0.1)
    calls = []
    monkeypatch.setattr(paged_prefill_mosaic, "paged_attention", lambda *a, **kw: calls.append(("prefill", kw)))
    monkeypatch.setattr(paged_attention_mosaic, "paged_attention", lambda *a, **kw: calls.append(("mosaic", kw)))
    sinks = jnp.zeros(8, jnp.float32)
    attention = dispatch.get_kernels("mosaic").paged_attention  # through kernel_or_reference_attention
    for q_, k_, v_, md_ in (prefill, decode):
        attention(q_, k_, v_, jnp.int32(0), md_, scale=0.125, sliding_window=None)
    window = dispatch.PREFILL_KERNEL_MIN_WINDOW
    attention(*prefill[:3], jnp.int32(0), prefill[3], scale=0.125, sliding_window=window, soft_cap=30.0, sinks=sinks)
    attention(*decode[:3], jnp.int32(0), decode[3], scale=0.125, sliding_window=64, sinks=sinks)
    attention(*prefill[:3], jnp.int32(0), prefill[3], scale=0.125, sliding_window=window - 1)  # the decode kernel's blocks
    assert [c[0] for c in calls] == ["prefill", "mosaic", "prefill", "mosaic", "mosaic"]
    assert calls[2][1]["soft_cap"] == 30.0 and calls[2][1]["sinks"] is sinks and calls[2][1]["sliding_window"] == window
    assert calls[3][1]["sinks"] is sinks and calls[3][1]["soft_cap"] is None
    # "pallas" (and "auto" on a GPU) run the same kernels
    calls.clear()
    pallas = dispatch.get_kernels("pallas").paged_attention
    q_, k_, v_, md_ = prefill
    pallas(q_, k_.astype(FP8_KV_DTYPE), v_.astype(FP8_KV_DTYPE), jnp.int32(0), md_, scale=0.125, sliding_window=None)
    pallas(q_, k_, v_, jnp.int32(0), md_, scale=0.125, sliding_window=window, soft_cap=30.0)
    pallas(*decode[:3], jnp.int32(0), decode[3], scale=0.125, sliding_window=None, sinks=sinks)
    assert [c[0] for c in calls] == ["prefill", "prefill", "mosaic"]


def test_blocks_launch_longest_first():
    """A mixed step's decode rows at a long context (the first rows, so the first blocks) launch with the
    chunk's last blocks, before the chunk's early blocks; unused blocks last; a sliding window counts only
    the steps it sees."""
    from jlight.core.batch_metadata import query_blocks

    # two decode rows at 1,000 positions, a 100-token chunk over 200 earlier ones (32-token blocks), padding
    q_lens, ctx_lens = [1, 1, 100], [1000, 1000, 300]
    md = random_batch(np.random.default_rng(3), q_lens, ctx_lens, page_size=16, num_pages=200, num_tokens=112)
    row, start, end = query_blocks(md.query_start, 9, 32)
    positions = jnp.pad(md.positions, (0, 1))
    order = np.asarray(paged_prefill_mosaic.launch_order(positions, start, end, 128, None))
    # blocks: 0, 1 the decode rows (8 steps of 128 each); 2..5 the chunk (positions 200-231: 2 steps,
    # 232-263: 3, 264-295: 3, 296-299: 3); 6, 7, 8 unused
    assert order.tolist() == [0, 1, 3, 4, 5, 2, 6, 7, 8]
    windowed = np.asarray(paged_prefill_mosaic.launch_order(positions, start, end, 128, 256))
    # with a 256-token window the decode rows see 3 steps (744 / 128 = 5 through 7), the chunk's blocks 2-3
    assert windowed.tolist()[:2] == [0, 1] and sorted(windowed.tolist()[2:6]) == [2, 3, 4, 5]


# ---- fp8_qk: e4m3 queries and Q K^T on the fp8 tensor cores (fp8 pools) ----------------------------

def test_fp8_queries_scale_per_head_and_round_trip():
    """One scale per head (amax of the real tokens / 448), values multiplied by its reciprocal (eagerly and
    under jit alike), a round trip within e4m3's half ulp, zero heads and padding tokens handled."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((12, 4, 64)).astype(np.float32) * np.asarray([0.01, 1.0, 30.0, 1.0])[None, :, None]
    q[:, 3] = 0.0  # a head whose rows are all zero
    q[10:] = 1e4  # padding tokens (past the 10 real ones): they do not widen the scales
    q = jnp.asarray(q, jnp.bfloat16)
    q8, scale = paged_prefill_mosaic.fp8_queries(q, 10)
    jq8, jscale = jax.jit(paged_prefill_mosaic.fp8_queries)(q, 10)
    q32 = np.asarray(q, np.float32)
    amax = np.abs(q32[:10]).max(axis=(0, 2))
    np.testing.assert_allclose(np.asarray(scale), np.where(amax > 0, amax / 448, 1.0), rtol=1e-6)
    assert q8.dtype == FP8_KV_DTYPE and np.asarray(scale)[3] == 1.0 and not np.any(np.asarray(q8[:10, 3], np.float32))
    inv = 1.0 / scale  # the product with the reciprocal, bit for bit, eagerly and under jit
    want = to_fp8(q.astype(jnp.float32) * inv[None, :, None])
    for got8, got_scale in ((q8, scale), (jq8, jscale)):
        np.testing.assert_array_equal(np.asarray(got8, np.float32), np.asarray(want, np.float32))
        np.testing.assert_array_equal(np.asarray(got_scale), np.asarray(scale))
    back = np.asarray(q8, np.float32)[:10] * np.asarray(scale)[None, :, None]
    s = np.asarray(scale)[None, :, None]
    # 3 mantissa bits: half an ulp relative (2**-4), or 2**-10 of the scale absolute among subnormals
    assert np.all(np.abs(back - q32[:10]) <= np.maximum(2 ** -4 * np.abs(q32[:10]), 2 ** -10 * s) * (1 + 1e-6))
    assert np.abs(np.asarray(q8, np.float32)[:10]).max() == 448.0  # each head's amax lands on e4m3's largest value
    assert np.all(np.abs(np.asarray(q8, np.float32)) <= 448.0)  # padding saturates, never NaN


@pytest.mark.parametrize("case", [KIND_CASES[0]], ids=[KIND_CASES[0][0]])
def test_fp8_qk_matches_reference(case, monkeypatch):
    """fp8_qk against the reference (interpreted, under the race detector too). On the queries the kernel
    multiplies (fp8_queries' values times their head's scale) it is the reference within the 16-bit
    kernels' tolerance: the scale folding and the e4m3 products are exact. On the bf16 queries it differs by
    the queries' rounding alone (at most 2**-4 of each value): bounded here by the reference's own drift
    between the two query sets, plus the 16-bit tolerance."""
    q, k, v, md, kw, kv_per_step, races = _kind_case(case, monkeypatch)
    q8, scale = paged_prefill_mosaic.fp8_queries(q, md.query_start[-1])
    q_used = q8.astype(jnp.float32) * scale[None, :, None]
    want_used = reference_attention(q_used, k, v, jnp.int32(1), md, **kw)
    want = reference_attention(q.astype(jnp.float32), k, v, jnp.int32(1), md, **kw)
    got = paged_prefill_mosaic.paged_attention(q, k, v, jnp.int32(1), md, kv_per_step=kv_per_step, fp8_qk=True, **kw)
    check_attention_output(got, want_used, md, jnp.bfloat16)
    real = int(md.query_start[-1])
    drift = np.abs(np.asarray(want_used)[:real] - np.asarray(want)[:real])
    assert np.all(np.abs(np.asarray(got, np.float32)[:real] - np.asarray(want)[:real]) <= drift + 4e-2)
    assert not races()


@pytest.mark.parametrize("head_dim,page_size,kinds", [(128, 16, {}), (64, 32, dict(sliding_window=1000, soft_cap=50.0, sinks=True))])
def test_fp8_qk_lowers_to_fp8_wgmma(head_dim, page_size, kinds):
    """Under fp8_qk Q K^T lowers for CUDA as an e4m3 x e4m3 wgmma (float32 accumulator) and P V stays
    float16; without it both products are float16."""
    import re

    kw = dict(kinds, sinks=jnp.zeros(32, jnp.float32) if kinds.get("sinks") else None)
    lower = lambda **extra: cuda_lowering_text(paged_prefill_mosaic.paged_attention, [256, 1], [3000, 700], 264,
                                                page_size=page_size, num_heads=32, head_dim=head_dim,
                                                pool=lambda shape: S(shape, FP8_KV_DTYPE), **kw, **extra)
    wgmmas = lambda text: sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k\d+\.(\w+\.\w+\.\w+)", text)))
    assert wgmmas(lower(fp8_qk=True)) == ["f32.e4m3.e4m3", "f32.f16.f16"]
    assert wgmmas(lower()) == ["f32.f16.f16"]
    with pytest.raises(ValueError, match="fp8_qk takes fp8"):
        cuda_lowering_text(paged_prefill_mosaic.paged_attention, [256, 1], [3000, 700], 264, page_size=16, num_heads=32,
                           head_dim=128, pool=lambda shape: S(shape, jnp.bfloat16), fp8_qk=True)


def test_dispatch_turns_fp8_qk_on_for_fp8_pools_only(monkeypatch):
    """get_kernels(fp8_prefill_qk=True) (EngineConfig.fp8_prefill_qk) sends prefill steps over fp8 pools to the
    prefill kernel with fp8_qk, steps over 16-bit pools without; off by default."""
    from jlight.engine.engine_config import EngineConfig

    q, k, v, md = random_attention_inputs(np.random.default_rng(2), 4, 64, [40, 1], [300, 1], 48, 16, 2)
    k8, v8 = k.astype(FP8_KV_DTYPE), v.astype(FP8_KV_DTYPE)
    calls = []
    monkeypatch.setattr(paged_prefill_mosaic, "paged_attention", lambda *a, **kw: calls.append(kw["fp8_qk"]))
    on, off = (dispatch.get_kernels("mosaic", fp8_prefill_qk=f).paged_attention for f in (True, False))
    for attention in (on, off):
        attention(q, k8, v8, jnp.int32(0), md, scale=0.125, sliding_window=None)
        attention(q, k, v, jnp.int32(0), md, scale=0.125, sliding_window=None)
        attention(q, k8, v8, jnp.int32(0), md, scale=0.125, sliding_window=None, soft_cap=30.0)  # kinds still the kernel's
    assert calls == [True, False, True, False, False, False]
    assert EngineConfig(model="m", kv_cache_dtype="fp8", fp8_prefill_qk=True).validate().fp8_prefill_qk
    with pytest.raises(ValueError, match="fp8_prefill_qk"):
        EngineConfig(model="m", fp8_prefill_qk=True).validate()  # bf16 pools: nothing to run in fp8
