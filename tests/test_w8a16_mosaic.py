"""The Mosaic GPU W8A16 kernel (pallas_kernels/w8a16_mosaic.py) on the CPU.

Mosaic GPU's interpret mode runs the kernel's TMA copies, barriers, slots and unit bookkeeping
against the XLA reference on fresh random inputs (its buffers start as NaN, so an output tile or
split-K partial the kernel forgets to write fails); its race detector checks the copy protocol;
and the real wgmma path is lowered for CUDA at the H200 benchmark shapes.
"""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jlight.pallas_kernels import matmul_pallas, matmul_reference, w8a16_mosaic
from jlight.core.quantization import QuantizedWeightT


def _inputs(seed, m, k, n, dtype=jnp.bfloat16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    w = QuantizedWeightT(jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8),
                         jnp.asarray(rng.uniform(0.5, 2.0, n) / 100, jnp.float32))
    return x, w


def _rel_err(got, x, w):
    want = np.asarray(matmul_reference.matmul(x.astype(jnp.float32), w), np.float64)
    got = np.asarray(got.astype(jnp.float32), np.float64)
    assert np.isfinite(got).all(), "unwritten (NaN) or overflowed outputs"
    return np.linalg.norm(got - want) / np.linalg.norm(want)


# (rows, in, out, kernel options): one split (the kernel scales and writes the output), split-K over
# several programs, programs with several units each and fewer slots than steps, both activation modes.
CASES = [
    (8, 256, 128, {}),
    (8, 512, 192, dict(num_splits=2, tile_k=128, num_sms=2)),
    (16, 384, 256, dict(tile_k=128, num_stages=2, num_sms=3)),
    (8, 256, 128, dict(int8_activations=True)),
    (16, 512, 192, dict(int8_activations=True, num_splits=2, tile_k=128, num_sms=2)),
    (24, 384, 64, dict(int8_activations=True, tile_k=128, num_stages=3, num_sms=1)),
]


@pytest.mark.parametrize("case", CASES, ids=[f"{m}x{k}x{n}-{'-'.join(map(str, cfg.values())) or 'default'}"
                                             for m, k, n, cfg in CASES])
def test_matches_reference(case):
    m, k, n, cfg = case
    x, w = _inputs(m * 1000 + k + n + len(cfg), m, k, n)
    got = w8a16_mosaic.w8a16_mosaic_matmul(x, w, **cfg)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    assert _rel_err(got, x, w) < 4e-3  # bf16 output rounding: ~1.7e-3


def test_float16_and_out_dtype():
    x, w = _inputs(7, 8, 256, 64, jnp.float16)
    got = w8a16_mosaic.w8a16_mosaic_matmul(x, w, jnp.float32, int8_activations=True)
    assert got.dtype == jnp.float32
    assert _rel_err(got, x, w) < 1e-3  # float16 inputs, float32 output


def test_split_int8_keeps_16_bits_of_each_row():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    x[1, 7] = 300.0  # an outlier sets its row's scale
    x[2] = 0.0  # an all-zero row must not divide by zero
    x[3] *= 1e-6
    (q1, q2), scales = w8a16_mosaic.split_int8(jnp.asarray(x, jnp.bfloat16))
    assert q1.dtype == q2.dtype == jnp.int8 and q1.shape == q2.shape == x.shape and scales.shape == (8,)
    xb = np.asarray(jnp.asarray(x, jnp.bfloat16), np.float64)
    s = np.asarray(scales, np.float64)
    back = np.asarray(q1, np.float64) * s[:4, None] + np.asarray(q2, np.float64) * s[4:, None]
    bound = np.abs(xb).max(axis=1) / 64516 * 1.01
    assert (np.abs(back - xb).max(axis=1) <= bound).all()
    assert np.abs(back[2]).max() == 0


def test_no_races(monkeypatch):
    from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call, params

    monkeypatch.setattr(w8a16_mosaic, "interpret_params", lambda: params.InterpretGPUParams(detect_races=True))
    for cfg in (dict(tile_k=128, num_stages=2, num_sms=2), dict(int8_activations=True, tile_k=128, num_stages=2, num_sms=2)):
        x, w = _inputs(11, 8, 512, 128)
        jax.block_until_ready(w8a16_mosaic.w8a16_mosaic_matmul(x, w, num_splits=2, **cfg))
        assert not interpret_pallas_call.get_races().races_found, cfg


S = jax.ShapeDtypeStruct


