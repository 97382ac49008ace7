"""MoE and MLA models under tensor parallelism with collective matmul on a long prefill chunk.

Steps of >= 256 tokens (plan.DEFAULT_COLLECTIVE_MATMUL_MIN_TOKENS) split the residual stream on
tokens (sequence parallelism), so every weight applied outside the column/row-parallel ops sees only
T/tp tokens. DeepSeek's MLA once failed to trace here ("mul got incompatible shapes for
broadcasting"): its replicated KV-latent projection now gathers its output on tokens. Run on 2
simulated CPU devices, the tp=2 engine must give the single-device greedy tokens for DeepSeek-V3
(q_lora_rank: wq_a + wq_b) with layer_loop "unroll" (the default; "scan" with -m extended: the same layer
under the other loop, which Qwen2-MoE runs here), and for Qwen2-MoE (router, shared expert with its gate,
QKV bias). (DeepSeek-V2's single wq, Qwen3-MoE and Mixtral
passed the same check once and were left out to keep the suite short.)
"""
import textwrap

import pytest
from simulated_devices import run_script

from jlight.sharding.plan import DEFAULT_COLLECTIVE_MATMUL_MIN_TOKENS

BATCHED_TOKENS = 256  # the 300-token prompt's first chunk fills a 256-token step

SCRIPT = textwrap.dedent("""
    import json
    import numpy as np
    import jlight
    from jlight import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, size=n).tolist() for n in (300, 9)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    out = {{}}
    for arch, loops in {runs!r}:
        path = {paths!r}[arch]
        for mesh, loop in [(None, "scan")] + [("tp=2", l) for l in loops]:
            llm = jlight.LLM(path, dtype="float32", mesh=mesh, layer_loop=loop, max_num_seqs=2,
                             max_num_batched_tokens={batched}, min_token_bucket=128, page_size=8, collective_matmul=True,
                             num_pages=64)  # two buckets: 128 (all-reduce), 256 (sequence-parallel)
            res = llm.generate(prompts, params, use_tqdm=False)
            out[f"{{arch}} {{mesh}} {{loop}}"] = [r.outputs[0].token_ids for r in res]
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.parametrize("runs", [
    (("DeepseekV3ForCausalLM", ("unroll",)), ("Qwen2MoeForCausalLM", ("scan",))),
    pytest.param((("DeepseekV3ForCausalLM", ("scan",)),), marks=pytest.mark.extended),
], ids=["deepseek_unroll-qwen2moe_scan", "deepseek_scan"])
def test_tp2_collective_matmul_long_prefill_matches_single_device(tiny_moe_model, runs):
    assert BATCHED_TOKENS >= DEFAULT_COLLECTIVE_MATMUL_MIN_TOKENS  # else the step is not sequence-parallel
    # The seeded tiny models from the session fixture (what make_tiny_moe_model writes anywhere), so the
    # script does not build them again nor import torch and transformers.
    archs = [arch for arch, _ in runs]
    paths = {arch: tiny_moe_model(arch)[0] for arch in archs}
    out = run_script(SCRIPT.format(paths=paths, batched=BATCHED_TOKENS, runs=runs), num_devices=2)
    for arch in archs:
        single = out[f"{arch} None scan"]
        assert all(len(t) == 8 for t in single)
        for name, tokens in out.items():
            if name.startswith(arch + " tp=2"):
                assert tokens == single, name
