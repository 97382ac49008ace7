"""Two CPU processes joined by jax.distributed (localhost coordinator) run one tp=2 mesh
spanning both, and compute the same logits as one process running the model unsharded.

Each process has one CPU device; the tensor-parallel collectives cross the process
boundary (gloo). The processes are this file run as a script.
"""
from __future__ import annotations

import functools
import json
import socket
import subprocess
import sys

import numpy as np
from simulated_devices import simulated_env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tiny_setup():
    import jax
    import jax.numpy as jnp

    from jlight.core.config import ModelConfig
    from jlight.models import llama
    from jlight.core.batch_metadata import BatchMetadata
    from jlight.pallas_kernels.dispatch import get_kernels

    config = ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128, hidden_size=32, intermediate_size=64,
        num_layers=2, num_heads=4, num_kv_heads=1, head_dim=8, max_position_embeddings=64,
    )
    params = llama.init_params(config, jax.random.PRNGKey(1), jnp.float32)
    tokens = np.array([5, 17, 99, 3, 42, 7, 1, 0], np.int32)  # one 7-token prompt + 1 padding token
    md = BatchMetadata(
        positions=jnp.asarray([0, 1, 2, 3, 4, 5, 6, 0], jnp.int32),
        slot_mapping=jnp.asarray([4, 5, 6, 7, 8, 9, 10, 0], jnp.int32),  # pages 1-2 of size 4
        token_seq=jnp.zeros(8, jnp.int32), page_table=jnp.asarray([[1, 2, 0, 0]], jnp.int32),
        context_lens=jnp.asarray([7], jnp.int32), query_start=jnp.asarray([0, 7], jnp.int32),
        logits_indices=jnp.asarray([6], jnp.int32),
    )
    kernels = get_kernels("reference", "reference")

    def make_model_fn(cfg):
        def model_fn(p, k, v, toks, md, ops):
            hidden, k, v = llama.forward(p, cfg, toks, k, v, md, kernels, ops)
            return llama.compute_logits(p, cfg, hidden[md.logits_indices], kernels, ops), k, v

        return model_fn

    return config, params, tokens, md, make_model_fn


def _run(params, config, tokens, md, model_fn, place_cache):
    import jax
    import jax.numpy as jnp

    from jlight.models import llama

    k_shape, v_shape = llama.kv_cache_shapes(config, 4, 4)
    k, v = place_cache(jnp.zeros(k_shape, jnp.float32), jnp.zeros(v_shape, jnp.float32))
    logits, _, _ = jax.jit(model_fn)(params, k, v, jnp.asarray(tokens), md)
    return np.asarray(logits.addressable_data(0))


def worker(process_id: int, port: int, out_path: str):
    import jax

    from jlight.sharding.distributed import initialize

    initialize(f"127.0.0.1:{port}", 2, process_id)
    from jlight.models import llama
    from jlight.sharding.mesh import make_mesh
    from jlight.sharding.plan import ShardingPlan

    assert jax.process_count() == 2 and jax.device_count() == 2, jax.devices()
    config, params, tokens, md, make_model_fn = _tiny_setup()
    plan = ShardingPlan(make_mesh("tp=2"), config, llama.param_axes(config))
    sharded = plan.prepare_params(params)

    def place_cache(k, v):
        k_sh, v_sh = plan.kv_cache_shardings(k.shape, v.shape)
        return (jax.make_array_from_callback(k.shape, k_sh, lambda i: np.asarray(k)[i]),
                jax.make_array_from_callback(v.shape, v_sh, lambda i: np.asarray(v)[i]))

    logits = _run(sharded, plan.config, tokens, md, plan.wrap(make_model_fn(plan.config)), place_cache)
    with open(out_path, "w") as f:
        json.dump({"logits": logits.tolist(), "kv_heads": plan.config.num_kv_heads}, f)


def test_two_processes_match_one(tmp_path):
    port = _free_port()
    env = simulated_env(None)  # one device each
    procs = [
        subprocess.Popen([sys.executable, __file__, str(i), str(port), str(tmp_path / f"out{i}.json")],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode != 0:
            errors.append(err[-3000:])
    assert not errors, "\n".join(errors)

    config, params, tokens, md, make_model_fn = _tiny_setup()
    from jlight.core.parallel_ops import ParallelOps

    expected = _run(params, config, tokens, md, functools.partial(make_model_fn(config), ops=ParallelOps()), lambda k, v: (k, v))
    for i in range(2):
        out = json.loads((tmp_path / f"out{i}.json").read_text())
        assert out["kv_heads"] == 2  # the single KV head was replicated for tp=2
        np.testing.assert_allclose(np.asarray(out["logits"]), expected, atol=1e-4, rtol=1e-4)


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
