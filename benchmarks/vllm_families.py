"""vLLM 0.26 on the shapes of benchmarks/family_shapes.py (Gemma-3-12B, gpt-oss-20b, Qwen3-Next cut to 16 layers),
random ("dummy") bf16 weights, offline API, CUDA graphs on: the peer of jlight's offline_throughput.py and
context_sweep.py on those shapes (issues 31, 32).

On the GPU machine, through the peer's runner (../shared/peer/README.md; the path is relative to .peer6):
    bash .peer6/device.sh ../benchmarks/vllm_families.py --shape gemma3-12b [--fixed IN OUT N]
    bash .peer6/device.sh ../benchmarks/vllm_families.py --shape qwen3-next-16l --ttft 2048 8192 32000 [--decode]

Qwen3-Next's gated DeltaNet prefill runs vLLM's Triton kernels (additional_config gdn_prefill_backend="triton"):
on Hopper its default is FlashInfer's kernel, and the peer carries no FlashInfer (it failed so on an H100).

--shape NAME writes family_shapes.SHAPES[NAME] as config.json (no quantization_config: gpt-oss's experts are bf16,
not the release's MXFP4; with --quantization mxfp4, the release's quantization_config) and loads it with
load_format="dummy". vLLM's dummy weights are uniform in [-1e-3, 1e-3), the router's bias too, and under them
gpt-oss's router sends every token to the same 4 experts a layer (model_configs.vllm_dummy_params): jlight's
offline_throughput.py --init vllm-dummy gives jlight those weights, so both engines do the same work.

Default: ../shared/peer/vllm_bench.py's run, its LLM arguments (max_model_len 4096, max_num_seqs 256,
gpu_memory_utilization 0.9, seed 0) and its measurements with its request generators, call for call:
  nano  -- `random.seed(0)`, 256 requests, prompt token ids randint(0, 10000) of length randint(100, 1024), then
           max_tokens randint(100, 1024) each, temperature 0.6, ignore_eos; output tok/s = output tokens / wall time
           of the one generate call.
  bs1   -- `random.seed(1)`, 128 prompt tokens, greedy: ms/token = (t(256 tokens) - t(1 token)) / 255, median of 3.
  fixed -- with --fixed IN OUT N: `random.seed(2)`, N requests of IN random prompt tokens, OUT output tokens.
--ttft N [N ...]: instead, ../shared/peer/vllm_growth.py's engine (max_num_seqs 64, prefix caching off,
max_model_len max(32768, largest N + 128)) and its TTFT: after the untimed request [5] * 64 (4 tokens), per N the wall
time of one greedy token after the prompt [(7 * i + N) % 10000 for i in range(N)]; with --decode also its batch-1 and
batch-16 decode ms/step ((t(66 tokens) - t(2 tokens)) / 64 over rows [(11 * i + N + j) % 10000 for i in range(N)],
batch 16 only while 16 * N <= 300,000). The last line, VLLM_GROWTH {...}, is what context_sweep.py --plot --vllm
reads (saved as a JSON file).
Prints one JSON line per measurement.
"""
import argparse
import json
import os
import sys
import tempfile
import time
from random import randint, seed

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import family_shapes  # noqa: E402  (standard library only)

ap = argparse.ArgumentParser()
ap.add_argument("--shape", required=True, choices=sorted(family_shapes.SHAPES))
ap.add_argument("--fixed", type=int, nargs=3, metavar=("IN", "OUT", "N"))
ap.add_argument("--max-num-seqs", type=int, default=None, help="default: vllm_bench.py's 256, with --ttft vllm_growth.py's 64")
ap.add_argument("--quantization", default=None)
ap.add_argument("--kv-cache-dtype", default="auto")
ap.add_argument("--ttft", type=int, nargs="+", default=None, metavar="N", help="vllm_growth.py's TTFT at these prompt lengths")
ap.add_argument("--decode", action="store_true", help="with --ttft: vllm_growth.py's batch-1 / batch-16 decode too")
a = ap.parse_args()

