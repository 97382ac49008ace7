"""Model load time: HF safetensors vs a `jlight convert` orbax checkpoint of the same weights.

1. Writes random Llama-3-8B-shaped bfloat16 weights as a sharded HF safetensors checkpoint
   (config.json + model-*.safetensors + index) into a temp dir. Values are random bit patterns
   (random sign, mantissa and a small exponent range), not normal samples: as incompressible
   as real weights (orbax compresses what it writes), but cheap to make for 8e9 values.
2. Times `jlight.loading.load_model(dir)` (stream + cast + device_put + stack per tensor) until
   every array is on the device.
3. Converts that directory with `jlight.convert.convert` (timed: load + orbax write).
4. Times `load_model(converted dir)`: orbax restores each array straight onto the device.
5. With the default model available locally (SmolLM2-135M-Instruct Q4_1 GGUF), the same for
   it: GGUF load (dequantization) vs its converted orbax checkpoint.

6. With --copy-paths: the copy the load is made of, over the checkpoint's own files (memory-mapped, from the page
   cache, in 128 MiB pieces): jax.device_put of the mapped bytes (the loader's path), the same through pinned host
   memory, and the host's own copy of them, on 1, 8 and 16 threads.
7. With --startup: the start of an engine over the HF checkpoint to ready (`jlight.LLM(dir)`: load,
   every step bucket compiled), each in a new process, cold (an empty compilation cache) and then warm
   (the cache the cold start filled), --startup-runs pairs; each start's phases from its own "ready in"
   line, and the XLA rematerialization warnings it printed ("Can't reduce memory use"), counted.

The files were just written, so reads are served from the OS page cache unless
--drop-caches succeeds (needs root); the JSON records which it was.

  python benchmarks/load_time.py --out DIR            # Llama-3-8B shape, ~16 GB x2 on disk (GPU box)
  python benchmarks/load_time.py --small --out DIR    # scaled-down shape, CPU, well under a minute
  python benchmarks/load_time.py --startup --no-smollm2 --out DIR   # + cold and warm starts to ready (GPU box)
  python benchmarks/load_time.py --copy-paths --startup-only --no-smollm2 --out DIR   # the load's copies alone
Prints a table and writes DIR/load_time.json.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

# Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json), and a scaled-down shape for CPU checks.
LLAMA3_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192, rope_theta=500000.0)
SMALL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=3584, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192, rope_theta=500000.0)


def hf_config(shape: dict, **overrides) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000,
            "eos_token_id": 128001, "hidden_act": "silu", **shape, **overrides}


def write_random_safetensors(directory: str, shape: dict, *, config: dict | None = None, seed: int = 0,
                             same_weights_every_layer: bool = False, zero_lm_head_rows: range = range(0)) -> int:
    """Write the checkpoint one layer per file (host memory stays at one layer); return bytes.

    config: what config.json holds (default hf_config(shape)). same_weights_every_layer: draw
    one layer's random tensors and write them for every layer (each layer still has its own
    tensors in the files; only the values repeat), which makes an 8B checkpoint several times
    faster to write. zero_lm_head_rows: lm_head rows set to 0 (their logits are exactly 0).
    """
    import ml_dtypes
    from safetensors.numpy import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config if config is not None else hf_config(shape), f, indent=1)
    E, F, V = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = E // shape["num_attention_heads"]
    q, kv = shape["num_attention_heads"] * head_dim, shape["num_key_value_heads"] * head_dim
    rng = np.random.default_rng(seed)

    def tensor(*dims):
        bits = rng.integers(0, 1 << 16, size=dims, dtype=np.uint16)  # [*dims]
        # sign, 7 mantissa bits and the exponent's low 4 bits random; exponent 0b0111xxxx, i.e.
        # magnitudes in [2^-15, 2): 12 random bits of 16 (in place: 8e9 values must be cheap).
        np.bitwise_and(bits, 0x87FF, out=bits)
        np.bitwise_or(bits, 0x3800, out=bits)
        return bits.view(ml_dtypes.bfloat16)

    def layer_tensors() -> dict[str, np.ndarray]:
        return {
            "input_layernorm.weight": np.ones(E, ml_dtypes.bfloat16),
            "post_attention_layernorm.weight": np.ones(E, ml_dtypes.bfloat16),
            "self_attn.q_proj.weight": tensor(q, E), "self_attn.k_proj.weight": tensor(kv, E),
            "self_attn.v_proj.weight": tensor(kv, E), "self_attn.o_proj.weight": tensor(E, q),
            "mlp.gate_proj.weight": tensor(F, E), "mlp.up_proj.weight": tensor(F, E),
            "mlp.down_proj.weight": tensor(E, F),
        }

    weight_map, total = {}, 0

    def save(name: str, tensors: dict[str, np.ndarray]) -> None:
        nonlocal total
        save_file(tensors, os.path.join(directory, name))
        weight_map.update({k: name for k in tensors})
        total += sum(t.nbytes for t in tensors.values())

    lm_head = tensor(V, E)
    lm_head[zero_lm_head_rows.start:zero_lm_head_rows.stop] = 0
    save("model-globals.safetensors", {"model.embed_tokens.weight": tensor(V, E), "lm_head.weight": lm_head,
                                       "model.norm.weight": np.ones(E, ml_dtypes.bfloat16)})
    del lm_head
    shared = layer_tensors() if same_weights_every_layer else None
    for i in range(shape["num_hidden_layers"]):
        layer = shared if shared is not None else layer_tensors()  # one layer in memory at a time
        save(f"model-layer{i:03d}.safetensors", {f"model.layers.{i}.{k}": v for k, v in layer.items()})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return total


def drop_page_cache() -> bool:
    """Ask the kernel to forget cached file pages (root only); True when it worked."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def timed_load(model: str, drop_caches: bool) -> tuple[float, bool]:
    """Seconds for load_model(model) in bfloat16 until every param is on the device."""
    from jlight.loading import load_model

    dropped = drop_page_cache() if drop_caches else False
    start = time.perf_counter()
    loaded = load_model(model, dtype="bfloat16")
    jax.block_until_ready(loaded.params)
    seconds = time.perf_counter() - start
    del loaded
    return seconds, dropped


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def measure(label: str, source: str, work: str, drop_caches: bool) -> dict:
    from jlight.convert import convert

    converted = os.path.join(work, label + "-orbax")
    source_s, source_cold = timed_load(source, drop_caches)
    start = time.perf_counter()
    convert(source, converted, dtype="bfloat16")
    convert_s = time.perf_counter() - start
    orbax_s, orbax_cold = timed_load(converted, drop_caches)
    return {"model": label, "source": source, "source_bytes": dir_bytes(source) if os.path.isdir(source) else os.path.getsize(source),
            "orbax_bytes": dir_bytes(converted), "source_load_s": source_s, "convert_s": convert_s,
            "orbax_load_s": orbax_s, "cold_cache": source_cold and orbax_cold}


