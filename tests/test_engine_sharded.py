"""The full engine under a mesh (simulated CPU devices) gives the same greedy tokens as one
device: tensor parallel with collective matmul (long prefill chunks) and with KV heads
replicated (tp > num_kv_heads), data-parallel replicas, expert-parallel axes, and a converted
(orbax) checkpoint restored straight into the mesh."""
import textwrap

from simulated_devices import run_script

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import jax
    import numpy as np
    import jlight
    from jlight import SamplingParams
    from jlight.convert import convert

    paths = {paths!r}  # the tiny models, built by the session fixtures (run_meshes)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, size=int(n)).tolist() for n in (5, 40, 300, 17)]  # ids valid for both tiny vocabularies
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = {{}}
    runs = {runs!r}
    if any(m == "orbax" for m, _, _ in runs.values()):
        paths["orbax"] = os.path.join({tmp!r}, "converted")
        convert(paths["hf"], paths["orbax"], dtype="float32")
    for name, (kind, mesh, batched) in runs.items():
        model = paths[kind]
        # One step bucket (min_token_bucket = the largest): every engine compiles one step, not one per
        # power of two, which is most of this test's time on a cold compilation cache.
        llm = jlight.LLM(model, dtype="float32", mesh=mesh, max_num_seqs=4, max_num_batched_tokens=batched,
                         min_token_bucket=batched, page_size=8, num_pages=256,
                         collective_matmul=True)  # on: the long chunks take it
        res = llm.generate(prompts, params, use_tqdm=False)
        out[name] = [r.outputs[0].token_ids for r in res]
        assert llm.engine.stats().num_pages_used == 0
        if hasattr(llm.engine, "replicas"):  # data parallel: each replica's KV pool on its own devices
            groups = [frozenset(d.id for d in r.runner.k_cache.devices()) for r in llm.engine.replicas]
            assert len(set().union(*groups)) == sum(len(g) for g in groups) == jax.device_count(), groups
            assert all(r.num_steps > 0 for r in llm.engine.replicas)  # and every replica did work
    print("RESULT" + json.dumps(out))
""")


MOE_ARCHS = {"moe": "Qwen3MoeForCausalLM", "deepseek": "DeepseekV3ForCausalLM"}


def run_meshes(tmp_path, num_devices: int, runs: dict, tiny_model, tiny_moe_model) -> dict:
    # The seeded tiny models come from the session fixtures (the same weights make_tiny_model and
    # make_tiny_moe_model write anywhere), built once per worker instead of once per script, so the
    # script does not import torch and transformers.
    paths = {"hf": tiny_model("LlamaForCausalLM", max_position_embeddings=1024)}
    for kind, arch in MOE_ARCHS.items():
        if any(m == kind for m, _, _ in runs.values()):
            paths[kind] = tiny_moe_model(arch)[0]
    return run_script(SCRIPT.format(tmp=str(tmp_path), runs=runs, paths=paths), num_devices)


def test_two_devices_tp2_with_collective_matmul_and_orbax_restore(tmp_path, tiny_model, tiny_moe_model):
    # 256-token buckets: the 300-token prompt's chunks are long enough for collective matmul.
    out = run_meshes(tmp_path, 2, {"single": ("hf", None, 256), "tp=2": ("hf", "tp=2", 256),
                                   "tp=2 from orbax": ("orbax", "tp=2", 64)}, tiny_model, tiny_moe_model)
    assert all(len(t) == 12 for t in out["single"])
    assert out["tp=2"] == out["single"]
    assert out["tp=2 from orbax"] == out["single"]


def test_four_devices_kv_head_replication_data_parallel_and_expert_axis(tmp_path, tiny_model, tiny_moe_model):
    out = run_meshes(tmp_path, 4, {"single": ("hf", None, 64), "tp=4": ("hf", "tp=4", 64),
                                   "dp=2,tp=2": ("hf", "dp=2,tp=2", 64), "dp=4": ("hf", "dp=4", 64),
                                   "moe single": ("moe", None, 64), "moe tp=2,ep=2": ("moe", "tp=2,ep=2", 64),
                                   "moe ep=4": ("moe", "ep=4", 64)}, tiny_model, tiny_moe_model)
    assert out["tp=4"] == out["single"]  # 2 KV heads replicated to 4
    assert out["dp=2,tp=2"] == out["single"]  # two replicas, each tp=2, requests spread over them
    assert out["dp=4"] == out["single"]  # four single-device replicas
    assert out["moe tp=2,ep=2"] == out["moe single"]
    assert out["moe ep=4"] == out["moe single"]


def test_eight_devices_deepseek_v3_expert_parallel(tmp_path, tiny_model, tiny_moe_model):
    """A tiny DeepSeek-V3 (MLA latent cache, 8 routed experts + a shared one) with ep=8 and tp=2,ep=4."""
    out = run_meshes(tmp_path, 8, {"single": ("deepseek", None, 64), "ep=8": ("deepseek", "ep=8", 64),
                                   "tp=2,ep=4": ("deepseek", "tp=2,ep=4", 64)}, tiny_model, tiny_moe_model)
    assert all(len(t) == 12 for t in out["single"])
    assert out["ep=8"] == out["single"]
    assert out["tp=2,ep=4"] == out["single"]
