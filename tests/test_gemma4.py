"""Gemma 4 (text) against transformers on tiny random-weight models (float32).

The tiny model (tests/tiny_models.py) has every text feature on: sliding layers of head_dim 16 with 2 KV
heads beside full layers of head_dim 32 with 1 KV head and keys as values, proportional RoPE, per-layer
embeddings, the last two layers reading earlier layers' K/V with 2x MLPs, the MoE block, noisy norms,
layer scalars and router scales. DENSE switches all of those off but the two geometries. Logits within
1e-4 and 32 greedy tokens identical; through the engine (batched, chunked prefill over the 8-token window,
prefix cache, preemption) identical greedy tokens; Gemma4ForConditionalGeneration's text model read from
its nested config and `model.language_model.*` names. On simulated CPU devices (mesh_config's layout): tp=2,
ep=2, a sequence-parallel tp=2 prefill and tp=4 give transformers' greedy tokens. And the configurations jlight
refuses, on one device and on a mesh.
"""
import json
import os
import textwrap

import numpy as np
import pytest

from families_common import PROMPTS, check_direct, check_engine, hf_model
from jlight.core.config import ModelConfig
from jlight.core.errors import UnsupportedModelError
from jlight.loading import load_model
from jlight.models import gemma4, get_model_family

ARCH = "Gemma4ForCausalLM"
DENSE = dict(hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False, enable_moe_block=False,
             attention_k_eq_v=False)


@pytest.fixture(scope="module")
def full(tiny_model):
    path = tiny_model(ARCH)
    return path, hf_model(path, ARCH)


def test_full_model_matches_transformers(full):
    path, hf = full
    loaded = load_model(path, dtype="float32")
    assert set(loaded.params) >= {"sliding_layers", "full_layers", "shared_sliding_layers", "shared_full_layers", "ple_embed"}
    assert loaded.params["shared_sliding_layers"]["w_gate"].shape == (1, 64, 192)  # double-wide
    assert "wk" not in loaded.params["shared_full_layers"] and "wv" not in loaded.params["full_layers"]
    check_direct(loaded.params, loaded.config, hf)


def test_dense_core_matches_transformers(tiny_model):
    """No PLE, KV sharing, MoE or keys-as-values: the two geometries (16 x 2 and 32 x 2 KV heads) alone."""
    path = tiny_model(ARCH, **DENSE)
    loaded = load_model(path, dtype="float32")
    assert set(loaded.params) == {"embed", "final_norm", "lm_head", "sliding_layers", "full_layers"}
    assert get_model_family(loaded.config).kv_cache_shapes(loaded.config, 5, 8)[0] == (6, 5, 8, 2, 32)
    check_direct(loaded.params, loaded.config, hf_model(path, ARCH), prompts=PROMPTS[:2])


def test_engine_matches_transformers(full):
    """Unrolled layers (as on the GPU); the pool holds the 4 non-shared layers in 4 groups of one (one full, three sliding)."""
    outs = check_engine(*full, num_pages=32, layer_loop="unroll")
    assert len(outs) == 5


def test_sliding_kind_wider_than_full_matches_transformers(tiny_model):
    """Sliding layers of 4 KV heads x 16 (64 values a token) beside full layers of 1 x 32, as the 31B model's
    16 x 256 beside 4 x 512: the pool is 2 heads of 32, each holding two different sliding heads side by side,
    and a sliding query head reads its own half of one (the module docstring's segments)."""
    path = tiny_model(ARCH, num_key_value_heads=4)
    loaded = load_model(path, dtype="float32")
    assert gemma4.plan(loaded.config).geometry == {"sliding_attention": (16, 4), "full_attention": (32, 1)}
    assert gemma4.kv_cache_shapes(loaded.config, 5, 8)[0] == (4, 5, 8, 2, 32)
    hf = hf_model(path, ARCH)
    check_direct(loaded.params, loaded.config, hf, prompts=PROMPTS[:2])
    check_engine(path, hf, num_pages=32)


def test_the_step_never_copies_the_kv_pool(full):
    """The kinds' different head_dims are read from the pool as it is: no compiled step (prefill and decode
    buckets, both page-table widths) holds a copy of a pool-sized array, which would cost a copy of the whole
    pool every step."""
    import re

    import jlight

    llm = jlight.LLM(full[0], dtype="float32", max_num_seqs=4, page_size=8, num_pages=37, max_num_batched_tokens=16,
                     min_token_bucket=1, compilation_cache_dir=None, enable_prefix_caching=False)
    executables = list(llm.engine.runner._executables.values())
    assert len(executables) >= 2
    for executable in executables:
        pool_sized = [c for c in re.findall(r"= (\S+) copy\(", executable.as_text()) if ",37," in c]
        assert not pool_sized, f"the step copies the pool: {pool_sized}"


