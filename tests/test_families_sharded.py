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
