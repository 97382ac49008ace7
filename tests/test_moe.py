"""MoE families (Mixtral, Qwen3-MoE, Qwen2-MoE) against transformers, and the grouped expert FFN.

Tiny random-weight models (8 experts, top-2/3) built with transformers; jlight loads them through
its own loader and runs models/mixtral.py directly on a paged cache (tests/direct_forward.py),
then through the engine with batching, chunked prefill and prefix caching.
"""
from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from direct_forward import hf_greedy
from test_moe_common import check_against_transformers, check_unrolled_matches_scanned

from jlight.models.moe import dense_expert_ffn, grouped_expert_ffn
from jlight.core.quantization import quantize_int8

ARCHS = ["MixtralForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"]
PROMPT = [5, 17, 99, 3, 42, 8, 200, 13, 7, 64, 31, 150, 77]


@pytest.fixture(scope="module")
def models(tiny_moe_model):
    return {arch: tiny_moe_model(arch) for arch in ARCHS}  # built once per worker (conftest.py)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_and_greedy_match_transformers(models, arch):
    check_against_transformers(*models[arch], PROMPT)


@pytest.mark.parametrize("arch", ARCHS)
def test_unrolled_layers_match_scanned(models, arch):
    """layer_loop="unroll" (per-layer weights, the default) computes what the lax.scan does."""
    config, unstacked, _, _ = check_unrolled_matches_scanned(models[arch][0], PROMPT)
    assert isinstance(unstacked["layers"], list) and len(unstacked["layers"]) == config.num_layers


def test_engine_batched_chunked_prefix_cached_greedy_matches_transformers(models):
    """Two prompts sharing a 32-token prefix, prefilled in 16-token chunks next to each other's decode."""
    import jlight.api
    from jlight import SamplingParams

    path, hf_model = models["Qwen3MoeForCausalLM"]
    prefix = [int(t) for t in np.random.default_rng(0).integers(3, 250, 32)]
    prompts = [prefix + [11, 12, 13], prefix + [21, 22, 23, 24, 25]]
    llm = jlight.api.LLM(path, dtype="float32", max_num_batched_tokens=16, max_num_seqs=4, num_pages=32,
                         enable_prefix_caching=True, compilation_cache_dir=None, min_token_bucket=16)  # one compiled step
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompts[0]], params, use_tqdm=False)[0]
    second = llm.generate([prompts[1], prompts[0]], params, use_tqdm=False)
    assert first.outputs[0].token_ids == hf_greedy(hf_model, prompts[0], 32)
    assert second[0].outputs[0].token_ids == hf_greedy(hf_model, prompts[1], 32)
    assert second[1].outputs[0].token_ids == first.outputs[0].token_ids
    assert second[0].num_cached_tokens >= 16  # the shared prefix came from the prefix cache


def _random_experts(key, num_experts=6, embed=16, mlp=24):
    kg, ku, kd = jax.random.split(key, 3)
    return (jax.random.normal(kg, (num_experts, embed, mlp)) / 4, jax.random.normal(ku, (num_experts, embed, mlp)) / 4,
            jax.random.normal(kd, (num_experts, mlp, embed)) / 5)


