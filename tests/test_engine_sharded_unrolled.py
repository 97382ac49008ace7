"""The engine under a mesh with each layer loop: "unroll" (the default: the sharded weights split
per layer, run under a plan over the per-layer tree) and "scan" (one body over the stacked weights).
Greedy tokens must equal one device's, for float32 weights, int8 weights and an MoE model with
expert parallelism (2 simulated CPU devices)."""
import textwrap

import pytest

from simulated_devices import run_script

pytestmark = pytest.mark.extended  # README: `python -m pytest -m extended tests`

SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import jlight
    from jlight import SamplingParams

    paths = {paths!r}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, size=int(n)).tolist() for n in (5, 30)]  # 30: a chunked prefill
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    out = {{}}
    for name, (kind, options) in {runs!r}.items():
        llm = jlight.LLM(paths[kind], dtype="float32", max_num_seqs=2, max_num_batched_tokens=16, min_token_bucket=16,
                         page_size=8, num_pages=128, **options)  # one compiled step per engine
        layers = llm.engine.runner.params["layers"]
        assert isinstance(layers, list) == (options.get("layer_loop", "unroll") == "unroll"), name
        out[name] = [r.outputs[0].token_ids for r in llm.generate(prompts, params, use_tqdm=False)]
    print("RESULT" + json.dumps(out))
""")


def test_tp2_and_ep2_both_layer_loops_match_one_device(tiny_model, tiny_moe_model):
    scan = {"layer_loop": "scan"}
    runs = {
        "single": ("llama", {}), "tp=2": ("llama", {"mesh": "tp=2"}), "scan tp=2": ("llama", dict(scan, mesh="tp=2")),
        "int8 single": ("llama", {"quantization": "int8"}),
        "int8 scan tp=2": ("llama", dict(scan, quantization="int8", mesh="tp=2")),
        "moe single": ("moe", {}), "moe scan ep=2": ("moe", dict(scan, mesh="ep=2")),
    }
    # The seeded tiny models from the session fixtures (what make_tiny_model / make_tiny_moe_model write
    # anywhere), so the script does not build them again nor import torch and transformers.
    paths = {"llama": tiny_model("LlamaForCausalLM", max_position_embeddings=1024),
             "moe": tiny_moe_model("Qwen3MoeForCausalLM")[0]}
    out = run_script(SCRIPT.format(paths=paths, runs=runs), num_devices=2)
    assert all(len(t) == 10 for t in out["single"])
    assert out["tp=2"] == out["scan tp=2"] == out["single"]
    assert out["int8 scan tp=2"] == out["int8 single"]
    assert out["moe scan ep=2"] == out["moe single"]