def copy_paths(checkpoint: str, piece_bytes: int = 128 << 20, threads=(1, 8, 16)) -> list[dict]:
    """GB/s of the checkpoint's files' bytes (memory-mapped, 128 MiB pieces) put on the device directly, through
    pinned host memory (where the device has it), and copied on the host, on each number of threads; then
    jlight's own load of the files (load_model), twice in this process."""
    import concurrent.futures

    device = jax.devices()[0]
    pieces = []
    for name in sorted(os.listdir(checkpoint)):
        if name.endswith(".safetensors"):
            mm = np.memmap(os.path.join(checkpoint, name), dtype=np.uint8, mode="r")
            pieces += [mm[i:i + piece_bytes] for i in range(0, len(mm), piece_bytes)]
    for p in pieces:
        int(p[::4096].sum())  # every page touched: in the page cache
    nbytes = sum(p.nbytes for p in pieces)
    pinned = device.platform != "cpu" and "pinned_host" in {m.kind for m in device.addressable_memories()}
    paths = {"mapped file -> device": lambda a: jax.device_put(a, device),
             "host copy (numpy)": np.array}
    if pinned:
        to_pinned = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
        on_device = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
        paths["mapped file -> pinned -> device"] = lambda a: jax.device_put(jax.device_put(a, to_pinned), on_device)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:  # XLA's pinned pool grown first (it pins once)
            jax.block_until_ready(list(pool.map(paths["mapped file -> pinned -> device"], pieces)))
    rows = []
    for n in threads:
        for name, put in paths.items():
            jax.block_until_ready(put(pieces[0]))
            start = time.perf_counter()
            with concurrent.futures.ThreadPoolExecutor(n) as pool:
                jax.block_until_ready(list(pool.map(put, pieces)))  # all of them held: at most the checkpoint's size
            seconds = time.perf_counter() - start
            rows.append({"path": name, "threads": n, "bytes": nbytes, "seconds": seconds})
            print(f"{name:32s} {n:2d} threads: {nbytes / seconds / 1e9:6.2f} GB/s ({nbytes / 1e9:.2f} GB)", flush=True)
    # The engine's own load of the same files, twice: the second finds the per-shape transposes compiled in this
    # process, so the difference is their compile (a warm start compiles them again: they are too quick for
    # JAX's persistent cache).
    from jlight.loading import load_model

    for attempt in ("first", "second"):
        start = time.perf_counter()
        loaded = load_model(checkpoint, dtype="bfloat16", unstacked=True)
        jax.block_until_ready(loaded.params)
        seconds = time.perf_counter() - start
        name = f"jlight load_model, {attempt}"
        rows.append({"path": name, "threads": min(8, os.cpu_count() or 1), "bytes": nbytes, "seconds": seconds})
        print(f"{name:32s} {rows[-1]['threads']:2d} threads: {nbytes / seconds / 1e9:6.2f} GB/s ({seconds:.2f} s)", flush=True)
        del loaded
    return rows


