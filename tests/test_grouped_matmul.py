"""The Pallas grouped matmul (pallas_kernels/grouped_matmul_pallas.py, interpret mode on CPU)
against jax.lax.ragged_dot, its tile table, its CUDA lowering, and its use for MoE experts.

Rows past sum(group_sizes) must come out as zeros. In interpret mode Pallas fills output
buffers with NaN before the kernel runs, so a row that no program stores stays NaN: the
exact-zero assertions below do catch a missing store.
"""
import numpy as np
import jax
import jax.numpy as jnp
import pytest

from jlight.pallas_kernels.grouped_matmul_pallas import grouped_matmul, grouped_matmul_reference, tile_table


@pytest.fixture(autouse=True)
def float32_products():
    """The XLA references in true float32, as the kernel's float32 products and a float32 model's steps
    (model_runner.matmul_precision): XLA:GPU's default is TF32. No effect on the CPU."""
    with jax.default_matmul_precision("highest"):
        yield

# (group sizes, rows M, block_m): zeros, one group holding everything, sizes that are not
# multiples of block_m, padding rows past sum(group_sizes), M not a multiple of block_m.
CASES = [
    ([5, 0, 40, 3, 0, 20], 80, 16),  # empty groups; 12 padding rows
    ([0, 0, 77, 0], 77, 16),  # one group holds every row; M = 77 not a multiple of 16
    ([17, 33, 1, 15], 70, 32),  # every group boundary inside a tile; 4 padding rows
    ([0, 0, 0], 24, 16),  # no rows at all: the output is all zeros
    ([1, 1, 1, 1, 1, 1, 1, 1], 8, 16),  # decode-like: one row per group, all in one block
]


def _inputs(rng, sizes, m, k, n, dtype, w_dtype=None):
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    if w_dtype == jnp.int8:
        w = jnp.asarray(rng.integers(-127, 128, (len(sizes), k, n)), jnp.int8)
    else:
        w = jnp.asarray(rng.standard_normal((len(sizes), k, n)) / np.sqrt(k), dtype)
    return x, w, jnp.asarray(sizes, jnp.int32)


def _check(got, x, w, group_sizes, tol):
    got = np.asarray(got, np.float32)
    total = int(np.sum(np.asarray(group_sizes)))
    want = np.asarray(grouped_matmul_reference(x, w.astype(x.dtype), group_sizes, preferred_element_type=jnp.float32))
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got[:total], want[:total], rtol=tol, atol=tol)
    assert (got[total:] == 0).all(), "rows past sum(group_sizes) must be exactly zero"


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("sizes,m,block_m", CASES)
def test_matches_ragged_dot(sizes, m, block_m, dtype):
    rng = np.random.default_rng([m, block_m, len(sizes)])
    x, w, gs = _inputs(rng, sizes, m, 64, 96, dtype)
    got = grouped_matmul(x, w, gs, preferred_element_type=jnp.float32, block_m=block_m, block_n=32, block_k=32)
    assert got.shape == (m, 96) and got.dtype == jnp.float32
    _check(got, x, w, gs, 1e-5 if dtype == jnp.float32 else 1e-4)


def test_default_tiles_follow_the_rows():
    """Decode (few rows): 16-row tiles with 128-deep K steps; prefill: larger tiles, 64-deep steps."""
    from jlight.pallas_kernels.grouped_matmul_pallas import default_tiles

    one_token = default_tiles(2, 4096, 14336, 8)  # Mixtral, batch 1: top-2 rows
    assert (one_token["block_m"], one_token["block_k"]) == (16, 128)
    batch64 = default_tiles(128, 4096, 14336, 8)
    assert (batch64["block_m"], batch64["block_k"]) == (16, 64)
    prefill = default_tiles(4096, 4096, 14336, 8)
    assert (prefill["block_m"], prefill["block_n"], prefill["block_k"]) == (128, 128, 64)


def test_output_in_input_dtype_and_default_tiles():
    """No preferred_element_type: bf16 out; default tile sizes; M below one block."""
    rng = np.random.default_rng(7)
    x, w, gs = _inputs(rng, [3, 0, 4], 9, 128, 64, jnp.bfloat16)
    got = grouped_matmul(x, w, gs)
    assert got.dtype == jnp.bfloat16
    _check(got, x, w, gs, 2e-2)


def test_int8_weights_are_converted_in_kernel():
    rng = np.random.default_rng(8)
    x, w, gs = _inputs(rng, [10, 0, 25, 5], 48, 64, 64, jnp.float32, w_dtype=jnp.int8)
    got = grouped_matmul(x, w, gs, block_m=16, block_n=32, block_k=32)
    _check(got, x, w, gs, 1e-4)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("block_m", [16, 64])
