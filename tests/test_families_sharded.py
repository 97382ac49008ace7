"""gpt-oss and Gemma 3 under tp=2 (simulated CPU devices) give transformers' greedy tokens: sink
logits split with their heads, biases, the biased experts under the tensor-parallel expert FFN,
the per-layer windows and RoPE tables inside shard_map."""
import textwrap

from direct_forward import hf_greedy
from families_common import hf_model
from simulated_devices import run_script

SCRIPT = textwrap.dedent("""
    import json
    import jlight
    from jlight import SamplingParams

    out = {{}}
    for name, path in {paths!r}.items():
        llm = jlight.LLM(path, dtype="float32", mesh="tp=2", max_num_seqs=4, max_num_batched_tokens=16,
                         min_token_bucket=16, page_size=8, num_pages=64, compilation_cache_dir=None, warmup=False)
        res = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        out[name] = [r.outputs[0].token_ids for r in res]
    print("RESULT" + json.dumps(out))
""")
PROMPTS = [[1] + list(range(30, 60)), [5, 300, 7, 7, 7, 400, 11, 250, 3, 90, 120, 64, 33]]
ARCHS = ["GptOssForCausalLM", "Gemma3ForCausalLM"]


def test_tp2_matches_transformers(tiny_model):
    paths = {arch: tiny_model(arch) for arch in ARCHS}
    out = run_script(SCRIPT.format(paths=paths, prompts=PROMPTS), 2)
    for arch in ARCHS:
        hf = hf_model(paths[arch], arch)
        assert out[arch] == [hf_greedy(hf, p, 16) for p in PROMPTS], arch


MXFP4_SCRIPT = textwrap.dedent("""
    import json
    import jax
    import jlight
    from jlight import SamplingParams
    from jlight.core.quantization import Mxfp4Weight

    out = {{}}
    for mesh in ("tp=2", "ep=2", "dp=2"):
        llm = jlight.LLM({path!r}, dtype="float32", mesh=mesh, quantization="mxfp4", max_num_seqs=4,
                         max_num_batched_tokens=16, min_token_bucket=16, page_size=8, num_pages=64,
                         compilation_cache_dir=None, warmup=False)
        res = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        out[mesh] = [r.outputs[0].token_ids for r in res]
        if mesh == "dp=2":  # two replicas of one load, each on its device
            continue
        kept = [w for w in jax.tree.leaves(llm.engine.runner.params, is_leaf=lambda x: isinstance(x, Mxfp4Weight))
                if isinstance(w, Mxfp4Weight)]
        out[mesh + " kept"] = [[str(w.blocks.dtype), len(w.blocks.sharding.device_set), str(w.blocks.sharding.spec)]
                               for w in kept]
    try:
        jlight.LLM({narrow!r}, dtype="float32", mesh="tp=2", quantization="mxfp4", num_pages=64,
                   compilation_cache_dir=None, warmup=False)
    except ValueError as e:
        out["narrow"] = str(e)
    print("RESULT" + json.dumps(out))
""")


def test_mxfp4_experts_under_tp2_and_ep2_match_transformers(tiny_model, tmp_path):
    """gpt-oss's experts kept as MXFP4 (quantization="mxfp4") split over tp (the mlp axis: gate/up columns, the
    down projection's input rows at whole 32-row blocks), over ep (the experts), and in dp=2 replicas of one load:
    transformers' greedy tokens of the same MXFP4 file. An mlp of 32 rows cannot split at a block over tp=2: refused, naming the weight."""
    import torch
    import transformers
    from test_gpt_oss import _mxfp4_copy

    path = _mxfp4_copy(tiny_model("GptOssForCausalLM", intermediate_size=64), str(tmp_path / "mxfp4"))
    narrow = _mxfp4_copy(tiny_model("GptOssForCausalLM"), str(tmp_path / "mxfp4_narrow"))
    out = run_script(MXFP4_SCRIPT.format(path=path, narrow=narrow, prompts=PROMPTS), 2)
    hf = transformers.GptOssForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32).eval()
    expected = [hf_greedy(hf, p, 16) for p in PROMPTS]
    assert out["tp=2"] == expected and out["ep=2"] == expected and out["dp=2"] == expected
    for mesh, axis in (("tp=2", "tp"), ("ep=2", "ep")):  # the step ran the stored bytes, split over the mesh
        kept = out[mesh + " kept"]
        assert kept and all(dtype == "uint8" and devices == 2 and axis in spec for dtype, devices, spec in kept), kept
    assert "experts_down" in out["narrow"] and "32-row blocks" in out["narrow"], out["narrow"]