def test_int8_pool_of_two_geometries_is_refused(full):
    """An int8 pool scales each pool head as one vector, and a sliding layer's pool head holds two of its heads:
    refused at the first step, naming the option and its working values."""
    import jlight

    llm = jlight.LLM(full[0], dtype="float32", max_num_seqs=2, page_size=8, num_pages=64, kv_cache_dtype="int8",
                     max_num_batched_tokens=16, min_token_bucket=16, compilation_cache_dir=None, warmup=False)
    with pytest.raises(UnsupportedModelError, match="kv_cache_dtype int8.*use kv_cache_dtype auto or fp8"):
        llm.generate([PROMPTS[0]], use_tqdm=False)


def test_conditional_generation_text_model(full, tmp_path):
    """Gemma4ForConditionalGeneration: text_config nested, eos at the top level, text weights under
    model.language_model.*, a vision tower's tensor beside them (skipped): the text model's logits."""
    import torch
    from safetensors.numpy import load_file, save_file

    path, hf = full
    text_cfg = json.load(open(os.path.join(path, "config.json")))
    text_cfg.pop("architectures")
    cfg = dict(architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4", text_config=text_cfg,
               vision_config=None, audio_config=None, eos_token_id=[1, 106], tie_word_embeddings=True)
    tensors = {k.replace("model.", "model.language_model.", 1): v
               for k, v in load_file(os.path.join(path, "model.safetensors")).items()}
    tensors["model.vision_tower.encoder.patch_embedder.weight"] = np.ones((3, 7), np.float32)
    out = tmp_path / "mm"
    out.mkdir()
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(out), dtype="float32")
    assert loaded.config.architecture == "Gemma4ForConditionalGeneration" and loaded.config.eos_token_ids == (1, 106)
    assert loaded.config.extra["hidden_size_per_layer_input"] == 8
    with torch.no_grad():  # the same weights as transformers' multimodal class reads them
        from transformers import Gemma4Config, Gemma4ForConditionalGeneration

        mm = Gemma4ForConditionalGeneration(Gemma4Config(**{k: v for k, v in cfg.items() if k != "architectures"}))
        assert {k for k in mm.state_dict() if "layers" not in k} - {"lm_head.weight"} <= set(tensors)
    check_direct(loaded.params, loaded.config, hf, prompts=PROMPTS[2:])


def _config(**fields) -> dict:
    return {**dict(architectures=[ARCH], model_type="gemma4_text", vocab_size=32, hidden_size=16, intermediate_size=16,
                   num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=4,
                   rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                       "rope_theta": 1e6}}), **fields}


def test_both_geometry_forms_read_alike():
    """The hub form (global_head_dim, num_global_key_value_heads with attention_k_eq_v) and transformers' saved
    per_layer_config give the same geometries; without attention_k_eq_v the global KV heads are ignored."""
    hub = ModelConfig.from_hf_dict(_config(global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True))
    saved = ModelConfig.from_hf_dict(_config(attention_k_eq_v=True, per_layer_config={
        "05": {"head_dim": 16, "num_key_value_heads": 1}}))
    for cfg in (hub, saved):
        assert gemma4.plan(cfg).geometry == {"sliding_attention": (8, 2), "full_attention": (16, 1)}
        # W = 16 (both kinds'); the pool takes the full layers' 1 x 16, the sliding layers view it as 2 x 8
        assert gemma4.kv_cache_shapes(cfg, 3, 4)[0] == (6, 3, 4, 1, 16)
    plain = ModelConfig.from_hf_dict(_config(num_global_key_value_heads=1))
    assert gemma4.plan(plain).geometry["full_attention"] == (512, 2)  # HF's default global_head_dim


def test_proportional_rope_table():
    cfg = ModelConfig.from_hf_dict(_config(global_head_dim=16))
    full = gemma4.rope_tables(cfg)["full_attention"].inv_freq
    assert full.shape == (8,) and np.count_nonzero(full) == 2  # int(0.25 * 16 // 2) rotated pairs
    np.testing.assert_allclose(full[:2], [1.0, 1e6 ** (-2 / 16)], rtol=1e-6)  # exponent over the whole head_dim