STARTUP_CHILD = """
import json, sys, time
t0 = time.perf_counter()
import jlight
llm = jlight.LLM(sys.argv[1], dtype="bfloat16", max_model_len=int(sys.argv[2]), compilation_cache_dir=sys.argv[4],
                 **{"compile_threads": json.loads(sys.argv[3]), **json.loads(sys.argv[5])})  # --engine-options win
e = llm.engine
store = e.runner.executable_store
print("READY " + json.dumps({"in_process_s": time.perf_counter() - t0, "load_s": e.load_seconds,
      "phases_s": e.startup_seconds, "compile_s": e.warmup_seconds, "buckets": e.runner.buckets,
      "executables_loaded": store.loaded if store else None, "executables_saved": store.saved if store else None,
      "num_pages": e.runner.num_pages, "in_use_at_sizing": e.memory_in_use_at_sizing,
      "prefetched": store.prefetch.taken if store is not None and store.prefetch is not None else None,
      "warmup_timings": e.runner.warmup_timings}), flush=True)
"""


def timed_start(model: str, cache: str, max_model_len: int, compile_threads: int | None, options: dict) -> dict:
    """One process that builds jlight.LLM(model, **options) (every bucket compiled) and exits: its wall time to ready."""
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-c", STARTUP_CHILD, model, str(max_model_len), json.dumps(compile_threads), cache,
                             json.dumps(options)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ready_s, report = None, None
    for line in proc.stdout:
        if line.startswith("READY "):
            ready_s, report = time.perf_counter() - start, json.loads(line[len("READY "):])
    err = proc.stderr.read()
    proc.wait()
    if report is None:
        raise RuntimeError(f"the engine did not start: {err[-2000:]}")
    return {"ready_s": ready_s, **report, "remat_warnings": err.count("Can't reduce memory use")}


def measure_startup(model: str, work: str, runs: int, max_model_len: int, compile_threads: int | None,
                    options: dict) -> dict:
    starts = {"cold": [], "warm": []}
    for i in range(runs):
        cache = os.path.join(work, f"xla-cache-{i}")
        shutil.rmtree(cache, ignore_errors=True)
        for kind in ("cold", "warm"):
            starts[kind].append(timed_start(model, cache, max_model_len, compile_threads, options))
            r = starts[kind][-1]
            phases = r.get("phases_s", {})
            print(f"start {kind} {json.dumps(options)}: ready in {r['ready_s']:.1f} s (process start and imports "
                  f"{r['ready_s'] - r['in_process_s'] + (r['in_process_s'] - sum(phases.values()) - r['compile_s']):.1f} s, "
                  f"load {r['load_s']:.1f} s, prepare {phases.get('prepare', 0):.1f} s, set-up {phases.get('setup', 0):.1f} s, "
                  f"compile {r['compile_s']:.1f} s, {len(r['buckets'])} buckets, {r['executables_loaded']} loaded "
                  f"compiled, {r['prefetched']} of them prefetched, {r['executables_saved']} saved; a KV pool of "
                  f"{r['num_pages']} pages sized beside {(r.get('in_use_at_sizing') or 0) / 2**20:.0f} MiB in use), "
                  f"{r['remat_warnings']} remat warnings", flush=True)
            for t in r["warmup_timings"]:
                print("  " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in t.items()))
        shutil.rmtree(cache, ignore_errors=True)
    return {"compile_threads": compile_threads, "max_model_len": max_model_len, "engine_options": options,
            **{f"{kind}_ready_s_median": float(np.median([r["ready_s"] for r in rs])) for kind, rs in starts.items()},
            "starts": starts}


