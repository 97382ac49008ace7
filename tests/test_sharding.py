"""Tensor / data parallelism on 8 simulated CPU devices against the unsharded model.

XLA_FLAGS=--xla_force_host_platform_device_count=8 must be set before JAX starts, so the
checks run once in a subprocess (this file run as a script), which writes its measurements
to JSON; the tests below assert on them. Tiny float32 Llama (init_params), vocab 250 so
the vocab-padding path runs for every tp > 1, 2 KV heads so tp=4/8 replicate KV heads.
EXTENDED_RUNS (combinations of what RUNS covers) run in a second subprocess with `-m extended`.
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys

import numpy as np
import pytest
from simulated_devices import simulated_env

NUM_DEVICES = 8
PAGE_SIZE = 4
NUM_PAGES = 32
DECODE_STEPS = 4
# (label, mesh spec, collective matmul, int8 all-reduce)
RUNS = [
    ("tp=1", "tp=1", True, False),
    ("tp=2 cm", "tp=2", True, False),
    ("tp=4", "tp=4", False, False),
    ("tp=8 cm", "tp=8", True, False),
    ("dp=4,tp=2 cm", "dp=4,tp=2", True, False),
    ("tp=4 int8", "tp=4", False, True),
    # Mixtral-style MoE (4 experts, top-2): experts split on ep, their mlp dim on tp.
    ("moe ep=2,tp=2 cm", "ep=2,tp=2", True, False),
    ("moe tp=4 cm", "tp=4", True, False),
]
# Combinations of what RUNS already covers, run by a second worker with -m extended: tp=2 without collective
# matmul (tp=2 with it and tp=4 without it run by default), dp=2 over tp=4 (data parallel: dp=4,tp=2 cm; KV
# heads replicated to 4: tp=4), experts on ep=4 with tp=2 (ep: moe ep=2,tp=2 cm; ep=4: test_engine_sharded).
EXTENDED_RUNS = [
    ("tp=2", "tp=2", False, False),
    ("dp=2,tp=4", "dp=2,tp=4", False, False),
    ("moe ep=4,tp=2", "ep=4,tp=2", False, False),
]


# ---------------------------------------------------------------- worker (subprocess) ---

def _tiny_config():
    from jlight.core.config import ModelConfig

    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=250, hidden_size=64, intermediate_size=128,
        num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, max_position_embeddings=256,
        rms_norm_eps=1e-5,
    )


def _tiny_moe():
    """Tiny Mixtral (4 experts, top-2) and random params for every weight of its tree."""
    import jax
    import jax.numpy as jnp

    from jlight.core.config import ModelConfig
    from jlight.models import mixtral

    config = ModelConfig(
        architecture="MixtralForCausalLM", vocab_size=250, hidden_size=64, intermediate_size=64,
        num_layers=2, num_heads=8, num_kv_heads=2, head_dim=8, max_position_embeddings=256, rms_norm_eps=1e-5,
        extra={"model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 2},
    )
    shapes = mixtral.param_shapes(config)
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda x: isinstance(x, tuple))
    keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
    params = [jax.random.normal(k, shape, jnp.float32) / np.sqrt(shape[-2] if len(shape) > 1 else 1) + (len(shape) == 1)
              for k, shape in zip(keys, leaves)]
    return mixtral, config, jax.tree.unflatten(treedef, params)


def _batch(prompt_lens, pad_to, first_page):
    """BatchMetadata for a prefill of fresh sequences, pages allocated consecutively."""
    import jax.numpy as jnp

    from jlight.core.batch_metadata import BatchMetadata

    max_pages = NUM_PAGES // 2
    positions, slots, seqs = [], [], []
    page_table = np.zeros((len(prompt_lens), max_pages), np.int32)  # [B, max_pages]; page 0 = scratch
    page = first_page
    for b, n in enumerate(prompt_lens):
        pages = -(-(n + DECODE_STEPS) // PAGE_SIZE)
        page_table[b, :pages] = np.arange(page, page + pages)
        page += pages
        for p in range(n):
            positions.append(p)
            slots.append(page_table[b, p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE)
            seqs.append(b)
    pad = pad_to - len(positions)
    positions += [0] * pad
    slots += [0] * pad  # padding tokens write to the scratch page
    seqs += [0] * pad
    starts = np.concatenate([[0], np.cumsum(prompt_lens)]).astype(np.int32)
    return BatchMetadata(
        positions=jnp.asarray(positions, jnp.int32), slot_mapping=jnp.asarray(slots, jnp.int32),
        token_seq=jnp.asarray(seqs, jnp.int32), page_table=jnp.asarray(page_table),
        context_lens=jnp.asarray(prompt_lens, jnp.int32), query_start=jnp.asarray(starts),
        logits_indices=jnp.asarray(starts[1:] - 1),
    )


def _decode_batch(md, lens):
    """One decode token per sequence at position lens[b] (the sequences' next slot)."""
    import jax.numpy as jnp

    pt = np.asarray(md.page_table)
    lens = np.asarray(lens)
    slots = pt[np.arange(len(lens)), lens // PAGE_SIZE] * PAGE_SIZE + lens % PAGE_SIZE
    return md._replace(
        positions=jnp.asarray(lens, jnp.int32), slot_mapping=jnp.asarray(slots, jnp.int32),
        token_seq=jnp.arange(len(lens), dtype=jnp.int32), context_lens=jnp.asarray(lens + 1, jnp.int32),
        query_start=jnp.arange(len(lens) + 1, dtype=jnp.int32), logits_indices=jnp.arange(len(lens), dtype=jnp.int32),
    )


def _model_fn(config, kernels, family=None):
    from jlight.models import llama

    family = family or llama

    def model_fn(params, k_cache, v_cache, tokens, md, ops):
        hidden, k_cache, v_cache = family.forward(params, config, tokens, k_cache, v_cache, md, kernels, ops)
        logits = family.compute_logits(params, config, hidden[md.logits_indices], kernels, ops)
        return logits, k_cache, v_cache

    return model_fn


def _generate(step, params, config, prompts, stack):
    """Prefill + DECODE_STEPS greedy steps. `stack` maps per-replica inputs to the fn's
    inputs (identity, or a leading dp axis). Returns (prefill logits list, tokens list)."""
    import jax.numpy as jnp

    from jlight.models import llama

    replicas = len(prompts)
    k_shape, v_shape = llama.kv_cache_shapes(config, NUM_PAGES, PAGE_SIZE)
    k = stack([jnp.zeros(k_shape, jnp.float32)] * replicas)
    v = stack([jnp.zeros(v_shape, jnp.float32)] * replicas)
    mds, toks, lens = [], [], []
    for rep in prompts:
        lens.append(np.array([len(p) for p in rep]))
        mds.append(_batch(lens[-1], 32, first_page=1))
        flat = np.concatenate(rep)
        toks.append(jnp.asarray(np.pad(flat, (0, 32 - len(flat))), jnp.int32))
    logits, k, v = step(params, k, v, stack(toks), stack(mds))
    logits = np.asarray(logits).reshape(replicas, -1, config.vocab_size)
    first = [l.copy() for l in logits]
    generated = [[l.argmax(-1)] for l in logits]
    for _ in range(DECODE_STEPS):
        mds = [_decode_batch(mds[r], lens[r]) for r in range(replicas)]
        toks = [jnp.asarray(generated[r][-1], jnp.int32) for r in range(replicas)]
        logits, k, v = step(params, k, v, stack(toks), stack(mds))
        logits = np.asarray(logits).reshape(replicas, -1, config.vocab_size)
        for r in range(replicas):
            generated[r].append(logits[r].argmax(-1))
            lens[r] = lens[r] + 1
    return first, [np.stack(g, axis=1).tolist() for g in generated]


def _hlo_counts(text):
    ops = ("collective-permute", "all-reduce", "all-gather", "reduce-scatter", "all-to-all")
    # Count instructions (" = <shape> op(" or "op-start("), not metadata mentions.
    return {op: text.count(f" {op}(") + text.count(f" {op}-start(") for op in ops}


def worker(out_path, labels=None):
    """The RUNS (and the HLO, collective-matmul and int8 all-reduce checks), or with `labels` those runs only."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jlight.core.parallel_ops import ParallelOps
    from jlight.models import llama
    from jlight.pallas_kernels.dispatch import get_kernels
    from jlight.sharding.collective_matmul import all_gather_matmul, matmul_reduce_scatter
    from jlight.sharding.int8_all_reduce import error_bound, int8_all_reduce
    from jlight.sharding.mesh import make_mesh
    from jlight.sharding.plan import ShardingPlan

    assert jax.device_count() == NUM_DEVICES, jax.devices()
    results = {}
    config = _tiny_config()
    kernels = get_kernels("reference", "reference")
    params = llama.init_params(config, jax.random.PRNGKey(0), jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [[rng.integers(0, config.vocab_size, n) for n in lens] for lens in ((13, 19), (7, 25), (2, 28), (5, 9))]

    models = {"llama": (llama, config, params), "moe": _tiny_moe()}
    # Reference: the unsharded model, one sub-batch at a time.
    references = {}
    for name, (family, cfg, prm) in models.items():
        ref_step = jax.jit(functools.partial(_model_fn(cfg, kernels, family), ops=ParallelOps()))
        references[name] = [_generate(ref_step, prm, cfg, [p], lambda xs: xs[0]) for p in prompts]

    runs = RUNS if labels is None else [r for r in RUNS + EXTENDED_RUNS if r[0] in labels]
    for label, spec, cm, int8 in runs:
        family, cfg, prm = models["moe" if label.startswith("moe") else "llama"]
        reference = references["moe" if label.startswith("moe") else "llama"]
        sizes = dict(part.split("=") for part in spec.split(","))
        count = int(np.prod([int(s) for s in sizes.values()]))
        dp = int(sizes.get("dp", 1))
        mesh = make_mesh(spec, jax.devices()[:count])
        plan = ShardingPlan(mesh, cfg, family.param_axes(cfg))
        sharded_params = plan.prepare_params(prm)
        step = jax.jit(plan.wrap(_model_fn(plan.config, kernels, family), collective_matmul=cm, int8_all_reduce=int8,
                                 collective_matmul_min_tokens=0))
        stack = (lambda xs: jax.tree.map(lambda *a: jnp.stack(a), *xs)) if dp > 1 else (lambda xs: xs[0])
        sub = prompts[:dp]
        first, tokens = _generate(step, sharded_params, plan.config, sub, stack)
        results[label] = {
            "max_abs_logit_diff": max(float(np.max(np.abs(first[r] - reference[r][0][0]))) for r in range(dp)),
            "tokens": tokens, "reference_tokens": [reference[r][1][0] for r in range(dp)],
            "kv_heads": plan.config.num_kv_heads,
        }
    if labels is not None:
        with open(out_path, "w") as f:
            json.dump(results, f)
        return

    # Compiled HLO of a tp=4 prefill step with collective matmul on and off.
    mesh = make_mesh("tp=4", jax.devices()[:4])
    plan = ShardingPlan(mesh, config, llama.param_axes(config))
    sp = plan.prepare_params(params)
    k_shape, v_shape = llama.kv_cache_shapes(plan.config, NUM_PAGES, PAGE_SIZE)
    md = _batch([13, 19], 32, 1)
    args = (sp, jnp.zeros(k_shape), jnp.zeros(v_shape), jnp.zeros(32, jnp.int32), md)
    for cm in (True, False):
        fn = plan.wrap(_model_fn(plan.config, kernels), collective_matmul=cm, collective_matmul_min_tokens=0)
        results[f"hlo cm={cm}"] = _hlo_counts(jax.jit(fn).lower(*args).compile().as_text())
    fn = plan.wrap(_model_fn(plan.config, kernels), collective_matmul=True)  # default threshold
    results["hlo cm default, 32 tokens"] = _hlo_counts(jax.jit(fn).lower(*args).compile().as_text())

    # The collective matmuls alone, against all_gather/psum_scatter + matmul, on 8 devices.
    mesh8 = make_mesh("tp=8")
    mm = kernels.matmul
    x = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)  # [T, in]
    w = jnp.asarray(rng.standard_normal((32, 48)), jnp.float32)  # [in, out]

    def sm(f, in_specs, out_specs):
        return jax.jit(jax.shard_map(f, mesh=mesh8, in_specs=in_specs, out_specs=out_specs, check_vma=False))

    ag = sm(lambda x, w: all_gather_matmul(x, w, mm, axis_name="tp", n=8), (P("tp"), P(None, "tp")), P(None, "tp"))
    rs = sm(lambda x, w: matmul_reduce_scatter(x, w, mm, axis_name="tp", n=8), (P(None, "tp"), P("tp")), P("tp"))
    exact = np.asarray(x) @ np.asarray(w)
    results["all_gather_matmul_err"] = float(np.max(np.abs(np.asarray(ag(x, w)) - exact)))
    results["matmul_reduce_scatter_err"] = float(np.max(np.abs(np.asarray(rs(x, w)) - exact)))
    results["hlo all_gather_matmul"] = _hlo_counts(ag.lower(x, w).compile().as_text())
    results["hlo matmul_reduce_scatter"] = _hlo_counts(rs.lower(x, w).compile().as_text())

    # int8 all-reduce: partials with a different magnitude per device and per row.
    partials = rng.standard_normal((8, 6, 1024)) * rng.uniform(0.01, 10, (8, 6, 1))  # [device, rows, width]
    partials = jnp.asarray(partials, jnp.float32)
    red = sm(lambda p: int8_all_reduce(p[0], axis_name="tp", n=8)[None], P("tp"), P("tp"))
    got = np.asarray(red(partials))  # [8, rows, width], every device's copy
    exact = np.asarray(partials).sum(0)
    bound = np.asarray(error_bound(partials))
    results["int8"] = {
        "max_err": float(np.max(np.abs(got - exact[None]))),
        "max_err_over_bound": float(np.max(np.abs(got - exact[None]) / bound[None])),
        "max_bound": float(bound.max()), "max_abs_sum": float(np.abs(exact).max()),
        "copies_identical": bool(np.all(got == got[:1])),
    }
    results["hlo int8"] = _hlo_counts(red.lower(partials).compile().as_text())
    with open(out_path, "w") as f:
        json.dump(results, f)


# ---------------------------------------------------------------------------- tests ---

def _run_worker(out, labels=None):
    env = simulated_env(NUM_DEVICES)
    args = [sys.executable, __file__, str(out)] + ([json.dumps(labels)] if labels is not None else [])
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return _run_worker(tmp_path_factory.mktemp("sharding") / "results.json")


@pytest.fixture(scope="module")
def extended_results(tmp_path_factory):
    return _run_worker(tmp_path_factory.mktemp("sharding") / "extended.json", [r[0] for r in EXTENDED_RUNS])


@pytest.mark.parametrize("label", [r[0] for r in RUNS if "int8" not in r[0]]
                         + [pytest.param(r[0], marks=pytest.mark.extended) for r in EXTENDED_RUNS])
def test_sharded_logits_and_greedy_tokens_match_unsharded(request, label):
    fixture = "extended_results" if label in [r[0] for r in EXTENDED_RUNS] else "results"
    r = request.getfixturevalue(fixture)[label]
    assert r["max_abs_logit_diff"] < 1e-4, r
    assert r["tokens"] == r["reference_tokens"]


def test_kv_heads_replicated_up_to_tp(results):
    assert results["tp=2 cm"]["kv_heads"] == 2
    assert results["tp=4"]["kv_heads"] == 4
    assert results["tp=8 cm"]["kv_heads"] == 8


def test_int8_all_reduce_model_close_to_exact(results):
    r = results["tp=4 int8"]
    # Quantization noise, not a bug: logits of magnitude ~1 move by a few 1e-2 at most.
    assert 0 < r["max_abs_logit_diff"] < 0.1, r


def test_collective_matmul_replaces_all_reduce_in_hlo(results):
    on, off = results["hlo cm=True"], results["hlo cm=False"]
    assert on["collective-permute"] > 0 and on["all-reduce"] == 0, on
    assert off["collective-permute"] == 0 and off["all-reduce"] > 0, off
    # Below the default token threshold the plain all-reduce path is used.
    default = results["hlo cm default, 32 tokens"]
    assert default["collective-permute"] == 0 and default["all-reduce"] > 0, default


def test_collective_matmuls_match_and_issue_only_permutes(results):
    assert results["all_gather_matmul_err"] < 1e-4
    assert results["matmul_reduce_scatter_err"] < 1e-4
    for key in ("hlo all_gather_matmul", "hlo matmul_reduce_scatter"):
        h = results[key]
        assert h["collective-permute"] > 0, (key, h)
        assert h["all-gather"] == h["reduce-scatter"] == h["all-reduce"] == 0, (key, h)


def test_int8_all_reduce_within_error_bound(results):
    r = results["int8"]
    assert r["copies_identical"]
    assert 0 < r["max_err"]  # it really quantized
    assert r["max_err_over_bound"] <= 1.0 + 1e-4, r
    # The worst-case bound is loose after the Hadamard rotation (sqrt(group) x the per-group
    # rounding); the error actually made must be small.
    assert r["max_err"] < 0.01 * r["max_abs_sum"], r
    assert results["hlo int8"]["all-to-all"] > 0 and results["hlo int8"]["all-reduce"] == 0


if __name__ == "__main__":
    worker(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else None)