def test_grouped_expert_ffn_matches_dense_all_experts():
    kx, kw, kr = jax.random.split(jax.random.PRNGKey(0), 3)
    x = jax.random.normal(kx, (37, 16))  # [T, embed]
    w_gate, w_up, w_down = _random_experts(kw)
    # Skewed routing: expert 5 never chosen, expert 0 chosen often; k=2 distinct experts per token.
    logits = jax.random.normal(kr, (37, 6)) + jnp.array([2.0, 0, 0, 0, 0, -50.0])
    weights, ids = jax.lax.top_k(jax.nn.softmax(logits), 2)
    grouped_fn = jax.jit(lambda *a: grouped_expert_ffn(*a, jax.nn.silu))
    dense_fn = jax.jit(lambda *a: dense_expert_ffn(*a, jax.nn.silu))
    grouped = np.asarray(grouped_fn(x, ids, weights, w_gate, w_up, w_down))
    dense = np.asarray(dense_fn(x, ids, weights, w_gate, w_up, w_down))
    np.testing.assert_allclose(grouped, dense, rtol=1e-5, atol=1e-5)
    # A token's output is its own experts' weighted sum: check one row by hand (numpy).
    t, xn, wn = 3, np.asarray(x), [np.asarray(w) for w in (w_gate, w_up, w_down, weights, ids)]
    silu = lambda v: v / (1 + np.exp(-v))
    by_hand = sum(wn[3][t, j] * ((silu(xn[t] @ wn[0][wn[4][t, j]]) * (xn[t] @ wn[1][wn[4][t, j]])) @ wn[2][wn[4][t, j]])
                  for j in range(2))
    np.testing.assert_allclose(grouped[t], by_hand, rtol=1e-4, atol=1e-5)
    # int8 expert weights: scales are applied per expert row.
    q = [quantize_int8(w) for w in (w_gate, w_up, w_down)]
    grouped_q = grouped_fn(x, ids, weights, *q)
    dense_q = dense_fn(x, ids, weights, *q)
    np.testing.assert_allclose(np.asarray(grouped_q), np.asarray(dense_q), rtol=1e-4, atol=1e-4)


def test_gathered_experts_path_matches_dense_for_few_tokens():
    """Decode-sized batches take the gathered-weights path (3*T*k <= experts); same answers."""
    from jlight.models.moe import gathered_expert_ffn

    from jlight.models.moe import expert_ffn, resolve_expert_impl

    kx, kw, kr = jax.random.split(jax.random.PRNGKey(1), 3)
    w_gate, w_up, w_down = _random_experts(kw)  # 6 experts
    x = jax.random.normal(kx, (1, 16))  # one token, k=2: 3 * 1 * 2 <= 6, so expert_ffn "auto" gathers (CPU)
    weights, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(kr, (1, 6))), 2)
    assert resolve_expert_impl("auto", ids.size, w_gate, w_down) == "gathered"
    dense = np.asarray(dense_expert_ffn(x, ids, weights, w_gate, w_up, w_down, jax.nn.silu))
    for fn in (gathered_expert_ffn, grouped_expert_ffn, expert_ffn):
        got = np.asarray(jax.jit(lambda *a, f=fn: f(*a, jax.nn.silu))(x, ids, weights, w_gate, w_up, w_down))
        np.testing.assert_allclose(got, dense, rtol=1e-5, atol=1e-5)
    q = [quantize_int8(w) for w in (w_gate, w_up, w_down)]
    np.testing.assert_allclose(np.asarray(gathered_expert_ffn(x, ids, weights, *q, jax.nn.silu)),
                               np.asarray(dense_expert_ffn(x, ids, weights, *q, jax.nn.silu)), rtol=1e-4, atol=1e-4)


def test_gathered_path_chunks_large_gathers():
    """Gathers past max_gather_elements (MAX_GATHER_ELEMENTS: int32 indexing on the GPU) run in row
    chunks; same answers."""
    from jlight.models import moe

    kx, kw, kr = jax.random.split(jax.random.PRNGKey(2), 3)
    w_gate, w_up, w_down = _random_experts(kw)  # 6 experts, [6, 16, mlp] / [6, mlp, 16]
    x = jax.random.normal(kx, (5, 16))
    weights, ids = jax.lax.top_k(jax.nn.softmax(jax.random.normal(kr, (5, 6))), 2)
    whole = np.asarray(moe.gathered_expert_ffn(x, ids, weights, w_gate, w_up, w_down, jax.nn.silu))
    chunked = np.asarray(moe.gathered_expert_ffn(x, ids, weights, w_gate, w_up, w_down, jax.nn.silu,
                                                 max_gather_elements=3 * w_gate.shape[1] * w_gate.shape[2]))  # 3 rows a chunk
    np.testing.assert_allclose(chunked, whole, rtol=1e-6, atol=1e-6)
    dense = np.asarray(dense_expert_ffn(x, ids, weights, w_gate, w_up, w_down, jax.nn.silu))
    np.testing.assert_allclose(chunked, dense, rtol=1e-5, atol=1e-5)


