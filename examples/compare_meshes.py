"""Compare two meshes on one model: same logits? how fast is a prefill step?

Copy this and change MODEL_CONFIG / MESHES (and load your real weights instead of
init_params). Run on CPU with simulated devices:

  XLA_FLAGS=--xla_force_host_platform_device_count=4 python examples/compare_meshes.py
"""
import time

import jax
import jax.numpy as jnp
import numpy as np

from jlight.core.config import ModelConfig
from jlight.models import llama
from jlight.core.batch_metadata import BatchMetadata
from jlight.pallas_kernels.dispatch import get_kernels
from jlight.sharding.mesh import make_mesh, parse_mesh_spec
from jlight.sharding.plan import ShardingPlan

MODEL_CONFIG = ModelConfig(architecture="LlamaForCausalLM", vocab_size=512, hidden_size=128, intermediate_size=256,
                           num_layers=2, num_heads=8, num_kv_heads=2, head_dim=16, max_position_embeddings=1024)
MESHES = ["tp=2", "tp=4"]
PROMPT_LEN, PAGE_SIZE = 256, 16

params = llama.init_params(MODEL_CONFIG, jax.random.PRNGKey(0), jnp.float32)
kernels = get_kernels(sharded=True)  # the kernels an engine uses under a mesh
pages = 1 + np.arange(PROMPT_LEN // PAGE_SIZE, dtype=np.int32)
pos = np.arange(PROMPT_LEN, dtype=np.int32)
md = BatchMetadata(  # one prompt, prefilled in one step
    positions=jnp.asarray(pos), slot_mapping=jnp.asarray(pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE),
    token_seq=jnp.zeros(PROMPT_LEN, jnp.int32), page_table=jnp.asarray(pages[None]),
    context_lens=jnp.asarray([PROMPT_LEN], jnp.int32), query_start=jnp.asarray([0, PROMPT_LEN], jnp.int32),
    logits_indices=jnp.asarray([PROMPT_LEN - 1], jnp.int32),
)
tokens = jnp.asarray(np.random.default_rng(0).integers(0, MODEL_CONFIG.vocab_size, PROMPT_LEN), jnp.int32)

outputs = {}
for spec in MESHES:
    count = int(np.prod(list(parse_mesh_spec(spec).values())))
    plan = ShardingPlan(make_mesh(spec, jax.devices()[:count]), MODEL_CONFIG, llama.param_axes(MODEL_CONFIG))

    def model_fn(p, k, v, toks, md, ops, cfg=plan.config):
        hidden, k, v = llama.forward(p, cfg, toks, k, v, md, kernels, ops)
        return llama.compute_logits(p, cfg, hidden[md.logits_indices], kernels, ops), k, v

    step = jax.jit(plan.wrap(model_fn))
    k_shape, v_shape = llama.kv_cache_shapes(plan.config, 1 + len(pages), PAGE_SIZE)
    k_sh, v_sh = plan.kv_cache_shardings(k_shape, v_shape)
    k, v = jax.device_put(jnp.zeros(k_shape), k_sh), jax.device_put(jnp.zeros(v_shape), v_sh)
    sharded = plan.prepare_params(params)
    logits, _, _ = jax.block_until_ready(step(sharded, k, v, tokens, md))  # compile
    start = time.perf_counter()
    jax.block_until_ready(step(sharded, k, v, tokens, md))
    print(f"{spec:>10}: prefill of {PROMPT_LEN} tokens {1e3 * (time.perf_counter() - start):.2f} ms")
    outputs[spec] = np.asarray(logits)

a, b = (outputs[m] for m in MESHES)
print(f"max |logits {MESHES[0]} - logits {MESHES[1]}| = {np.abs(a - b).max():.2e}; "
      f"same next token: {bool((a.argmax(-1) == b.argmax(-1)).all())}")
