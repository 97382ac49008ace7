"""Hybrid models under tp=2 (simulated CPU devices): attention heads, MLP columns and experts split over
the mesh, the recurrent layers run whole on every device with their state pools replicated; greedy
tokens identical to transformers' (Qwen3-Next: gated DeltaNet, gated attention, MoE + shared expert;
Granite-4.0-H and Nemotron-H share the same replicated recurrent path and split attention/MLP)."""
import json
import textwrap

import numpy as np
import pytest

from direct_forward import hf_greedy
from hybrid_common import make_tiny_hybrid_model
from simulated_devices import run_script

ARCHS = ["Qwen3NextForCausalLM"]  # one family: a compile a family, and the file stays under ~40 s
SCRIPT = textwrap.dedent("""
    import json
    import jlight
    from jlight import SamplingParams

    out = dict()
    for arch, path in json.loads({paths!r}).items():
        llm = jlight.LLM(path, dtype="float32", mesh="tp=2", max_num_seqs=4, max_num_batched_tokens=16,
                         min_token_bucket=16, page_size=8, num_pages=64, compilation_cache_dir=None)
        res = llm.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
        assert llm.engine.stats().num_pages_used == 0
        out[arch] = [r.outputs[0].token_ids for r in res]
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("hybrid"))
    return {arch: make_tiny_hybrid_model(root, arch) for arch in ARCHS}


def test_tp2_greedy_matches_transformers(models):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, size=n).tolist() for n in (5, 40)]  # 40: a prefill over three chunks
    paths = json.dumps({arch: path for arch, (path, _) in models.items()})
    out = run_script(SCRIPT.format(paths=paths, prompts=prompts), num_devices=2)
    for arch, (_, hf_model) in models.items():
        assert out[arch] == [hf_greedy(hf_model, p, 8) for p in prompts], arch
