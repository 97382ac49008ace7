"""The default model on the CPU, on the user's path: the first answer of `jlight generate` (cold and warm)
and batch-1 decode of SmolLM2-135M-Instruct through `jlight.LLM().generate` with default options, next to
transformers and llama.cpp (llama-cpp-python) on the same GGUF, in the same run on the same machine.

- First answer: `jlight generate "What is the capital of France?" --max-tokens 32` as a new process, its wall
  time from start to exit. Cold: an empty compilation cache (the GGUF already in $JLIGHT_CACHE: the download
  is not timed); warm: the same command again over the cache the cold run filled.
- Decode: greedy, a 64-token prompt (a new one each call, so no prefix-cache hit), batch 1; tokens/s excludes
  the prefill: (N - 1) / (time for N new tokens - time for 1 new token), the median of --repeats calls.
  jlight: `jlight.LLM()` (default options: on the CPU the GGUF's Q4_1 / Q8_0 linear weights kept as stored and
  multiplied in float32 by jlight's C++ kernels, every bucket compiled at start-up); jlight-f32: the same with
  every weight dequantized to float32 at load (`gguf_weights="dequantize"`);
  transformers: the same GGUF dequantized to float32, eager, torch threads = the cores; llama.cpp: the same
  weights as a float32 GGUF (dequantized from the Q4_1 file, the numbers jlight runs), and the Q4_1 file
  itself (llama.cpp's own 4-bit kernels), threads = the cores.
- f32-line: the physical line of jlight's float32 step, the model's matmuls alone (every weight once, batch 1,
  one XLA program over random weights of the GGUF's shapes): tokens/s = 1 / its median time; with the read rate
  it reaches and numpy's copy rate on the same host.
- jlight-ngram (not in the default --engines): input-grounded prompts (GROUNDED: chat tasks, and completions
  that copy their prompt), batch 1, greedy, n-gram speculation off against on in one process: tokens/s per
  prompt, the ratio, the acceptance, and whether both gave the same tokens.
- Each engine runs in its own process, one after the other, each repeat again (interleaved), and the
  host's CPU use just before each is recorded: on a shared machine, quiet means "busy" near 0.

- --model PATH: another GGUF file instead of the default model, for every engine (llama.cpp-q4_1 then runs that
  file's own quantization types; the first answers stay the default model's).

  python benchmarks/cpu_decode.py [--new-tokens 128] [--repeats 3] [--first-answers 3] [--out DIR] [--model PATH]
                                  [--engines jlight,jlight-f32,f32-line,transformers,llama.cpp-f32,llama.cpp-q4_1]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import result_header  # noqa: E402

PROMPT = "What is the capital of France?"
ENGINES = ("jlight", "jlight-f32", "f32-line", "transformers", "llama.cpp-f32", "llama.cpp-q4_1", "jlight-ngram")


def cpu_busy(window: float = 2.0) -> float:
    """The fraction of the host's CPU time spent busy over `window` seconds (from /proc/stat)."""
    def read():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait

    t0, i0 = read()
    time.sleep(window)
    t1, i1 = read()
    return 1.0 - (i1 - i0) / max(1, t1 - t0)


# ------------------------------------------------------------------ decode rates (one engine per child)

def decode_rate(generate, n_new: int, repeats: int, vocab_size: int = 40000) -> dict:
    """generate(prompt_ids, n) runs one greedy request of n new tokens. Median over repeats. The prompts' ids
    are drawn from [100, min(40000, vocab_size))."""
    rng = np.random.default_rng(0)

    def timed(n):
        prompt = rng.integers(100, min(40000, vocab_size), 64).tolist()
        t = time.perf_counter()
        generate(prompt, n)
        return time.perf_counter() - t

    timed(2)
    timed(n_new)  # warm-up: compiles, allocations, caches
    rates = [(n_new - 1) / (timed(n_new) - timed(1)) for _ in range(repeats)]
    return {"decode_tok_s": float(np.median(rates)), "decode_tok_s_all": rates}


