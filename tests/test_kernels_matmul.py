"""int8 Pallas matmuls (interpret mode on CPU) and quantize_params."""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jlight.pallas_kernels import matmul_pallas, matmul_reference
from jlight.core.quantization import (
    LINEAR_WEIGHTS, QuantizedWeight, QuantizedWeightT, W8A8Weight, W8A8WeightT, dequantize, int8_to_f32, quantize_int8,
    transpose_to_kmajor)
from jlight.quantization.rtn import quantize_params


def _weights(rng, k, n):
    return jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)


@pytest.mark.parametrize("m,k,n,dtype", [
    (1, 576, 192, jnp.float32),  # CUDA-core GEMV path
    (3, 256, 320, jnp.bfloat16),  # GEMV path, several rows
    (20, 128, 64, jnp.float32),  # tensor-core tile path, rows padded to the tile
    (8, 256, 128, jnp.bfloat16),  # tensor-core tile path in bf16
])
def test_w8a16_matches_dequantized_reference(m, k, n, dtype):
    rng = np.random.default_rng(m)
    w = quantize_int8(_weights(rng, k, n))
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    got = np.asarray(matmul_pallas.matmul(x, w, out_dtype=jnp.float32))
    want = np.asarray(x.astype(jnp.float32) @ dequantize(w))
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-4
    np.testing.assert_allclose(got, want, atol=tol, rtol=tol)


def test_int8_to_f32_by_exponent_bits_is_exact():
    v = jnp.arange(-128, 128, dtype=jnp.int32).astype(jnp.int8)
    np.testing.assert_array_equal(np.asarray(int8_to_f32(v)), np.arange(-128, 128, dtype=np.float32))


def test_w8a16_split_k_equals_one_pass():
    rng = np.random.default_rng(3)
    w = quantize_int8(_weights(rng, 512, 64))
    x = jnp.asarray(rng.standard_normal((2, 512)), jnp.float32)
    one = matmul_pallas.w8a16_matmul(x, w, num_splits=1, block_k=64)
    four = matmul_pallas.w8a16_matmul(x, w, num_splits=4, block_k=64)
    np.testing.assert_allclose(np.asarray(four), np.asarray(one), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m", [1, 40])
def test_w8a8_matches_reference_exactly_in_int32(m):
    """Same int8 activations and K-major weights (W8A8WeightT, the layout Hopper's 8-bit wgmma wants):
    the int32 sums are exact, so only the final float scaling can differ from XLA's on either layout."""
    rng = np.random.default_rng(10 + m)
    w = W8A8Weight(*quantize_int8(_weights(rng, 256, 128)))
    (w_t,) = transpose_to_kmajor([w])
    assert type(w_t) is W8A8WeightT and w_t.values_t.shape == (128, 256)
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.float32)
    got = np.asarray(matmul_pallas.w8a8_matmul(x, w_t, block_n=32))  # four output tiles
    np.testing.assert_allclose(got, np.asarray(matmul_reference.matmul(x, w)), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got, np.asarray(matmul_reference.matmul(x, w_t)), atol=1e-5, rtol=1e-5)
    # and both stay close to the float product (int8 activation + weight error)
    exact = np.asarray(x @ dequantize(w))
    assert np.linalg.norm(got - exact) / np.linalg.norm(exact) < 2e-2
    with pytest.raises(TypeError, match="K-major"):
        matmul_pallas.w8a8_matmul(x, w)


def test_matmul_keeps_leading_dims_and_plain_weights():
    rng = np.random.default_rng(4)
    w = _weights(rng, 64, 32)
    x = jnp.asarray(rng.standard_normal((2, 3, 64)), jnp.float32)
    np.testing.assert_allclose(np.asarray(matmul_pallas.matmul(x, w)), np.asarray(x @ w), atol=1e-5)
    q = quantize_int8(w)
    assert matmul_pallas.matmul(x, q).shape == (2, 3, 32)


def _tiny_params(rng, layers=2, embed=64, mlp=128, vocab=96):
    shapes = {"wq": (embed, embed), "wk": (embed, 32), "wv": (embed, 32), "wo": (embed, embed),
              "w_gate": (embed, mlp), "w_up": (embed, mlp), "w_down": (mlp, embed)}
    lp = {k: jnp.asarray(rng.standard_normal((layers, *s)), jnp.float32) for k, s in shapes.items()}
    lp["attn_norm"] = jnp.ones((layers, embed))
    return {"embed": jnp.ones((vocab, embed)), "layers": lp, "final_norm": jnp.ones(embed),
            "lm_head": jnp.asarray(rng.standard_normal((embed, vocab)), jnp.float32)}


