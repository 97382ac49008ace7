"""Several W8A16 matmuls as the phases of one Mosaic GPU kernel (pallas_kernels/w8a16_mosaic_phases.py):
on CPU in Mosaic GPU's interpreter (TMA copies, slot barriers, the cross-phase pipeline) against the
one-matmul kernel and the float32 reference, and lowered for CUDA (wgmma, the grid barrier)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlight.pallas_kernels import matmul_reference
from jlight.core.quantization import QuantizedWeightT
from jlight.pallas_kernels.w8a16_mosaic import w8a16_mosaic_matmul
from jlight.pallas_kernels.w8a16_mosaic_phases import w8a16_mosaic_phases


def _weight(rng, n, k):
    return QuantizedWeightT(jnp.asarray(rng.integers(-127, 128, (n, k)), jnp.int8),
                            jnp.asarray(rng.uniform(1e-3, 2e-3, n), jnp.float32))


@pytest.mark.parametrize("num_stages,num_sms,split_factor", [(2, 3, 1), (3, 5, 2)])
def test_phases_match_one_kernel_per_matmul_and_the_reference(num_stages, num_sms, split_factor):
    rng = np.random.default_rng(num_stages * 10 + num_sms)
    x1 = jnp.asarray(rng.standard_normal((8, 256)), jnp.bfloat16)
    x2 = jnp.asarray(rng.standard_normal((8, 512)), jnp.bfloat16)
    # (out, in): several units a program; one unit in all (most programs idle in that phase); split-K
    weights = [_weight(rng, n, k) for n, k in [(192, 256), (64, 128), (64, 512), (128, 256)]]
    x3 = jnp.asarray(rng.standard_normal((8, 128)), jnp.bfloat16)
    xs = [x1, x3, x2, x1]  # x1 twice: split into int8 terms once
    kw = dict(interpret=True, tile_k=128, num_stages=num_stages, num_sms=num_sms)
    got = jax.jit(lambda xs, ws: w8a16_mosaic_phases(xs, ws, split_factor=split_factor, **kw))(xs, weights)
    for x, w, y in zip(xs, weights, got):
        assert y.shape == (8, w.values_t.shape[0]) and y.dtype == jnp.bfloat16
        # the same tiles as the one-matmul kernel, and its int32 sums, which float32 holds exactly at these
        # sizes (< 2**24) however many split-K partials they come in: the same bits
        one = w8a16_mosaic_matmul(x, w, int8_activations=True, **kw)
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(one, np.float32))
        want = np.asarray(matmul_reference.matmul(x.astype(jnp.float32), w))
        np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_bad_inputs_name_what_is_wrong():
    rng = np.random.default_rng(0)
    w = _weight(rng, 64, 256)
    with pytest.raises(ValueError, match="one x per weight"):
        w8a16_mosaic_phases([jnp.zeros((8, 256), jnp.bfloat16)] * 2, [w], interpret=True)
    with pytest.raises(ValueError, match="every x needs 8 rows"):
        w8a16_mosaic_phases([jnp.zeros((8, 256), jnp.bfloat16), jnp.zeros((16, 256), jnp.bfloat16)], [w, w],
                            interpret=True)


def test_lowers_for_cuda_at_the_llama3_8b_decode_shapes():
    S = jax.ShapeDtypeStruct
    shapes = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]  # K x N of one layer
    ws = [QuantizedWeightT(S((n, k), jnp.int8), S((n,), jnp.float32)) for k, n in shapes]
    layer = lambda x4, x14, ws: w8a16_mosaic_phases([x4, x4, x4, x14], ws, interpret=False)
    text = jax.jit(layer).trace(S((8, 4096), jnp.bfloat16), S((8, 14336), jnp.bfloat16), ws).lower(
        lowering_platforms=("cuda",)).as_text()
    assert text.count("custom_call") >= 1 and "mosaic_gpu" in text
