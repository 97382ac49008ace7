"""vLLM 0.26's n-gram speculative decoding at batch 1, the peer of benchmarks/spec_decode.py's `ngram` section.

On the GPU machine, through the peer's runner (../shared/peer/README.md; the path is relative to .peer6):
    bash .peer6/device.sh ../benchmarks/vllm_spec.py [--spec both|off|on] [--num-speculative-tokens 4]

The Llama-3-8B shape with random ("dummy") bf16 weights, offline API, CUDA graphs on: vllm_bench.py's config and
LLM arguments, with speculative_config={"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
"prompt_lookup_min": 2} when speculating. The prompt: python `random.seed(3)`, 64 ids randint(0, 10000), that
pattern repeated to --prompt-len (1024) ids (jlight's harness.ngram_prompt builds the same ids). Greedy,
ignore_eos, --max-tokens (256) tokens: ms/token = (t(N tokens) - t(1 token)) / (N - 1), median of --repeats (3),
after one untimed pair. With random weights the continuation is whatever the model makes, so the acceptance is
vLLM's own: from llm.get_metrics() (disable_log_stats=False), the growth over the timed calls of
vllm:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens and _num_accepted_tokens_per_pos; mean
acceptance length = 1 + accepted / drafts. A metric that is missing leaves its figure null, never the timing.

--spec both (the default) runs off, then on, each in a process of its own (two engines do not share the GPU's
memory well), and prints the speed-up. Prints one JSON line per measurement.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from random import randint, seed

ap = argparse.ArgumentParser()
ap.add_argument("--spec", default="both", choices=["both", "off", "on"])
ap.add_argument("--num-speculative-tokens", type=int, default=4)
ap.add_argument("--prompt-len", type=int, default=1024)
ap.add_argument("--max-tokens", type=int, default=256)
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--max-num-seqs", type=int, default=256)
ap.add_argument("--max-model-len", type=int, default=4096)
ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
a = ap.parse_args()

if a.spec == "both":
    rows = {}
    for spec in ("off", "on"):
        argv = [f"--{key.replace('_', '-')}={value}" for key, value in vars(a).items() if key != "spec"]
        child = subprocess.Popen([sys.executable, os.path.abspath(__file__), *argv, f"--spec={spec}"],
                                 stdout=subprocess.PIPE, text=True)
        for line in child.stdout:
            print(line, end="", flush=True)
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and "ngram" in record:
                rows[spec] = record["ngram"]
        child.wait()
        if child.returncode:
            print(json.dumps(dict(error=f"--spec {spec} exited {child.returncode}")), flush=True)
    off, on = (rows.get(s, {}).get("ms_per_token") for s in ("off", "on"))
    if off and on:
        print(json.dumps(dict(ngram_speedup=round(off / on, 3))), flush=True)
    sys.exit(0 if len(rows) == 2 else 1)

spec = None
if a.spec == "on":
    spec = {"method": "ngram", "num_speculative_tokens": a.num_speculative_tokens, "prompt_lookup_max": 4,
            "prompt_lookup_min": 2}
    try:  # vLLM's n-gram proposer is compiled by numba
        import numba  # noqa: F401
    except Exception as e:  # noqa: BLE001 - said in one line, not a traceback from inside vLLM
        print(json.dumps(dict(error=f"vLLM's ngram proposer needs numba: {type(e).__name__}: {e}"[:400])), flush=True)
        sys.exit(1)

import vllm  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402

d = tempfile.mkdtemp(prefix="llama3_8b_dummy_")
json.dump(dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
               num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
               rope_theta=500000.0, max_position_embeddings=8192, rms_norm_eps=1e-5, hidden_act="silu",
               tie_word_embeddings=False, torch_dtype="bfloat16", bos_token_id=128000, eos_token_id=128001),
          open(os.path.join(d, "config.json"), "w"))
t = time.time()
llm = LLM(model=d, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", max_model_len=a.max_model_len,
          max_num_seqs=a.max_num_seqs, gpu_memory_utilization=a.gpu_memory_utilization, seed=0,
          speculative_config=spec, disable_log_stats=False)
print(json.dumps(dict(spec=a.spec, vllm=vllm.__version__, init_s=round(time.time() - t, 1))), flush=True)

SPEC_METRICS = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
                "vllm:spec_decode_num_accepted_tokens": "accepted"}
PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos"


def spec_counters() -> dict:
    """vLLM's speculative-decoding counters now (summed over engines); {} where get_metrics fails."""
    try:
        metrics = llm.get_metrics()
    except Exception as e:  # noqa: BLE001 - the timing stands without the counters
        return dict(metrics_error=f"{type(e).__name__}: {e}"[:200])
    out = {}
    for m in metrics:
        name = getattr(m, "name", None)
        if name in SPEC_METRICS and getattr(m, "value", None) is not None:
            out[SPEC_METRICS[name]] = out.get(SPEC_METRICS[name], 0) + m.value
        elif name == PER_POSITION and getattr(m, "values", None) is not None:
            pos = out.setdefault("per_position", [])
            pos.extend([0] * (len(m.values) - len(pos)))
            for i, v in enumerate(m.values):
                pos[i] += v
    return out


def acceptance(before: dict, after: dict) -> dict:
    """The counters' growth over the timed calls; None where a counter was not reported."""
    if "metrics_error" in before or "metrics_error" in after:
        return dict(metrics_error=before.get("metrics_error") or after.get("metrics_error"))
    d = {key: (after[key] - before.get(key, 0) if key in after else None) for key in SPEC_METRICS.values()}
    if "per_position" in after:
        prev = before.get("per_position", [])
        d["accepted_per_position"] = [v - (prev[i] if i < len(prev) else 0) for i, v in enumerate(after["per_position"])]
    if d["drafts"] and d["accepted"] is not None:
        d["accepted_per_draft"] = d["accepted"] / d["drafts"]
        d["mean_acceptance_length"] = 1 + d["accepted_per_draft"]
    if d["draft_tokens"] and d["accepted"] is not None:
        d["draft_acceptance_rate"] = d["accepted"] / d["draft_tokens"]
    return d


def generate(prompt, max_tokens):
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}],
                 SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False), use_tqdm=False)
    return time.perf_counter() - t


seed(3)
unit = [randint(0, 10000) for _ in range(64)]
prompt = (unit * math.ceil(a.prompt_len / len(unit)))[:a.prompt_len]

n = a.max_tokens
t = time.time()
generate(prompt, 1), generate(prompt, n)  # warm-up, untimed
warmup_s = time.time() - t
before = spec_counters()
runs = []
for _ in range(a.repeats):
    t1 = generate(prompt, 1)
    tn = generate(prompt, n)
    runs.append((tn - t1) / (n - 1) * 1e3)
after = spec_counters()
runs.sort()
print(json.dumps(dict(ngram=dict(spec=a.spec, speculative_config=spec, prompt_tokens=len(prompt), max_tokens=n,
                                 ms_per_token=round(runs[len(runs) // 2], 3), runs_ms=[round(r, 3) for r in runs],
                                 warmup_s=round(warmup_s, 1), acceptance=acceptance(before, after)))), flush=True)
# vLLM's engine process can keep a finished run's interpreter from exiting; the result is printed, so the
# process ends here.
os._exit(0)