@pytest.mark.parametrize("mode,weight_type", [("int8", QuantizedWeight), ("w8a8", W8A8Weight)])
def test_quantize_params_stacked_layers(mode, weight_type):
    params = _tiny_params(np.random.default_rng(5))
    qp = quantize_params(params, mode)
    for name in LINEAR_WEIGHTS:
        w = qp["layers"][name]
        assert type(w) is weight_type and w.values.dtype == jnp.int8
        L, k, n = params["layers"][name].shape
        assert w.values.shape == (L, k, n) and w.scales.shape == (L, n)
        err = np.abs(np.asarray(dequantize(w)) - np.asarray(params["layers"][name])).max()
        assert err <= np.abs(np.asarray(params["layers"][name])).max() / 127
    assert type(qp["lm_head"]) is weight_type  # the default quantizes the lm_head too (keep=())
    assert qp["layers"]["attn_norm"] is params["layers"]["attn_norm"] and qp["embed"] is params["embed"]

    # lax.scan slices values and scales per layer and keeps the weight type
    def step(h, w):
        return matmul_pallas.matmul(h, w["wq"]), type(w["wq"]) is weight_type
    x = jnp.ones((1, 64), jnp.float32)
    h, _ = jax.lax.scan(step, x, {"wq": qp["layers"]["wq"]})
    want = x
    for layer in range(2):
        want = matmul_reference.matmul(want, weight_type(qp["layers"]["wq"].values[layer], qp["layers"]["wq"].scales[layer]))
    np.testing.assert_allclose(np.asarray(h), np.asarray(want), rtol=1e-3, atol=1e-2)


@pytest.mark.parametrize("mode,weight_type", [("int8", QuantizedWeight), ("w8a8", W8A8Weight)])
def test_quantize_params_keep(mode, weight_type):
    """keep=(...) leaves the named weights as they are: the lm_head, or one layer weight in every layer."""
    params = _tiny_params(np.random.default_rng(7))
    qp = quantize_params(params, mode, keep=("lm_head",))
    assert qp["lm_head"] is params["lm_head"]
    assert all(type(qp["layers"][name]) is weight_type for name in LINEAR_WEIGHTS)
    assert quantize_params(params, mode, keep="lm_head")["lm_head"] is params["lm_head"]  # one name as a string
    qp = quantize_params(params, mode, keep=("w_down", "lm_head"))
    assert qp["layers"]["w_down"] is params["layers"]["w_down"] and qp["lm_head"] is params["lm_head"]
    assert all(type(qp["layers"][name]) is weight_type for name in LINEAR_WEIGHTS if name != "w_down")
    # the quantized tree with a bf16 lm_head runs the model's matmuls (lm_head: a plain dot)
    x = jnp.ones((2, 64), jnp.float32)
    np.testing.assert_allclose(np.asarray(matmul_pallas.matmul(x, qp["lm_head"])), np.asarray(x @ params["lm_head"]), rtol=1e-5)


def test_quantize_params_rejects_bad_input():
    params = _tiny_params(np.random.default_rng(6))
    with pytest.raises(ValueError, match="mode='fp4'"):
        quantize_params(params, "fp4")
    with pytest.raises(ValueError, match="already quantized"):
        quantize_params(quantize_params(params, "int8"), "w8a8")
    with pytest.raises(ValueError, match="'embed' not in"):
        quantize_params(params, "int8", keep=("embed",))