def local_default_gguf() -> str | None:
    """The default model's .gguf if it is already in jlight's cache (never downloads)."""
    from jlight.loading.default_model import GGUF_MEMBER, cache_dir

    path = os.path.join(cache_dir(), "models", os.path.basename(GGUF_MEMBER))
    return path if os.path.isfile(path) else None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="scaled-down Llama-3 shape (CPU check)")
    parser.add_argument("--layers", type=int, default=None, help="override the number of layers")
    parser.add_argument("--out", default=".", help="directory for load_time.json")
    parser.add_argument("--work-dir", default=None, help="where to write the checkpoints (default: a temp dir, removed after)")
    parser.add_argument("--drop-caches", action="store_true", help="drop the OS page cache before each load (root)")
    parser.add_argument("--no-smollm2", action="store_true", help="skip the SmolLM2 GGUF comparison")
    parser.add_argument("--copy-paths", action="store_true", help="also time the load's copy paths (see the docstring)")
    parser.add_argument("--startup", action="store_true", help="also time engine starts to ready, cold and warm")
    parser.add_argument("--startup-only", action="store_true", help="with --startup: skip the load and convert timings")
    parser.add_argument("--startup-runs", type=int, default=2, help="cold + warm pairs")
    parser.add_argument("--max-model-len", type=int, default=4096, help="of the started engines")
    parser.add_argument("--compile-threads", type=int, default=None, help="EngineConfig.compile_threads (default: auto)")
    parser.add_argument("--engine-options", action="append", type=json.loads, default=None, metavar="JSON",
                        help='engine options of the started engines, e.g. \'{"trace_layers_once": false}\'; repeat to '
                             "time several sets of starts in one run (default: one set, {})")
    args = parser.parse_args(argv)
    shape = dict(SMALL if args.small else LLAMA3_8B)
    if args.layers is not None:
        if args.layers < 1:
            raise SystemExit(f"--layers {args.layers} must be >= 1")
        shape["num_hidden_layers"] = args.layers
    work = args.work_dir or tempfile.mkdtemp(prefix="jlight_load_time_")
    rows = []
    try:
        hf_dir = os.path.join(work, "hf")
        start = time.perf_counter()
        nbytes = write_random_safetensors(hf_dir, shape)
        print(f"wrote {nbytes / 1e9:.2f} GB of random bf16 safetensors in {time.perf_counter() - start:.1f}s")
        label = ("llama3-8b-shape-small" if args.small else "llama3-8b-shape") + f"-{shape['num_hidden_layers']}L"
        if not args.startup_only:
            rows.append(measure(label, hf_dir, work, args.drop_caches))
        startup = [measure_startup(hf_dir, work, args.startup_runs, args.max_model_len, args.compile_threads, options)
                   for options in args.engine_options or [{}]] if args.startup else None
        # After the starts: this process's own JAX client takes most of the device's memory (75% by default), and a
        # start beside it ran out of time on the H100.
        copies = copy_paths(hf_dir) if args.copy_paths else None
        shutil.rmtree(hf_dir, ignore_errors=True)
        gguf = None if args.no_smollm2 else local_default_gguf()
        if gguf:
            rows.append(measure("smollm2-135m-q4_1-gguf", gguf, work, args.drop_caches))
        else:
            print("SmolLM2: skipped (" + ("--no-smollm2" if args.no_smollm2 else "the default GGUF is not in jlight's cache") + ")")
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import result_header

    result = {**result_header(argv), "benchmark": "load_time", "device": str(jax.devices()[0].device_kind),
              "shape": shape, "rows": rows, "copy_paths": copies, "startup": startup}
    print(f"\n{'model':34s} {'src GB':>7s} {'src load s':>10s} {'convert s':>9s} {'orbax GB':>8s} {'orbax load s':>12s} {'speed-up':>8s} cold")
    for r in rows:
        print(f"{r['model']:34s} {r['source_bytes'] / 1e9:7.2f} {r['source_load_s']:10.2f} {r['convert_s']:9.2f} "
              f"{r['orbax_bytes'] / 1e9:8.2f} {r['orbax_load_s']:12.2f} {r['source_load_s'] / r['orbax_load_s']:7.1f}x {r['cold_cache']}")
    for st in startup or []:
        print(f"start to ready ({label}, compile_threads={args.compile_threads}, {json.dumps(st['engine_options'])}): "
              f"cold {st['cold_ready_s_median']:.1f} s, warm {st['warm_ready_s_median']:.1f} s (medians of {args.startup_runs})")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "load_time.json")
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