def test_tile_table_covers_every_row_once_within_one_group(seed, block_m):
    rng = np.random.default_rng(seed)
    num_groups = int(rng.integers(1, 40))
    sizes = rng.integers(0, 3 * block_m, num_groups) * (rng.random(num_groups) < 0.7)  # ~30% empty
    m = int(sizes.sum() + rng.integers(0, 2 * block_m))
    # jitted as in the kernel's caller (one compile, not one per operation of an eager call)
    table = jax.jit(tile_table, static_argnums=(1, 2))(jnp.asarray(sizes, jnp.int32), m, block_m)
    group, start, end = (np.asarray(a) for a in table)
    assert len(group) == -(-m // block_m) + num_groups
    bounds = np.concatenate([[0], np.cumsum(sizes), [m]])  # group g owns [bounds[g], bounds[g+1]); g = G: zero tail
    covered = np.zeros(m, int)
    for g, s, e in zip(group, start, end):
        if s == e:
            continue
        assert bounds[g] <= s < e <= bounds[g + 1]  # inside its group
        assert s // block_m == (e - 1) // block_m  # inside one block
        covered[s:e] += 1
    assert (covered == 1).all()


# Lowering for CUDA (and verifying the Triton module) at the H200 shapes: tests/test_triton_modules.py.


def test_expert_ffn_pallas_matches_dense():
    """models/moe.expert_ffn with impl="pallas" (sorted rows through the kernel) against every
    expert on every token, float and int8 expert weights."""
    from jlight.models.moe import expert_ffn
    from jlight.core.quantization import quantize_int8
    from jlight.pallas_kernels.dispatch import get_kernels

    rng = np.random.default_rng(11)
    num_tokens, embed, mlp, num_experts, k = 21, 32, 48, 6, 2
    x = jnp.asarray(rng.standard_normal((num_tokens, embed)), jnp.float32)
    ws = [jnp.asarray(rng.standard_normal(s) / 4, jnp.float32)
          for s in ((num_experts, embed, mlp), (num_experts, embed, mlp), (num_experts, mlp, embed))]
    logits = jnp.asarray(rng.standard_normal((num_tokens, num_experts)), jnp.float32) + jnp.array([3.0, 0, 0, 0, 0, -50.0])
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits), k)  # expert 0 popular, expert 5 never chosen
    grouped = get_kernels(moe_impl="pallas").grouped_matmul  # the Pallas kernel, as Kernels carry it
    run = jax.jit(lambda impl, *a: expert_ffn(*a, jax.nn.silu, impl, grouped), static_argnums=0)
    for w in (ws, [quantize_int8(w) for w in ws]):
        dense = np.asarray(run("dense", x, ids, weights, *w))
        np.testing.assert_allclose(np.asarray(run("pallas", x, ids, weights, *w)), dense, rtol=1e-4, atol=1e-4)


def test_mixtral_forward_with_each_expert_impl():
    """A tiny random Mixtral-shaped model: the step's hidden states are the same whichever way
    the experts run (Kernels.moe_impl reaches the MoE layer), unrolled and scanned."""
    from jlight.core.config import ModelConfig
    from jlight.models import mixtral
    from jlight.core.batch_metadata import BatchMetadata
    from jlight.core.parallel_ops import ParallelOps
    from jlight.pallas_kernels.dispatch import get_kernels

    config = ModelConfig.from_hf_dict(dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=64, hidden_size=32,
        intermediate_size=48, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64))
    params = mixtral.init_params(config, jax.random.PRNGKey(0), jnp.float32)
    num_tokens, page_size = 12, 16
    k_shape, v_shape = mixtral.kv_cache_shapes(config, 2, page_size)
    md = BatchMetadata(positions=jnp.arange(num_tokens, dtype=jnp.int32), slot_mapping=page_size + jnp.arange(num_tokens, dtype=jnp.int32),
                       token_seq=jnp.zeros(num_tokens, jnp.int32), page_table=jnp.array([[1]], jnp.int32),
                       context_lens=jnp.array([num_tokens], jnp.int32), query_start=jnp.array([0, num_tokens], jnp.int32),
                       logits_indices=jnp.array([num_tokens - 1], jnp.int32))
    tokens = jnp.asarray(np.random.default_rng(3).integers(0, 64, num_tokens), jnp.int32)

    def hidden(params, impl):
        kernels = get_kernels("reference", "reference", moe_impl=impl)
        fn = jax.jit(lambda p: mixtral.forward(p, config, tokens, jnp.zeros(k_shape), jnp.zeros(v_shape), md, kernels, ParallelOps())[0])
        return np.asarray(fn(params))

    dense = hidden(params, "dense")
    for impl in ("ragged_dot", "pallas", "gathered"):
        np.testing.assert_allclose(hidden(params, impl), dense, rtol=1e-4, atol=1e-4, err_msg=impl)
    np.testing.assert_allclose(hidden(mixtral.unstack_layers(params), "pallas"), dense, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-4), (jnp.bfloat16, 3e-2)])
@pytest.mark.parametrize("sizes,m,block_m", CASES[:3] + CASES[4:])
@pytest.mark.parametrize("block_k", [32, 64, None])
def test_mxfp4_weights_are_expanded_in_kernel(sizes, m, block_m, dtype, tol, block_k):
    """MXFP4 weights (Mxfp4Weight, as an MXFP4 checkpoint stores them) multiplied in the kernel, their nibbles and
    exponents expanded in registers: each row against numpy's product with its group's weights as the host expands
    them (loading/mxfp4.py, checked against transformers' conversion in tests/test_gpt_oss.py); rows past
    sum(group_sizes) exactly zero. Steps of one and of two 32-row blocks, and the default."""
    from jlight.loading.mxfp4 import Mxfp4HostWeight

    rng = np.random.default_rng(sum(sizes) + m)
    k, n = 128, 64
    host = Mxfp4HostWeight(rng.integers(0, 256, (len(sizes), n, k // 32, 16)).astype(np.uint8),
                           rng.integers(118, 128, (len(sizes), n, k // 32)).astype(np.uint8))
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    got = np.asarray(grouped_matmul(x, host.to_device(), gs, block_m=block_m, block_k=block_k,
                                    preferred_element_type=jnp.float32))
    values, xs = host.dequantize(), np.asarray(x, np.float64)
    group = np.repeat(np.arange(len(sizes)), sizes)
    want = np.stack([xs[r] @ values[g] for r, g in enumerate(group)]) if len(group) else np.zeros((0, n))
    total = len(group)
    assert not np.isnan(got).any()
    np.testing.assert_allclose(got[:total], want, rtol=tol, atol=tol * np.abs(want).max(initial=1.0))
    assert (got[total:] == 0).all(), "rows past sum(group_sizes) must be exactly zero"
