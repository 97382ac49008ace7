"""The full engine under a tensor-parallel mesh (4 simulated CPU devices) gives the same greedy
tokens as one device, with collective matmul on (long prefill chunks) and off."""
import json
import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    import jlight
    from jlight import SamplingParams
    from tiny_models import make_tiny_model

    path = make_tiny_model({tmp!r}, "LlamaForCausalLM", max_position_embeddings=1024)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=int(n)).tolist() for n in (5, 40, 300, 17)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    out = {{}}
    for mesh, batched in ((None, 256), ("tp=2", 256), ("tp=4", 64), ("tp=2,ep=2", 64)):
        llm = jlight.LLM(path, dtype="float32", mesh=mesh, max_num_seqs=4, max_num_batched_tokens=batched,
                         page_size=8, num_pages=256)
        res = llm.generate(prompts, params, use_tqdm=False)
        out[str(mesh)] = [r.outputs[0].token_ids for r in res]
        assert llm.engine.block_manager.num_used_pages == 0
    print("RESULT" + json.dumps(out))
""")


def test_tensor_parallel_engine_matches_single_device(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    tests = os.path.dirname(os.path.abspath(__file__))
    code = SCRIPT.format(tests=tests, tmp=str(tmp_path))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT"))
    out = json.loads(line[len("RESULT"):])
    single = out["None"]
    assert all(len(t) == 12 for t in single)
    for mesh in ("tp=2", "tp=4", "tp=2,ep=2"):
        assert out[mesh] == single, f"{mesh} differs from one device"