@pytest.mark.parametrize("m,k,n,cfg", [
    (8, 4096, 28672, {}), (8, 14336, 4096, dict(int8_activations=True)), (32, 4096, 6144, dict(int8_activations=True)),
    (64, 4096, 4096, dict(ctas_per_sm=2)),
])
def test_cuda_lowering_at_h200_shapes(m, k, n, cfg):
    """The wgmma paths (register operand; int8 from shared memory) lower for CUDA, layouts included."""
    fn = lambda x, v, s: w8a16_mosaic.w8a16_mosaic_matmul(x, QuantizedWeightT(v, s), interpret=False, **cfg)
    text = jax.jit(fn).trace(S((m, k), jnp.bfloat16), S((n, k), jnp.int8), S((n,), jnp.float32)).lower(
        lowering_platforms=("cuda",)).as_text()
    assert "mosaic_gpu" in text


def test_pdl_option_waits_for_the_previous_kernel_only_on_the_gpu_path():
    """pdl=True puts griddepcontrol (programmatic dependent launch) into the CUDA kernel; interpreting, it is
    ignored and the result is the same as without it."""
    for pdl in (False, True):
        fn = lambda x, v, s: w8a16_mosaic.w8a16_mosaic_matmul(x, QuantizedWeightT(v, s), interpret=False,
                                                              int8_activations=True, pdl=pdl)
        text = jax.jit(fn).trace(S((8, 4096), jnp.bfloat16), S((6144, 4096), jnp.int8), S((6144,), jnp.float32)).lower(
            lowering_platforms=("cuda",)).as_text()
        assert ("griddepcontrol" in text) == pdl
    x, w = _inputs(12, 8, 256, 128)
    cfg = dict(int8_activations=True, tile_k=128, num_stages=2, num_sms=2)
    np.testing.assert_array_equal(np.asarray(w8a16_mosaic.w8a16_mosaic_matmul(x, w, pdl=True, **cfg), np.float32),
                                  np.asarray(w8a16_mosaic.w8a16_mosaic_matmul(x, w, **cfg), np.float32))


def test_supports_and_errors():
    x, w = _inputs(3, 8, 256, 128)
    assert w8a16_mosaic.supports(x, w)
    assert not w8a16_mosaic.supports(x.astype(jnp.float32), w)  # wgmma: 16-bit activations
    assert not w8a16_mosaic.supports(x[:7], w)  # rows: a multiple of 8
    assert not w8a16_mosaic.supports(jnp.zeros((72, 256), jnp.bfloat16), w)  # more than MAX_ROWS
    assert not w8a16_mosaic.supports(x, QuantizedWeightT(w.values_t[:96], w.scales[:96]))  # out: 64-channel tiles
    with pytest.raises(ValueError, match="w8a16_mosaic_matmul does not take x"):
        w8a16_mosaic.w8a16_mosaic_matmul(x[:7], w)
    with pytest.raises(ValueError, match="num_splits=3 must divide"):
        w8a16_mosaic.w8a16_mosaic_matmul(x, w, num_splits=3, tile_k=128)
    with pytest.raises(ValueError, match="tile_k=64 must be a multiple of 128"):
        w8a16_mosaic.w8a16_mosaic_matmul(x, w, tile_k=64)


def test_engine_routing_by_rows(monkeypatch):
    """matmul_impl="auto" on K-major int8 weights sends steps of MOSAIC_W8A16_MIN_ROWS to _MAX_ROWS rows
    to this kernel, others to XLA; off by default (MAX 0)."""
    calls = []
    kernel = w8a16_mosaic.w8a16_mosaic_matmul

    def spy(x, w, out_dtype=None, **kw):
        calls.append(x.shape)
        return kernel(x, w, out_dtype, **kw)

    monkeypatch.setattr(w8a16_mosaic, "w8a16_mosaic_matmul", spy)
    x, w = _inputs(5, 32, 256, 128)
    assert matmul_pallas.MOSAIC_W8A16_MAX_ROWS == 0
    matmul_pallas.matmul_gpu_default(x[:16], w)
    assert calls == []
    monkeypatch.setattr(matmul_pallas, "MOSAIC_W8A16_MAX_ROWS", 24)
    got = matmul_pallas.matmul_gpu_default(x[:16].reshape(2, 8, 256), w)  # leading dims are flattened
    assert calls == [(16, 256)] and got.shape == (2, 8, 128)
    assert _rel_err(got.reshape(16, 128), x[:16], w) < 4e-3
    for rows in (8, 32):  # below MIN (9) and above MAX: XLA's dequantize-dot
        matmul_pallas.matmul_gpu_default(x[:rows], w)
    assert calls == [(16, 256)]