def test_kv_sharing_producers():
    """The shared layers read the last non-shared layer of their own type (the last layer forced full)."""
    types = ["sliding_attention"] * 2 + ["full_attention"] + ["sliding_attention"] * 3
    p = gemma4.plan(ModelConfig.from_hf_dict(_config(num_kv_shared_layers=3, layer_types=types)))
    assert p.types[-1] == "full_attention" and p.producer == (0, 1, 2, 1, 1, 2) and p.num_pool_layers == 3
    with pytest.raises(UnsupportedModelError, match="num_kv_shared_layers=1 leaves no non-shared full_attention"):
        gemma4.plan(ModelConfig.from_hf_dict(_config(num_kv_shared_layers=1, layer_types=["sliding_attention"] * 6)))


def test_bidirectional_all_is_refused():
    ModelConfig.from_hf_dict(_config(use_bidirectional_attention="vision"))  # the multimodal mask only
    with pytest.raises(UnsupportedModelError, match="use_bidirectional_attention='all'"):
        ModelConfig.from_hf_dict(_config(use_bidirectional_attention="all"))


def test_unknown_per_layer_override_is_refused():
    cfg = ModelConfig.from_hf_dict(_config(per_layer_config={"5": {"head_dim": 16, "intermediate_size": 8}}))
    with pytest.raises(UnsupportedModelError, match=r"per_layer_config overrides \['intermediate_size'\]"):
        gemma4.plan(cfg)


def test_heads_not_fitting_the_pool_view_are_refused():
    """W = 2 x 8 = 16; full layers of head_dim 4 view it as 4 heads, which 2 query heads cannot share."""
    cfg = ModelConfig.from_hf_dict(_config(global_head_dim=4, num_attention_heads=2))
    with pytest.raises(UnsupportedModelError, match="num_attention_heads 2 must be a multiple of 4"):
        gemma4.param_shapes(cfg)


# A child process's helper: greedy token ids of `prompts` from an engine over `mesh`.
MESH_TOKENS = textwrap.dedent("""
    import json
    import numpy as np
    import jlight
    from jlight import SamplingParams

    def tokens(path, mesh, prompts, max_tokens, **options):
        llm = jlight.LLM(path, dtype="float32", mesh=mesh, max_num_seqs=4, page_size=8, compilation_cache_dir=None,
                         warmup=False, **options)
        res = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
        return [r.outputs[0].token_ids for r in res]
""")
MESH_SCRIPT = MESH_TOKENS + textwrap.dedent("""
    short = dict(max_num_batched_tokens=16, min_token_bucket=16, num_pages=64)
    out = {{name: tokens(path, "tp=2", {prompts!r}, 16, **short) for name, path in {paths!r}.items()}}
    print("RESULT" + json.dumps(out))
""")
MESH_MORE_SCRIPT = MESH_TOKENS + textwrap.dedent("""
    out = {{"full ep=2": tokens({path!r}, "ep=2", {prompts!r}, 16, max_num_batched_tokens=16, min_token_bucket=16,
                                num_pages=64),
           "full tp=2 long": tokens({path!r}, "tp=2", {long!r}, 8, max_num_batched_tokens=256, min_token_bucket=128,
                                    num_pages=256, collective_matmul=True)}}
    print("RESULT" + json.dumps(out))
""")


def test_mesh_matches_transformers(full, tiny_model):
    """On 2 simulated devices: the full and dense tiny models under tp=2 (the full layers' one KV head split
    inside the head and gathered, each device keeping a copy; the dense core's two heads one a device):
    transformers' greedy tokens."""
    from direct_forward import hf_greedy
    from simulated_devices import run_script

    dense = tiny_model(ARCH, **DENSE)
    prompts = [PROMPTS[0], PROMPTS[1][:13]]
    out = run_script(MESH_SCRIPT.format(paths={"full": full[0], "dense": dense}, prompts=prompts), 2)
    assert out["full"] == [hf_greedy(full[1], p, 16) for p in prompts]
    assert out["dense"] == [hf_greedy(hf_model(dense, ARCH), p, 16) for p in prompts]