def test_too_many_experts_per_token_is_a_value_error():
    from jlight.core.config import ModelConfig
    from jlight.models import mixtral

    cfg = ModelConfig.from_hf_dict(dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", vocab_size=32, hidden_size=16, intermediate_size=16,
        num_hidden_layers=1, num_attention_heads=2, num_local_experts=4, num_experts_per_tok=5))
    with pytest.raises(ValueError, match="num_experts_per_tok=5"):
        mixtral.param_shapes(cfg)


@pytest.mark.parametrize("moe_impl", ["dense", "pallas"])
def test_engine_moe_impl_option_keeps_greedy_tokens(models, moe_impl):
    """EngineConfig.moe_impl reaches the MoE layers: forcing the all-experts baseline or the Pallas
    grouped matmul (interpret mode here) gives transformers' greedy tokens."""
    import jlight.api
    from jlight import SamplingParams

    path, hf_model = models["Qwen3MoeForCausalLM"]
    prompt = [int(t) for t in np.random.default_rng(5).integers(3, 250, 12)]
    llm = jlight.api.LLM(path, dtype="float32", max_num_batched_tokens=16, max_num_seqs=2, num_pages=16,
                         moe_impl=moe_impl, compilation_cache_dir=None, min_token_bucket=16)  # one compiled step
    assert llm.engine.config.moe_impl == moe_impl
    out = llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 8)


@pytest.mark.parametrize("impl", ["dense", "gathered", "ragged_dot", "pallas"])
@pytest.mark.parametrize("quantized", [False, True])
def test_no_local_expert_id_contributes_nothing(impl, quantized):
    """Expert parallelism marks pairs routed to other devices' experts with id == num_experts and
    weight 0: every implementation must give exactly what it gives without those pairs."""
    from jlight.models.moe import expert_ffn
    from jlight.core.quantization import quantize_int8
    from jlight.pallas_kernels.dispatch import get_kernels

    rng = np.random.default_rng(31)
    num_tokens, embed, k, num_experts = 9, 16, 2, 6
    ws = _random_experts(jax.random.key(3), num_experts=num_experts, embed=embed, mlp=32)  # Pallas: multiples of 16
    if quantized:
        ws = tuple(quantize_int8(w) for w in ws)
    x = jnp.asarray(rng.standard_normal((num_tokens, embed)), jnp.float32)
    ids = jnp.asarray(rng.integers(0, num_experts, (num_tokens, k)), jnp.int32)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (num_tokens, k)), jnp.float32)
    remote = jnp.asarray(rng.uniform(size=(num_tokens, k)) < 0.5)
    # jitted, as the model runs them (one compile each, not one per operation of an eager call)
    ffn = jax.jit(expert_ffn, static_argnums=(6, 7, 8))
    grouped = get_kernels(moe_impl="pallas").grouped_matmul  # the Pallas kernel, as Kernels carry it
    marked = ffn(x, jnp.where(remote, num_experts, ids), jnp.where(remote, 0.0, weights), *ws, jax.nn.silu, impl, grouped)
    # The same local pairs, the remote ones replaced by a real expert with weight 0.
    zeroed = ffn(x, jnp.where(remote, 0, ids), jnp.where(remote, 0.0, weights), *ws, jax.nn.silu, "dense", None)
    assert np.all(np.isfinite(np.asarray(marked)))
    np.testing.assert_allclose(np.asarray(marked), np.asarray(zeroed), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 5])