def jlight_child(gguf: str, n_new: int, repeats: int, **options) -> dict:
    """jlight.LLM(gguf, **options) (default options: the GGUF's quantized linear weights kept and multiplied in
    float32 by the CPU kernels). weight_bytes: what a decode step reads of the weights (all
    but the embedding, of which it reads a row)."""
    import jax

    import jlight
    from jlight import SamplingParams

    t = time.perf_counter()
    llm = jlight.LLM(gguf, **options)
    start_s = time.perf_counter() - t

    def generate(prompt, n):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))

    engine = llm.engine
    params = engine.runner.params
    kinds = sorted({type(w).__name__ if hasattr(w, "_fields") else str(w.dtype)
                    for w in jax.tree.leaves(params, is_leaf=lambda x: hasattr(x, "_fields"))})
    weight_bytes = sum(a.nbytes for k, v in params.items() if k != "embed" for a in jax.tree.leaves(v))
    rate = decode_rate(generate, n_new, repeats, engine.model_config.vocab_size)
    name = f"jlight (jax {jax.__version__}{', ' + ', '.join(f'{k}={v}' for k, v in options.items()) if options else ''})"
    return {"engine": name, "start_s": start_s, "buckets": engine.runner.buckets, "weights": kinds,
            "weight_bytes": weight_bytes, "read_gb_s": weight_bytes * rate["decode_tok_s"] / 1e9, **rate}


def jlight_f32_child(gguf: str, n_new: int, repeats: int) -> dict:
    """jlight with every weight dequantized to float32 at load (the CPU kernels still run its attention)."""
    return jlight_child(gguf, n_new, repeats, gguf_weights="dequantize")


def f32_line_child(gguf: str, n_new: int, repeats: int) -> dict:
    """The physical line of a float32 decode step: the model's matmuls alone at batch 1 (per layer the fused
    q/k/v, o, fused gate/up and down projections, then the LM head; the shapes of the GGUF's config) over
    random float32 weights, one XLA program, as jlight's unrolled step reads them: every weight byte once.
    Also the host's copy rate (numpy, read + write) beside it."""
    import jax
    import jax.numpy as jnp

    from jlight.loading.gguf_loader import load_gguf_model

    _, c, _ = load_gguf_model(gguf)
    h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    rng = np.random.default_rng(0)
    shapes = [(h, q + 2 * kv), (q, h), (h, 2 * c.intermediate_size), (c.intermediate_size, h)]
    layers = [[jnp.asarray(rng.standard_normal(s, np.float32)) for s in shapes] for _ in range(c.num_layers)]
    head = jnp.asarray(rng.standard_normal((h, c.vocab_size), np.float32))

    @jax.jit
    def step(x, layers, head):
        for qkv, o, gate_up, down in layers:
            x = x + (x @ qkv)[:, :q] @ o
            g = x @ gate_up
            x = x + (jax.nn.silu(g[:, : c.intermediate_size]) * g[:, c.intermediate_size:]) @ down
        return x @ head

    x = jnp.ones((1, h), jnp.float32)
    step(x, layers, head).block_until_ready()
    times = []
    for _ in range(max(20, n_new // 4) * repeats):
        t = time.perf_counter()
        step(x, layers, head).block_until_ready()
        times.append(time.perf_counter() - t)
    weight_bytes = sum(a.nbytes for a in jax.tree.leaves((layers, head)))
    a, b = np.ones(64 << 20, np.float32), np.empty(64 << 20, np.float32)
    copies = []
    for _ in range(5):
        t = time.perf_counter()
        np.copyto(b, a)
        copies.append(time.perf_counter() - t)
    return {"engine": f"XLA float32 matmul chain (jax {jax.__version__}), {weight_bytes / 1e6:.0f} MB of weights a token",
            "weight_bytes": weight_bytes, "step_ms": 1e3 * float(np.median(times)), "read_gb_s": weight_bytes / float(np.median(times)) / 1e9,
            "numpy_copy_gb_s": 2 * a.nbytes / min(copies) / 1e9, "decode_tok_s": 1.0 / float(np.median(times)),
            "decode_tok_s_all": [1.0 / t for t in times]}


def transformers_child(gguf: str, n_new: int, repeats: int) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                                 dtype=torch.float32).eval()

    def generate(prompt, n):
        with torch.no_grad():
            model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)

    return {"engine": f"transformers {transformers.__version__} (torch {torch.__version__}, {torch.get_num_threads()} threads)",
            "dtype": "float32", **decode_rate(generate, n_new, repeats)}