@pytest.mark.extended
def test_experts_and_sequence_parallel_mesh_match_transformers(full):
    """On 2 simulated devices: the full model's experts under ep=2, and its 300-token prompt under tp=2 with
    sequence parallelism (a 256-token step: the residual stream, PLE and router inputs split on tokens):
    transformers' greedy tokens."""
    from direct_forward import hf_greedy
    from simulated_devices import run_script

    prompts = [PROMPTS[0], PROMPTS[1][:13]]
    long = [np.random.default_rng(0).integers(3, 250, size=300).tolist(), PROMPTS[2]]
    out = run_script(MESH_MORE_SCRIPT.format(path=full[0], prompts=prompts, long=long), 2)
    assert out["full ep=2"] == [hf_greedy(full[1], p, 16) for p in prompts]
    assert out["full tp=2 long"] == [hf_greedy(full[1], p, 8) for p in long]


def test_tp4_keeps_the_head_each_device_reads(tiny_model):
    """tp=4 over the dense core with 8 query heads: both kinds' 2 KV heads split inside each head and gathered,
    devices 0-1 keeping head 0 and 2-3 head 1 (2 query heads a device): transformers' greedy tokens."""
    from direct_forward import hf_greedy
    from simulated_devices import run_script

    path = tiny_model(ARCH, num_attention_heads=8, **DENSE)
    prompts = [PROMPTS[0], PROMPTS[1][:13]]
    out = run_script(MESH_TOKENS + textwrap.dedent(f"""
        out = tokens({path!r}, "tp=4", {prompts!r}, 16, max_num_batched_tokens=16, min_token_bucket=16, num_pages=64)
        print("RESULT" + json.dumps(out))
    """), 4)
    assert out == [hf_greedy(hf_model(path, ARCH), p, 16) for p in prompts]


def test_mesh_config_replicates_kv_heads_up_to_tp():
    """tp=2: the full layers' 1 KV head (head_dim 16) is kept twice, so the pool is 2 x 16 wide, one head a device,
    and the sliding layers (2 x 8) view each device's 16 values as one head of 8 repeated twice."""
    cfg = ModelConfig.from_hf_dict(_config(global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True))
    mesh = gemma4.mesh_config(cfg, 2)
    assert gemma4.plan(mesh).geometry == {"sliding_attention": (8, 2), "full_attention": (16, 2)}
    assert gemma4.kv_cache_shapes(mesh, 3, 4)[0] == (6, 3, 4, 2, 16)
    assert gemma4.mesh_config(cfg, 1) is cfg


def _fake_mesh(tp: int):
    from jax.sharding import AbstractMesh

    return AbstractMesh((1, 1, tp), ("dp", "ep", "tp"))


def test_mesh_refusals_name_the_fields():
    """A kind whose KV heads and tp do not divide one another; and tp=4 over 4 query heads, where the full layers'
    copies make the pool 4 x 16 wide, 16 values a device that the sliding layers view as 2 heads of 8 for one query head."""
    from jlight.sharding.plan import ShardingPlan

    three = ModelConfig.from_hf_dict(_config(global_head_dim=16, num_global_key_value_heads=3, attention_k_eq_v=True,
                                             num_attention_heads=6))
    with pytest.raises(ValueError, match=r"full_attention layers have 3 KV heads .*num_global_key_value_heads.*choose another tp"):
        ShardingPlan(_fake_mesh(2), three, gemma4.param_axes(three), mesh_config=gemma4.mesh_config)
    cfg = ModelConfig.from_hf_dict(_config(global_head_dim=16, num_global_key_value_heads=1, attention_k_eq_v=True))
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) a multiple of the view's heads; choose another tp"):
        ShardingPlan(_fake_mesh(4), cfg, gemma4.param_axes(cfg), mesh_config=gemma4.mesh_config)
    assert ShardingPlan(_fake_mesh(2), cfg, gemma4.param_axes(cfg), mesh_config=gemma4.mesh_config).config == \
        gemma4.mesh_config(cfg, 2)


def test_mesh_without_mesh_config_is_refused(tiny_model):
    """A tp step traced over a config that is not mesh_config's (a plan built without it): refused, naming the fix."""
    import jax.numpy as jnp

    from sharding.tensor_parallel import TensorParallelOps

    loaded = load_model(tiny_model(ARCH, **DENSE), dtype="float32")
    k, v = (jnp.zeros(s) for s in gemma4.kv_cache_shapes(loaded.config, 2, 8))
    with pytest.raises(UnsupportedModelError, match=r"gemma4.mesh_config\(config, tp\)"):
        gemma4.forward(loaded.params, loaded.config, jnp.zeros(4, jnp.int32), k, v, None, None,
                       TensorParallelOps(axis_name="tp", tp=2, vocab_size=512))