def test_matmul_routes_kmajor_w8a8_by_rows(monkeypatch):
    """Both GPU matmul choices send K-major W8A8 weights to the kernel from W8A8_PALLAS_MIN_ROWS (64)
    rows (leading dims flattened), to XLA below; everything else goes where it went before."""
    rng = np.random.default_rng(55)
    (w_t,) = transpose_to_kmajor([W8A8Weight(*quantize_int8(_weights(rng, 64, 32)))])
    calls = []
    real = matmul_pallas.w8a8_matmul
    monkeypatch.setattr(matmul_pallas, "w8a8_matmul", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    assert matmul_pallas.W8A8_PALLAS_MIN_ROWS == 64
    for fn in (matmul_pallas.matmul, matmul_pallas.matmul_gpu_default):
        calls.clear()
        small = jnp.asarray(rng.standard_normal((63, 64)), jnp.float32)
        big = jnp.asarray(rng.standard_normal((2, 32, 64)), jnp.float32)
        np.testing.assert_allclose(np.asarray(fn(small, w_t)), np.asarray(matmul_reference.matmul(small, w_t)), rtol=1e-6)
        got = fn(big, w_t)
        assert got.shape == (2, 32, 32) and calls == [(64, 64)]
        np.testing.assert_allclose(np.asarray(got), np.asarray(matmul_reference.matmul(big, w_t)), rtol=1e-6, atol=1e-6)
    q = quantize_int8(_weights(rng, 64, 32))  # W8A16 stays XLA's under "auto"
    np.testing.assert_array_equal(np.asarray(matmul_pallas.matmul_gpu_default(small, q)), np.asarray(matmul_reference.matmul(small, q)))


def test_transpose_to_kmajor_reaches_fused_and_stacked_weights():
    from jlight.models.layers import FusedWeight

    rng = np.random.default_rng(56)
    stacked = W8A8Weight(*quantize_int8(jnp.asarray(rng.standard_normal((3, 64, 32)), jnp.float32)))
    fused = FusedWeight(W8A8Weight(*quantize_int8(_weights(rng, 64, 48))), (16, 32))
    plain = quantize_int8(_weights(rng, 64, 16))  # weight-only int8: left as it is
    out = transpose_to_kmajor({"a": stacked, "b": fused, "c": plain, "d": jnp.ones(3)})
    assert type(out["a"]) is W8A8WeightT and out["a"].values_t.shape == (3, 32, 64)
    np.testing.assert_array_equal(np.asarray(out["a"].values_t), np.swapaxes(np.asarray(stacked.values), 1, 2))
    assert isinstance(out["b"], FusedWeight) and out["b"].widths == (16, 32) and out["b"].weight.values_t.shape == (48, 64)
    assert type(out["c"]) is QuantizedWeight and out["c"].values is plain.values
    # names: only weights under those keys (the engine leaves MoE experts, read as [in, out], alone)
    named = transpose_to_kmajor({"experts_gate": stacked, "layers": [{"wqkv": fused}]}, names=("wqkv",))
    assert type(named["experts_gate"]) is W8A8Weight and type(named["layers"][0]["wqkv"].weight) is W8A8WeightT
    # weight-only int8 too, when asked: the reference matmul reads it as it read the [in, out] one
    both = transpose_to_kmajor({"a": stacked, "c": plain}, kinds=(QuantizedWeight, W8A8Weight))
    assert type(both["c"]) is QuantizedWeightT and type(both["a"]) is W8A8WeightT
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.float32)
    np.testing.assert_allclose(np.asarray(matmul_reference.matmul(x, both["c"])), np.asarray(matmul_reference.matmul(x, plain)),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(matmul_pallas.matmul(x, both["c"])), np.asarray(matmul_reference.matmul(x, plain)),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_w8a16_gemv_row_block_without_padding(m):
    """The GEMV path's row block is the rows (next power of two): every row is right, nothing extra."""
    rng = np.random.default_rng(60 + m)
    w = quantize_int8(_weights(rng, 256, 64))
    x = jnp.asarray(rng.standard_normal((m, 256)), jnp.float32)
    for splits in (1, 2):
        got = np.asarray(matmul_pallas.w8a16_matmul(x, w, gemv=True, num_splits=splits, block_k=64))
        assert got.shape == (m, 64)
        np.testing.assert_allclose(got, np.asarray(x @ dequantize(w)), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("m,k,n,cfg", [
    (1, 256, 128, {}),  # batch-1 decode at the 1-token bucket, default tiles
    (1, 512, 64, dict(block_n=16, block_k=128, num_splits=1)),
    (2, 512, 96, dict(block_n=32, num_splits=2)),  # two rows, split-K sums in XLA
    (1, 8192, 64, {}),  # default tiles, narrow and long: split-K
    (1, 256, 8192, {}),  # default tiles, wide: one pass
])
def test_w8a16_kmajor_matches_dequantized_reference(m, k, n, cfg):
    """The K-major W8A16 GEMV computes every row asked for (one or two) and refuses more."""
    rng = np.random.default_rng(70 + m)
    w = quantize_int8(_weights(rng, k, n))
    (w_t,) = transpose_to_kmajor([w], kinds=(QuantizedWeight,))
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    got = matmul_pallas.w8a16_kmajor_matmul(x, w_t, **cfg)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    want = np.asarray(x.astype(jnp.float32) @ dequantize(w))
    assert np.isfinite(np.asarray(got, np.float32)).all()
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=3e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="at most 2 rows"):
        matmul_pallas.w8a16_kmajor_matmul(jnp.zeros((3, k), jnp.bfloat16), w_t, **cfg)


def test_matmul_routes_kmajor_w8a16_by_rows(monkeypatch):
    """matmul_impl="auto" on GPU sends K-major weight-only int8 to the Pallas GEMV for one-row 16-bit
    steps, and to XLA's dequantize-dot otherwise (more rows, or float32)."""
    rng = np.random.default_rng(57)
    w = quantize_int8(_weights(rng, 64, 32))
    (w_t,) = transpose_to_kmajor([w], kinds=(QuantizedWeight,))
    calls = []
    real = matmul_pallas.w8a16_kmajor_matmul
    monkeypatch.setattr(matmul_pallas, "w8a16_kmajor_matmul", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    one = jnp.asarray(rng.standard_normal((1, 1, 64)), jnp.bfloat16)
    eight = jnp.asarray(rng.standard_normal((2, 4, 64)), jnp.bfloat16)
    got = matmul_pallas.matmul_gpu_default(one, w_t)
    got_eight = matmul_pallas.matmul_gpu_default(eight, w_t)  # 8 rows stay XLA's
    matmul_pallas.matmul_gpu_default(one.astype(jnp.float32), w_t)
    assert calls == [(1, 64)] and got.shape == (1, 1, 32) and got_eight.shape == (2, 4, 32)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(matmul_reference.matmul(one, w, jnp.float32)),
                               atol=3e-2, rtol=2e-2)