def llama_cpp_child(gguf: str, n_new: int, repeats: int) -> dict:
    import llama_cpp

    threads = os.cpu_count() or 1
    llm = llama_cpp.Llama(model_path=gguf, n_ctx=512, n_threads=threads, n_threads_batch=threads, n_batch=512,
                          verbose=False)

    def generate(prompt, n):
        llm.reset()  # no reuse of the previous call's K/V
        for i, _ in enumerate(llm.generate(prompt, temp=0.0, top_k=1, reset=True)):
            if i + 1 >= n:
                break

    return {"engine": f"llama.cpp (llama-cpp-python {llama_cpp.__version__}, {threads} threads)", **decode_rate(generate, n_new, repeats)}


def f32_gguf(source: str, target: str) -> str:
    """`source` with every tensor dequantized to float32 (metadata copied): the weights jlight runs."""
    import gguf
    from gguf.quants import dequantize

    if os.path.isfile(target):
        return target
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target + ".partial", arch=reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = 0 if name == "general.file_type" else field.contents()  # 0: LLAMA_FTYPE_ALL_F32
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub)
    for t in reader.tensors:
        array = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(d) for d in reversed(t.shape)])
        writer.add_tensor(t.name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(target + ".partial", target)
    return target


# Input-grounded tasks (the answer copies spans of the prompt): n-gram speculation's case.
PASSAGE = ("The Amazon rainforest covers much of the Amazon basin of South America. The basin encompasses seven "
           "million square kilometres, of which five and a half million are covered by the rainforest. The region "
           "includes territory belonging to nine nations, and the majority of the forest is contained within Brazil, "
           "with sixty percent, followed by Peru with thirteen percent and Colombia with ten percent.")
CODE = ("def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(valuse)\n\n"
        "def variance(values):\n    m = mean(values)\n    return sum((v - m) ** 2 for v in values) / len(values)\n")
# (name, chat message or raw completion text): chat tasks a user would give, and completions whose
# continuation copies the prompt (SmolLM2-135M copies faithfully there, less so in chat).
GROUNDED = (("chat: repeat", "chat", f"Copy the text between the quotes exactly, nothing else.\n\n\"{PASSAGE}\""),
            ("chat: rename in code", "chat", "Rename the function mean to average everywhere in this code and print "
                                             f"the whole code.\n\n```python\n{CODE}```"),
            ("completion: copy", "text", f"Original: {PASSAGE}\nCopy: "),
            ("completion: fix code", "text", f"# buggy version\n{CODE}\n# fixed version\n"))
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def jlight_ngram_child(gguf: str, n_new: int, repeats: int) -> dict:
    """Batch-1 greedy answers (up to n_new tokens or EOS) to the GROUNDED prompts with n-gram speculation off
    and on (default options otherwise): decode tokens/s per prompt (the answer's time less its first
    token's, over its tokens after the first), the acceptance, and whether both answers are the same tokens."""
    import jax

    import jlight
    from jlight import SamplingParams

    rows = {}
    for name, options in (("off", {}), ("ngram", {"speculative_config": NGRAM})):
        llm = jlight.LLM(**options)
        prompts = [llm.apply_chat_template([{"role": "user", "content": text}]) if kind == "chat"
                   else llm.engine.tokenizer.encode(text) for _, kind, text in GROUNDED]

        def run(prompt, n):
            t = time.perf_counter()
            out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
            return time.perf_counter() - t, out[0].outputs[0].token_ids

        run(prompts[0], n_new)  # warm-up
        per_prompt = []
        for prompt in prompts:
            first = min(run(prompt, 1)[0] for _ in range(2))
            before = llm.engine.stats()
            times, ids = zip(*(run(prompt, n_new) for _ in range(repeats)))
            after = llm.engine.stats()
            drafts = after.spec_num_draft_tokens - before.spec_num_draft_tokens
            accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
            verified = after.spec_num_drafts - before.spec_num_drafts
            per_prompt.append({"tokens": len(ids[0]), "tok_s": (len(ids[0]) - 1) / (float(np.median(times)) - first),
                               "ids": ids[0], "acceptance": accepted / drafts if drafts else None,
                               "kept_per_verify": accepted / verified if verified else None})
        rows[name] = per_prompt
        del llm
    table = []
    for (label, _, _), off, on in zip(GROUNDED, rows["off"], rows["ngram"]):
        table.append({"prompt": label, "tokens": off["tokens"], "off_tok_s": off["tok_s"], "ngram_tok_s": on["tok_s"],
                      "speedup": on["tok_s"] / off["tok_s"], "acceptance": on["acceptance"],
                      "kept_per_verify": on["kept_per_verify"], "same_tokens": off["ids"] == on["ids"]})
    return {"engine": f"jlight (jax {jax.__version__}) n-gram {NGRAM}",
            "decode_tok_s": float(np.median([r["ngram_tok_s"] for r in table])), "prompts": table}


CHILDREN = {"jlight": jlight_child, "jlight-f32": jlight_f32_child, "f32-line": f32_line_child, "jlight-ngram": jlight_ngram_child,
            "transformers": transformers_child, "llama.cpp-f32": llama_cpp_child,
            "llama.cpp-q4_1": llama_cpp_child}


# ------------------------------------------------------------------ the user's first answer

def first_answer(env: dict) -> dict:
    """One `jlight generate` process: wall seconds to exit, and what it printed about itself."""
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jlight.cli", "generate", PROMPT, "--max-tokens", "32"],
                          capture_output=True, text=True, env=env, timeout=900)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"jlight generate failed: {proc.stderr[-2000:]}")
    ready = re.search(r"ready in ([\d.]+) s \(loading ([\d.]+) s, .*compiling ([\d.]+) s", proc.stderr)
    rate = re.search(r"([\d.]+) tokens/s\]", proc.stderr)
    return {"wall_s": wall, "ready_s": float(ready[1]) if ready else None, "load_s": float(ready[2]) if ready else None,
            "compile_s": float(ready[3]) if ready else None, "tok_s": float(rate[1]) if rate else None,
            "answer": proc.stdout.strip(), "stderr_lines": len(proc.stderr.splitlines())}