def test_mxfp4_experts_compute_what_their_expanded_weights_do(tokens):
    """Experts kept as MXFP4 (Mxfp4Weight) with gpt-oss's per-expert biases (BiasedExperts) give every expert path
    (dense, gathered, in chunks too, ragged_dot, the Pallas kernel expanding them in registers) the answer numpy
    computes from the file's values, expert by expert."""
    from jlight.loading.mxfp4 import Mxfp4HostWeight
    from jlight.models import moe
    from jlight.pallas_kernels.dispatch import get_kernels

    rng = np.random.default_rng(tokens)
    experts, embed, mlp, k = 6, 64, 32, 2

    def kept(d_in, d_out):
        host = Mxfp4HostWeight(rng.integers(0, 256, (experts, d_out, d_in // 32, 16)).astype(np.uint8),
                               rng.integers(118, 124, (experts, d_out, d_in // 32)).astype(np.uint8))
        bias = rng.normal(size=(experts, d_out)).astype(np.float32)
        return moe.BiasedExperts(host.to_device(), jnp.asarray(bias)), host.dequantize(), bias

    (w, values, biases) = zip(kept(embed, mlp), kept(embed, mlp), kept(mlp, embed))
    x = jnp.asarray(rng.normal(size=(tokens, embed)), jnp.float32)
    weights, ids = jax.lax.top_k(jax.nn.softmax(jnp.asarray(rng.normal(size=(tokens, experts)))), k)
    (vg, vu, vd), (bg, bu, bd), xs = values, biases, np.asarray(x, np.float64)
    silu = lambda a: a / (1 + np.exp(-a))
    want = np.zeros((tokens, embed))
    for t in range(tokens):
        for e, p in zip(np.asarray(ids[t]), np.asarray(weights[t])):
            hidden = silu(xs[t] @ vg[e] + bg[e]) * (xs[t] @ vu[e] + bu[e])
            want[t] += p * (hidden @ vd[e] + bd[e])
    runs = {"dense": lambda *a: dense_expert_ffn(*a, jax.nn.silu),
            "gathered": lambda *a: moe.gathered_expert_ffn(*a, jax.nn.silu),
            "gathered in chunks": lambda *a: moe.gathered_expert_ffn(*a, jax.nn.silu, max_gather_elements=2 * embed * mlp),
            "ragged_dot": lambda *a: grouped_expert_ffn(*a, jax.nn.silu),
            "pallas": lambda *a: grouped_expert_ffn(*a, jax.nn.silu,
                                                    grouped_matmul=get_kernels(moe_impl="pallas").grouped_matmul.matmul)}
    for name, fn in runs.items():
        got = np.asarray(jax.jit(fn)(x, ids, weights, *w))
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-4, err_msg=name)
    assert moe.resolve_expert_impl("auto", ids.size, w[0], w[2]) == ("gathered" if tokens == 1 else "ragged_dot")
    kernel = types.SimpleNamespace(fits=lambda k, n: True, matmul=None)  # a GPU's: it reads only experts with rows
    assert moe.resolve_expert_impl("auto", ids.size, w[0], w[2], kernel) == "pallas"


def test_a_step_buckets_padding_rows_take_no_expert():
    """The rows past a step's real tokens (its bucket's padding) route to no expert through ParallelOps.expert_ffn:
    the grouped matmul's groups hold the real tokens' pairs alone, so a padded decode step reads only their experts'
    weights, and the real rows' outputs are those of the unpadded call."""
    from jlight.core.parallel_ops import ParallelOps
    from jlight.models import moe
    from jlight.pallas_kernels.dispatch import GroupedMatmul

    rng = np.random.default_rng(11)
    experts, embed, mlp, k, rows, real = 8, 32, 16, 2, 8, 3
    w = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((experts, embed, mlp), (experts, embed, mlp), (experts, mlp, embed))]
    x = jnp.asarray(rng.normal(size=(rows, embed)), jnp.float32)
    weights, ids = jax.lax.top_k(jax.nn.softmax(jnp.asarray(rng.normal(size=(rows, experts)))), k)
    seen = []

    def spy(rows_, values, group_sizes, preferred_element_type=None):
        seen.append(np.asarray(group_sizes))
        return jax.lax.ragged_dot(rows_, values, group_sizes, preferred_element_type=preferred_element_type)

    local_ffn = functools.partial(moe.expert_ffn, act=jax.nn.silu, impl="pallas", grouped=GroupedMatmul(spy, lambda *_: True))
    got = ParallelOps().expert_ffn(local_ffn, x, ids, weights, *w, num_tokens=jnp.int32(real))
    assert len(seen) == 3 and all(s.sum() == real * k for s in seen)
    assert set(np.flatnonzero(seen[0])) == set(np.asarray(ids[:real]).ravel())  # the real tokens' experts alone
    want = ParallelOps().expert_ffn(local_ffn, x[:real], ids[:real], weights[:real], *w)
    np.testing.assert_allclose(np.asarray(got[:real]), np.asarray(want), rtol=1e-5, atol=1e-5)