import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

d = tempfile.mkdtemp(prefix=f"{a.shape}_dummy_")
cfg = family_shapes.shape(a.shape)
if a.quantization == "mxfp4":  # the release's own quantization_config: MXFP4 experts, everything else bf16
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
growth = a.ttft is not None
max_model_len = max(32768, max(a.ttft) + 128) if growth else 4096
opts = dict(enable_prefix_caching=False) if growth else {}
if "linear_num_value_heads" in cfg:  # gated DeltaNet layers: on Hopper vLLM's "auto" prefill picks FlashInfer's
    opts["additional_config"] = {"gdn_prefill_backend": "triton"}  # kernel, which the peer does not carry
t = time.time()
llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=max_model_len,
          max_num_seqs=a.max_num_seqs or (64 if growth else 256), gpu_memory_utilization=0.9, quantization=a.quantization,
          kv_cache_dtype=a.kv_cache_dtype, seed=0, **opts)
print(json.dumps(dict(shape=a.shape, vllm=vllm.__version__, max_model_len=max_model_len, init_s=round(time.time() - t, 1))),
      flush=True)


def generate(prompts, params):
    t = time.time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.time() - t, sum(len(o.outputs[0].token_ids) for o in outs)


if growth:  # vllm_growth.py's loop over the given lengths
    def run(prompts, n):
        return generate(prompts, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False))[0]

    run([[5] * 64], 4)
    res = dict(ttft={}, decode_b1={}, decode_b16={})
    for n in a.ttft:
        res["ttft"][n] = round(run([[(7 * i + n) % 10000 for i in range(n)]], 1) * 1e3, 1)
        for b, key in ((1, "decode_b1"), (16, "decode_b16")):
            if not a.decode or b * n > 300000:
                continue
            ps = [[(11 * i + n + j) % 10000 for i in range(n)] for j in range(b)]
            ta = run(ps, 2)
            tb = run(ps, 66)
            res[key][n] = round((tb - ta) / 64 * 1e3, 3)
        print(n, json.dumps({k: v.get(n) for k, v in res.items()}), flush=True)
    print("VLLM_GROWTH", json.dumps(dict(res, shape=a.shape, vllm=vllm.__version__, max_model_len=max_model_len)), flush=True)
    os._exit(0)  # as vllm_spec.py: vLLM's engine process can keep a finished run's interpreter from exiting

generate([[1] * 8], SamplingParams(max_tokens=16, ignore_eos=True, detokenize=False))  # warm-up
seed(0)
prompts = [[randint(0, 10000) for _ in range(randint(100, 1024))] for _ in range(256)]
params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(100, 1024), detokenize=False) for _ in range(256)]
wall, n = generate(prompts, params)
print(json.dumps(dict(nano=dict(output_tokens=n, wall_s=round(wall, 3), output_tok_s=round(n / wall, 1)))), flush=True)

seed(1)
p1 = [randint(0, 10000) for _ in range(128)]
runs = []
for _ in range(3):
    t1, _ = generate([p1], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False))
    t256, _ = generate([p1], SamplingParams(temperature=0, max_tokens=256, ignore_eos=True, detokenize=False))
    runs.append((t256 - t1) / 255 * 1e3)
print(json.dumps(dict(bs1_ms_per_token=round(sorted(runs)[1], 3))), flush=True)

if a.fixed:
    i, o, n_req = a.fixed
    seed(2)
    prompts = [[randint(0, 10000) for _ in range(i)] for _ in range(n_req)]
    wall, n = generate(prompts, SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=o, detokenize=False))
    print(json.dumps(dict(fixed=dict(input=i, output=o, requests=n_req, output_tokens=n, wall_s=round(wall, 3),
                                     output_tok_s=round(n / wall, 1)))), flush=True)
os._exit(0)  # as vllm_spec.py: vLLM's engine process can keep a finished run's interpreter from exiting