def first_answers(count: int, work: str) -> dict:
    runs = {"cold": [], "warm": []}
    for i in range(count):
        cache = os.path.join(work, f"xla{i}")
        env = dict(os.environ, JLIGHT_COMPILATION_CACHE_DIR=cache)
        busy = cpu_busy()
        runs["cold"].append({**first_answer(env), "busy_before": busy})
        busy = cpu_busy()
        runs["warm"].append({**first_answer(env), "busy_before": busy})
        shutil.rmtree(cache, ignore_errors=True)
        for kind in ("cold", "warm"):
            r = runs[kind][-1]
            print(f"first answer {kind}: {r['wall_s']:.1f} s to exit (ready {r['ready_s']} s, load {r['load_s']} s, "
                  f"compile {r['compile_s']} s), {r['tok_s']} tok/s, busy before {r['busy_before']:.0%}: {r['answer']!r}",
                  flush=True)
    return {kind: {"median_wall_s": float(np.median([r["wall_s"] for r in rs])), "runs": rs} for kind, rs in runs.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="decode: rounds over the engines (and calls per round)")
    ap.add_argument("--first-answers", type=int, default=3, help="cold + warm `jlight generate` pairs (0: none)")
    ap.add_argument("--engines", default=",".join(e for e in ENGINES if e != "jlight-ngram"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default=None, help="a GGUF file instead of the default model")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--gguf", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # one engine's decode rates, as a JSON line
        print("RESULT " + json.dumps(CHILDREN[a.child](a.gguf, a.new_tokens, a.repeats)), flush=True)
        return

    from jlight.loading.default_model import default_gguf_path

    gguf = a.model or default_gguf_path()
    engines = [e for e in a.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise SystemExit(f"--engines: unknown {sorted(unknown)}; choose from {', '.join(ENGINES)}")
    work = tempfile.mkdtemp(prefix="jlight_cpu_decode_")
    result = dict(result_header(), cpu=platform.processor() or platform.machine(), cores=os.cpu_count(),
                  model=gguf, new_tokens=a.new_tokens, prompt_tokens=64, rows=[])
    try:
        if a.first_answers:
            result["first_answer"] = first_answers(a.first_answers, work)
            # The C++ CPU kernels compile once per machine, at the first start after install (then they are in
            # $JLIGHT_CACHE/kernels, which the cold answers above keep): that one-time build, into an empty cache.
            from jlight.pallas_kernels import cpu_ffi
            t = time.perf_counter()
            cpu_ffi.build(os.path.join(work, "kernel_cache"))
            result["first_answer"]["kernel_build_s"] = time.perf_counter() - t
            print(f"one-time build of the CPU kernels: {result['first_answer']['kernel_build_s']:.1f} s", flush=True)
        f32_name = os.path.basename(gguf).removesuffix(".gguf") + ".F32.gguf" if a.model else "SmolLM2-135M-Instruct.F32.gguf"
        sources = {"llama.cpp-f32": f32_gguf(gguf, os.path.join(os.path.dirname(gguf), f32_name))
                   if "llama.cpp-f32" in engines else None, "llama.cpp-q4_1": gguf}
        runs: dict[str, list] = {e: [] for e in engines}
        for _ in range(a.repeats):
            for name in engines:
                busy = cpu_busy()
                proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", name, "--gguf",
                                       sources.get(name) or gguf, "--new-tokens", str(a.new_tokens), "--repeats", "1"],
                                      capture_output=True, text=True, timeout=1800)
                line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
                if line is None:
                    print(f"{name}: failed ({proc.stderr.strip().splitlines()[-1:]})", flush=True)
                    runs[name].append({"error": proc.stderr[-1500:], "busy_before": busy})
                    continue
                r = {**json.loads(line[len("RESULT "):]), "busy_before": busy}
                runs[name].append(r)
                print(f"{name:15s} {r['decode_tok_s']:7.1f} decode tok/s  (busy before {busy:.0%})  {r['engine']}", flush=True)
                for q in r.get("prompts", []):
                    print(f"{'':15s} {q['prompt']:22s} {q['tokens']:4d} tokens  off {q['off_tok_s']:6.1f}  n-gram "
                          f"{q['ngram_tok_s']:6.1f} tok/s  {q['speedup']:.2f}x  acceptance {q['acceptance'] or 0:.2f}  "
                          f"kept/verify {q['kept_per_verify'] or 0:.2f}  same tokens {q['same_tokens']}", flush=True)
        for name, rs in runs.items():
            ok = [r for r in rs if "error" not in r]
            result["rows"].append({"name": name, "engine": ok[0]["engine"] if ok else None,
                                   "decode_tok_s": float(np.median([r["decode_tok_s"] for r in ok])) if ok else None,
                                   "runs": rs})
        base = next((r["decode_tok_s"] for r in result["rows"] if r["name"] == "transformers"), None)
        print(f"\n{'engine':15s} {'decode tok/s (median)':>22s} {'x transformers':>15s}")
        for r in result["rows"]:
            ratio = f"{r['decode_tok_s'] / base:.2f}x" if base and r["decode_tok_s"] else "-"
            rate = f"{r['decode_tok_s']:.1f}" if r["decode_tok_s"] else "failed"
            print(f"{r['name']:15s} {rate:>22s} {ratio:>15s}")
        if "first_answer" in result:
            fa = result["first_answer"]
            print(f"first answer (jlight generate, 32 tokens): cold {fa['cold']['median_wall_s']:.1f} s, "
                  f"warm {fa['warm']['median_wall_s']:.1f} s (medians of {a.first_answers})")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "cpu_decode.json"), "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
